"""The black-box track: detectors that need only what ``faultbench.watch`` sees of any causal-LM training loop."""
