"""pytest files the harness acceptance tests run in a subprocess (not collected by default:
their names do not start with test_)."""
