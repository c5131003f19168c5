"""Faults in the `collate` subsystem."""
