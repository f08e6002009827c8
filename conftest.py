"""Root pytest glue: the ring attention harness plugin (options, markers, fixtures, report header).

Kept thin on purpose; everything lives in harness/pytest_plugin.py so it can be tested and reused.
"""

pytest_plugins = ["harness.pytest_plugin", "suites.plugin", "suites.reporting"]
