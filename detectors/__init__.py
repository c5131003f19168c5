"""Detectors: automated debugging checks that watch a run and localize what they find (built in a later issue)."""
