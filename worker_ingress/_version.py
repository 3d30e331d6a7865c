"""The worker's version, in a module of its own so that the command line takes it from here
rather than from the package, whose ``validate_worker_args`` imports the command line: no import
circle (tests/test_layout.py)."""

__version__ = "0.1.0"
