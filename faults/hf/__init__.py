"""Builtin faults of the HF target (``targets/hf``): one module per subsystem, each fault the buggy body of a
real function of transformers or accelerate (or of the target's thin glue), registered with ``target="hf"``."""

import faultbench.targets.hf  # noqa: E402,F401  (forbids hub access before a fault module imports transformers)
