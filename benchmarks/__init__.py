"""Performance benchmarks of the reference GPT against a plain single-file GPT."""
