"""Harness: the command line, reference runs, and (later) the fault x seed bench and its scoring."""
