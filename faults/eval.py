"""Faults in the `eval` subsystem."""
