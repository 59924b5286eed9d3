"""Fault handling of a run: the run folder, preflight checks, failures mapped to one error line, the report."""
