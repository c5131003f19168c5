"""Faults in the `position` subsystem."""
