"""Run one unmodified training program with faultbench attached, and write what the watch saw as JSON.

    python -m wild.attach --out result.json [--mode optimizer|callback|none] -- train.py --key=value ...

The program runs as ``__main__`` (``runpy``), in this process, with its own arguments. ``--mode``:

- ``optimizer``: the one-line wrapper for a script-style loop (nanoGPT, minGPT). When the program has built its
  optimizer, the watch starts on it and on the module holding its parameters (the root ``nn.Module`` that owns every
  parameter the optimizer steps), exactly as ``w = faultbench.watch(model, optimizer).start()`` typed after the
  optimizer's line would; ``w.stop(exc)`` runs when the program ends or raises. The program's code is not touched.
- ``callback``: the program attaches faultbench itself, the documented way (``FaultbenchCallback`` for
  ``transformers.Trainer`` and TRL, ``FaultbenchLightning`` for Lightning); this only collects the watch it made.
- ``none``: no watch (the baseline run of the overhead figure); callback programs read ``WILD_BASELINE=1``.

Both modes time the run from the optimizer's construction to the program's end (``loop_s``): the training loop
with its evaluations, without the imports and data preparation before it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import runpy
import sys
import time
import traceback


def _root_module(params: list):
    """The nn.Module that owns all of ``params`` and is no other such module's child (the model the loop calls)."""
    import torch

    wanted = {id(p) for p in params}
    owners = [m for m in gc.get_objects() if isinstance(m, torch.nn.Module)
              and wanted <= {id(p) for p in m.parameters()}]
    children = {id(c) for m in owners for c in m.modules() if c is not m}
    roots = [m for m in owners if id(m) not in children]
    return min(roots, key=lambda m: sum(1 for _ in m.parameters())) if roots else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m wild.attach")
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", choices=("optimizer", "callback", "none"), default="optimizer")
    parser.add_argument("--declare", default=None, help="JSON for faultbench.watch(declare=...)")
    parser.add_argument("--golden", default=None, help="a golden envelope (JSON) every watch of the run is given")
    parser.add_argument("--save", default=None, help="write the first watch's to_dict() here (a golden's input)")
    parser.add_argument("program", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    program = [a for a in args.program if a != "--"]
    import torch

    torch.set_num_threads(1)
    import faultbench
    from faultbench.watch import Watch

    state = {"t0": None, "watches": [], "started": None}
    mode = args.mode

    made = Watch.__init__

    def recording_init(self, *a, **k):  # every watch the program (or its callback) makes
        if args.golden and k.get("golden") is None:  # the user's golden, as they would hand it to the watch
            k["golden"] = args.golden
        made(self, *a, **k)
        state["watches"].append(self)

    Watch.__init__ = recording_init
    depth = [0]

    def wrap(cls):
        init = cls.__init__

        def __init__(self, *a, **k):
            depth[0] += 1
            try:
                init(self, *a, **k)
            finally:
                depth[0] -= 1
            if depth[0] == 0 and state["t0"] is None:
                state["t0"] = time.perf_counter()
                if mode == "optimizer":
                    params = [p for g in self.param_groups for p in g["params"]]
                    model = _root_module(params)
                    declare = json.loads(args.declare) if args.declare else None
                    state["started"] = faultbench.watch(model, self, report=False, declare=declare).start()

        cls.__init__ = __init__

    for name in dir(torch.optim):
        obj = getattr(torch.optim, name)
        if isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer) and "__init__" in vars(obj):
            wrap(obj)
    sys.argv = program
    sys.path.insert(0, os.path.dirname(os.path.abspath(program[0])))
    error = None
    try:
        runpy.run_path(program[0], run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            error = e
    except BaseException as e:  # noqa: BLE001 - the program's crash is a result
        error = e
    end = time.perf_counter()
    if state["started"] is not None and state["started"].attached:
        state["started"].stop(error)
    result = {"program": program, "mode": mode, "loop_s": None if state["t0"] is None else end - state["t0"],
              "error": None if error is None else "".join(traceback.format_exception_only(type(error), error)).strip(),
              "traceback": None if error is None else "".join(traceback.format_exception(error))[-4000:],
              "watches": []}
    for w in state["watches"]:
        d = w.to_dict()
        result["watches"].append({"steps": d["steps"], "findings": d["findings"], "acknowledged": d["acknowledged"],
                                  "not_applicable": d["not_applicable"], "errors": d["errors"],
                                  "report": w.report(), "step_seconds": dict(w.step_seconds),
                                  "other_seconds": dict(w.other_seconds)})
    if args.save and state["watches"]:
        with open(args.save, "w") as f:
            json.dump(state["watches"][0].to_dict(), f, default=str)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    return 0 if error is None else 1


if __name__ == "__main__":
    sys.exit(main())
