"""The worker's version, in a module of its own so that the command line can read it without
importing the package (whose ``validate_worker_args`` imports the command line)."""

__version__ = "0.1.0"
