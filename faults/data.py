"""Faults in the `data` subsystem."""
