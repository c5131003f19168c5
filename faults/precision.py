"""Faults in the `precision` subsystem."""
