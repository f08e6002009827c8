"""Conformance suites for ring attention implementations (``pytest suites -n auto``)."""
