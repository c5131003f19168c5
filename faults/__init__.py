"""Fault registry: buggy replacements for the reference seams, one module per subsystem (built in a later issue)."""
