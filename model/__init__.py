"""The clean reference: a small, correct decoder-only GPT training stack split into named seams."""
