"""The project's benchmarks: scripts run from the repository root, as ``python
benchmarks/<name>.py`` or ``python -m benchmarks.<name>`` (docs/benchmarks.md lists them).

Every benchmark times its candidates with the one interleaved runner, :mod:`benchmarks.runner`;
:mod:`benchmarks.common` starts rank processes and reads memory high-water marks.
"""
