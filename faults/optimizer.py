"""Faults in the `optimizer` subsystem."""
