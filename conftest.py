"""Root pytest glue of a checkout: the plugins of the harness, the conformance layer and the suites.

Kept thin on purpose; the plugins live in their packages. An installed package registers the same
modules through ``pytest11`` entry points named after them, so pytest loads each once either way.
"""

pytest_plugins = [
    "harness.pytest_plugin",
    "conformance.pytest_plugin",
    "conformance.report_plugin",
    "suites.pytest_plugin",
]
