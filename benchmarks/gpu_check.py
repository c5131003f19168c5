"""GPU check of the reference: the `gpu` preset's throughput, and whether the AMP faults manifest on CUDA.

Part 1 trains the `gpu` preset (model/config.py, ~25M parameters, bf16) for a fixed number of steps
(default 1000, warmup steps/10, the full 200K-document corpus; stopped early at --max-train-s) and prints
the corpus/tokenizer build time, step time, real (non-pad) tokens/s, the loss at the start and the end,
the val loss against the corpus' loss floor, the peak GPU memory and which SDPA kernel ran (the
torch.backends.cuda flags, and the attention ops/kernels a profiled forward+backward launched).

Part 2 runs every reference fault whose manifest trains in fp16/bf16 (or whose trigger is amp-only)
clean and faulty exactly as its manifest says (harness.scenario.run_scenario, tiny preset, manifest
seeds and steps) but with train.device set to the chosen device, so fp16 goes through CUDA's autocast
and the real CUDA GradScaler, and applies the manifest's own check (harness.manifest.CHECKS). Last, a
probe of fp16_mask_constant's premise: what each SDPA backend returns for a fully masked fp16 row.

    python benchmarks/gpu_check.py                                        # on a CUDA machine
    python benchmarks/gpu_check.py --device cpu --steps 5 --preset tiny   # smoke test; part 2 = the CPU column

The 25M-parameter model takes ~30 s per step on 2 CPU cores, hence --preset tiny for the smoke test.

Runs from a checkout without installing the project: if `faultbench.model` is not importable, the
repository's folders are mapped onto the `faultbench` namespace as pyproject.toml does.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def _import_faultbench() -> None:
    """Make `faultbench.<folder>` importable from this checkout (pyproject's package-dir mapping)."""
    try:
        importlib.import_module("faultbench.model.config")
        return
    except ImportError:
        pass
    sys.path.insert(0, str(ROOT))
    import faultbench

    for name in ("model", "harness", "detectors", "faults", "peers", "targets"):
        spec = importlib.util.spec_from_file_location(f"faultbench.{name}", ROOT / name / "__init__.py",
                                                      submodule_search_locations=[str(ROOT / name)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        setattr(faultbench, name, module)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def attention_kernels(run, device: str) -> dict:
    """Profile one forward+backward of a training batch: the SDPA ops and attention kernels it launched."""
    from torch.profiler import ProfilerActivity, profile

    from faultbench.model.loss import count_targets
    from faultbench.model.train import forward_loss, next_micro_batches

    batch = next_micro_batches(run)[0]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        forward_loss(run.train_model, batch, count_targets(batch["labels"]), run.config.train.precision).backward()
        _sync(device)
    run.optimizer.zero_grad(set_to_none=True)
    names = {e.key for e in prof.key_averages()}
    keys = ("scaled_dot_product", "flash", "fmha", "efficient_attention", "attention")
    return {
        "sdp_flags": {k: getattr(torch.backends.cuda, f"{k}_sdp_enabled")()
                      for k in ("flash", "mem_efficient", "math", "cudnn")},
        "ops": sorted(n for n in names if n.startswith("aten::") and "scaled_dot_product" in n),
        "kernels": sorted(n[:120] for n in names
                          if not n.startswith("aten::") and any(k in n.lower() for k in keys))[:8],
    }


def masked_row_probe(device: str) -> dict:
    """fp16_mask_constant's premise: does SDPA give NaN (or zeros) for a query row whose mask is all -inf?"""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = k = v = torch.randn(1, 1, 4, 8, device=device, dtype=torch.float16)
    mask = torch.zeros(1, 1, 4, 4, device=device, dtype=torch.float16)
    mask[..., 0, :] = float("-inf")  # query 0 may attend to nothing
    out = {}
    for name in ("MATH", "EFFICIENT_ATTENTION", "FLASH_ATTENTION", "CUDNN_ATTENTION"):
        try:
            with sdpa_kernel(getattr(SDPBackend, name)):
                row = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)[0, 0, 0]
            out[name] = "nan" if row.isnan().any() else ("zeros" if (row == 0).all() else "finite")
        except RuntimeError as exc:
            out[name] = f"unavailable ({str(exc).splitlines()[0][:60]})"
    return out


def train_preset(device: str, steps: int, max_train_s: float, num_docs: int | None, preset: str = "gpu") -> dict:
    from faultbench.model.config import get_preset
    from faultbench.model.evaluate import evaluate
    from faultbench.model.run import build_run
    from faultbench.model.train import next_micro_batches, train_step

    base = get_preset(preset)
    data = {"num_docs": num_docs} if num_docs else {}
    cfg = base.replace(data=data, train={"steps": steps, "warmup_steps": max(1, steps // 10), "device": device})
    t0 = time.perf_counter()
    run = build_run(cfg)
    build_s = time.perf_counter() - t0
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    warm = min(10, steps // 2)  # steps left out of the timing (CUDA/cuBLAS start-up, allocator growth)
    records, t_start = [], time.perf_counter()
    t_timed, tokens_before = t_start, 0
    while run.step < steps:
        if run.step == warm:
            _sync(device)
            t_timed, tokens_before = time.perf_counter(), sum(r.tokens for r in records)
        records.append(train_step(run, next_micro_batches(run)))
        if time.perf_counter() - t_start > max_train_s:
            break
    _sync(device)
    t_end = time.perf_counter()
    timed_steps = len(records) - warm
    timed_tokens = sum(r.tokens for r in records) - tokens_before
    t1 = time.perf_counter()
    val = evaluate(run.model, run.corpus.val, run.tokenizer.pad_id, cfg.train.eval_batch_size,
                   cfg.train.precision, cfg.data.pad_side)
    eval_s = time.perf_counter() - t1
    losses = [r.loss for r in records]
    out = {
        "preset": preset, "params": run.model.num_params(), "device": device, "precision": cfg.train.precision,
        "batch_docs": cfg.train.batch_size, "seq_len": cfg.data.seq_len, "num_docs": cfg.data.num_docs,
        "build_s": round(build_s, 1), "steps_done": len(records), "steps_asked": steps,
        "train_s": round(t_end - t_start, 1),
        # wall per step over the timed steps, batch making (collate, host-to-device copy) included, synchronized
        "step_ms_mean": round(1e3 * (t_end - t_timed) / max(timed_steps, 1), 2),
        # median of train_step's own StepRecord.seconds (no batch making; ends at its last host sync)
        "step_ms_median_host": round(1e3 * statistics.median(r.seconds for r in records[warm:]), 2),
        "real_tokens_per_step": round(timed_tokens / max(timed_steps, 1), 1),  # non-pad input tokens
        "tokens_per_s": round(timed_tokens / (t_end - t_timed)),  # real tokens per second of wall time
        "loss_first5": round(statistics.fmean(losses[:5]), 4), "loss_last10": round(statistics.fmean(losses[-10:]), 4),
        "val_loss": round(val, 4), "loss_floor": round(run.corpus.loss_floor, 4),
        "eval_s": round(eval_s, 1), "val_docs": len(run.corpus.val),
        "non_finite_steps": sum(not math.isfinite(x) for x in losses),
    }
    if device.startswith("cuda"):
        out["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
        out["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 3)
    try:
        out["attention"] = attention_kernels(run, device)
    except Exception as exc:  # the profiler is a nicety: keep the figures above
        out["attention"] = f"profiling failed: {type(exc).__name__}: {exc}"
    return out


def amp_faults() -> list:
    """The reference faults whose manifest trains in fp16/bf16, or whose trigger is amp-only."""
    from faultbench.faults.registry import all_faults

    return [s for s in all_faults("ref").values()
            if s.manifest.variant.get("train", {}).get("precision") in ("fp16", "bf16") or s.trigger == "amp-only"]


def _summary(o) -> dict:
    crash = o.crash and f"{o.crash['type']}@{o.crash['step']} in {(o.crash['seams'] or ['?'])[-1]}"
    return {"final": round(o.final_loss(), 4) if o.losses else None,
            "val": round(o.val_loss, 4) if o.val_loss is not None else None,
            "skipped": sum(o.skipped), "steps": len(o.losses), "nan_step": o.nan_step, "crash": crash,
            "grad_norm0": f"{o.grad_norms[0]:.4g}" if o.grad_norms else None,
            "grad_zero_fraction": (round(o.extra["grad_zero_fraction"], 4)
                                   if "grad_zero_fraction" in o.extra else None)}


def run_faults(device: str) -> list[dict]:
    from faultbench.harness.manifest import CHECKS
    from faultbench.harness.scenario import run_scenario

    rows = []
    for spec in amp_faults():
        m = spec.manifest
        variant = {**m.variant, "train": {**m.variant.get("train", {}), "device": device}}
        t0 = time.perf_counter()
        cleans = [run_scenario(m.scenario, variant, m.steps, s) for s in m.seeds]
        faultys = [run_scenario(m.scenario, variant, m.steps, s, (spec.id,)) for s in m.seeds]
        ok, evidence = CHECKS[m.check](cleans, faultys, **m.params)
        row = {"id": spec.id, "check": m.check, "manifests": ok, "evidence": evidence,
               "precision": m.variant.get("train", {}).get("precision"), "steps": m.steps, "seeds": list(m.seeds),
               "clean": _summary(cleans[0]), "faulty": _summary(faultys[0]),
               "seconds": round(time.perf_counter() - t0, 1)}
        if faultys[0].crash:
            row["faulty_crash_message"] = faultys[0].crash["message"][:200]
        rows.append(row)
        print(f"  {spec.id}: manifests={ok} ({evidence})", flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=1000, help="training steps of the gpu preset")
    parser.add_argument("--max-train-s", type=float, default=150.0, help="stop the preset's training after this")
    parser.add_argument("--num-docs", type=int, default=None, help="corpus size (default: the preset's 200K)")
    parser.add_argument("--preset", default="gpu", help="part 1's preset (the CPU smoke test: tiny)")
    parser.add_argument("--skip-preset", action="store_true")
    parser.add_argument("--skip-faults", action="store_true")
    args = parser.parse_args(argv)
    _import_faultbench()
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            print("CUDA is not available", file=sys.stderr)
            return 2
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
              f"cuDNN {torch.backends.cudnn.version()}", flush=True)
    else:
        print(f"device: {args.device}, torch {torch.__version__}", flush=True)
    import tokenizers

    print(f"tokenizers {tokenizers.__version__}, python {sys.version.split()[0]}", flush=True)
    result = {"device": args.device, "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None}
    if not args.skip_preset:
        print(f"== part 1: {args.preset} preset, {args.steps} steps", flush=True)
        result["preset"] = train_preset(args.device, args.steps, args.max_train_s, args.num_docs, args.preset)
        print(json.dumps(result["preset"], indent=1), flush=True)
    if not args.skip_faults:
        print("== part 2: AMP faults, manifest scenario on", args.device, flush=True)
        result["faults"] = run_faults(args.device)
        print(f"{'fault':28} {'check':16} {'manifests':9} {'clean final/val':16} {'faulty final/val':16} "
              f"{'skipped c/f':11} {'nan':4} crash", flush=True)
        for r in result["faults"]:
            c, f = r["clean"], r["faulty"]
            clean, faulty = f"{c['final']}/{c['val']}", f"{f['final']}/{f['val']}"
            skipped = f"{c['skipped']}/{f['skipped']}"
            print(f"{r['id']:28} {r['check']:16} {str(r['manifests']):9} {clean:16} {faulty:16} {skipped:11} "
                  f"{f['nan_step']!s:4} {f['crash']}")
        result["masked_row_sdpa"] = masked_row_probe(args.device)
        print("SDPA on a fully masked fp16 row (fp16_mask_constant's premise):", result["masked_row_sdpa"])
    print("RESULT_JSON " + json.dumps(result, default=str), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
