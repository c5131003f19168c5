"""Faults in the `model` subsystem."""
