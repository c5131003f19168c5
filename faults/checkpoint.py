"""Faults in the `checkpoint` subsystem."""
