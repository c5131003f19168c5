"""Peer tools: third-party training-debugging tools (torcheck, SageMaker Debugger's smdebug, TrainCheck, ...)
wrapped as baseline plugin detectors, so the bench runs them on exactly the cases it runs our detectors on
(`faultbench bench --plugin peers.<module> --detectors <id>`). Each adapter uses only the tool's documented API
and the run context, obeys the detectors' honesty rules (no import of `faults`, `model` or `harness`), and maps
what the tool reports to findings through a documented table; each tool lives in its own virtual environment
(`.venv-peers`, `.venv-smdebug`) and is imported only when its detector runs.
"""
