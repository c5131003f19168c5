"""Distributed detectors: data-parallel ranks must see different data and hold identical models.

After DDP's all-reduce every rank holds the same (averaged) gradient, applies the same update and so
keeps the same parameters; each rank trains on its own disjoint shard of every global batch. These
detectors check those invariants across ranks with small collectives (a checksum vector, one
asynchronous reduction per sampled step) and probe the reduction itself on a crafted batch at the start:
- ``reduction_probe``: one probe batch through the bare model and through the DDP wrapper, with a
  rank-dependent loss factor, under the run's own ``grad_sync_context``: the reduced gradient must
  be the mean over ranks, exactly once, and ``no_sync`` must suppress it;
- ``rank_collectives``: global_target_count and mean_over_ranks return the sum and mean over ranks;
- ``rank_agreement``: parameter and gradient checksums agree across ranks (after sampled steps and
  after a checkpoint load), and the ranks' batches differ (a digest);
- ``rank_data_distinct``: the sampler's per-rank slices of a global batch are disjoint and make it up;
- ``rank_grad_norm_agreement``: the logged pre-clip gradient norm is that of the whole gradient
  (the same on every rank): the gradient the optimizer receives has norm min(logged, clip).
Collectives are issued identically on every rank: only on conditions every rank shares (world size,
step index), never on a rank-local value, and outside code that may raise, so a rank cannot hang.
"""

from __future__ import annotations

import copy
import hashlib
import math

import torch
import torch.distributed as dist

from faultbench.detectors import probes
from faultbench.detectors.api import Detector, RunContext, register

HOOK = "model.distributed.average_gradients_hook"
SYNC = "model.distributed.grad_sync_context"
WRAP = "model.distributed.wrap_model"
LOAD = "model.checkpoint.load_checkpoint"
NEXT_INDICES = "model.sampler.ResumableSampler.next_indices"
CLIP = "model.train.clip_gradients"
TARGET_COUNT = "model.distributed.global_target_count"
MEAN = "model.distributed.mean_over_ranks"

RTOL = 1e-6  # replicas are bitwise identical in a healthy run: any visible difference is a disagreement


def sampled(step: int) -> bool:
    """Steps checked by the per-step detectors: every 8th from step 0 (the same on every rank)."""
    return probes.sampled(step, first=0, every=8)


def rank_min_max(ctx: RunContext, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Element-wise max and min of a float vector over the ranks (one all-reduce). Non-finite values
    become large sentinels so that they compare as different from finite ones."""
    return rank_min_max_async(ctx, values)()


def rank_min_max_async(ctx: RunContext, values: torch.Tensor):
    """``rank_min_max`` issued asynchronously: returns a function that waits and gives (max, min)."""
    v = torch.nan_to_num(values.detach().double().flatten().cpu(), nan=1e300, posinf=1e299, neginf=-1e299)
    n = v.numel()
    both = torch.cat([v, -v]).to(probes.device(ctx))
    work = dist.all_reduce(both, op=dist.ReduceOp.MAX, async_op=True)

    def wait() -> tuple[torch.Tensor, torch.Tensor]:
        work.wait()
        out = both.cpu()
        return out[:n], -out[n:]
    return wait


def disagreeing(mx: torch.Tensor, mn: torch.Tensor, rtol: float = RTOL) -> torch.Tensor:
    """Mask of entries whose values differ across ranks beyond ``rtol`` (relative to their size)."""
    return (mx - mn).abs() > rtol * torch.maximum(mx.abs(), mn.abs()) + 1e-30


def rescale_factors(mx: torch.Tensor, mn: torch.Tensor, differ: torch.Tensor, rtol: float = 1e-4):
    """The distinct max/min ratios of the differing entries (sorted), or None when fewer than 3 entries
    differ or some differing entry is zero on a rank (no ratio)."""
    idx = differ.nonzero().flatten()
    if idx.numel() < 3 or bool((mn[idx] <= 0).any()):
        return None
    distinct: list[float] = []
    for r in sorted((mx[idx] / mn[idx]).tolist()):
        if not distinct or r > distinct[-1] * (1 + rtol):
            distinct.append(r)
    return [round(r, 6) for r in distinct]


def _norms(tensors: list[torch.Tensor | None]) -> torch.Tensor:
    """L2 norm of each tensor (0 where None), as one float64 vector."""
    present = [i for i, t in enumerate(tensors) if t is not None]
    out = torch.zeros(len(tensors), dtype=torch.float64)
    if present:
        norms = torch._foreach_norm([tensors[i].detach().float() for i in present])
        out[present] = torch.stack(norms).double().cpu()
    return out


class _Guarded(Detector):
    """Keeps a detector's own errors out of the harness: a detector that raised is silenced by the
    harness, and a rank whose detector is silenced would stop joining collectives (the other ranks
    would hang). Local work goes through ``_safely``; collectives always run."""

    def __init__(self) -> None:
        super().__init__()
        self._errors: list[str] = []

    def summary(self) -> dict:
        return {"errors": self._errors[:5]} if self._errors else {}

    def _safely(self, where: str, fn, default=None):
        try:
            return fn()
        except Exception as exc:
            self._errors.append(f"{where}: {type(exc).__name__}: {exc}"[:300])
            return default


# --- the reduction itself, probed at the start ------------------------------------------------------


@register
class ReductionProbe(_Guarded):
    id = "reduction_probe"
    needs_run = ("corpus.train", "tokenizer.pad_id")
    needs_config = ("train.device",)
    needs_seams = (SYNC, HOOK, WRAP)
    family = "distributed"
    passive = False
    description = ("one probe batch, loss scaled by rank+1, through the bare model and the DDP wrapper (plain, and "
                   "under grad_sync_context sync=True/False): DDP must average once over ranks; no_sync must not")

    def on_start(self, ctx: RunContext) -> None:
        if not probes.group_ready(ctx):
            return
        run = ctx.run
        if run.train_model is run.model:  # DDP was expected: nothing reduces gradients at all
            self.report(ctx, "distributed", WRAP, f"world_size={run.world_size} but the training model is not "
                        "wrapped for data parallelism: gradients are never reduced across ranks", confidence=0.85)
            return
        # every rank runs the same forwards/backwards (collectives inside DDP); failures are handled after
        batch = self._safely("batch", lambda: probes.probe_batch(ctx, 2))
        if batch is None:
            return
        params = list(run.model.parameters())
        saved = [p.grad for p in params]
        factor = float(run.rank + 1)
        grads = {}
        sync_context = ctx.seam(SYNC)
        try:
            with ctx.probe(), torch.enable_grad():
                grads["local"] = self._grad(run.model, batch, params, 1.0)
                grads["plain"] = self._grad(run.train_model, batch, params, factor)
                with sync_context(run.train_model, True):
                    grads["sync"] = self._grad(run.train_model, batch, params, factor)
                with sync_context(run.train_model, False):
                    grads["no_sync"] = self._grad(run.train_model, batch, params, factor)
        finally:
            for p, g in zip(params, saved, strict=True):
                p.grad = g
        self._judge(ctx, grads, factor)

    @staticmethod
    def _grad(model, batch, params, factor: float) -> torch.Tensor:
        for p in params:
            p.grad = None
        logits = model(batch["input_ids"], batch["attention_mask"], batch["position_ids"]).float()
        loss = torch.logsumexp(logits, dim=-1).mean() * factor
        loss.backward()
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().double().flatten()
                          for p in params]).cpu()

    def _judge(self, ctx: RunContext, grads: dict, factor: float) -> None:
        ws = ctx.run.world_size
        local = grads["local"]
        base = float(local.dot(local))
        if not math.isfinite(base) or base == 0.0:
            return
        mean = (ws + 1) / 2  # the mean over ranks of the factors rank+1

        def ratio(g: torch.Tensor) -> tuple[float, float]:
            r = float(g.dot(local)) / base
            resid = float((g - r * local).norm()) / max(float(g.norm()), 1e-30)
            return r, resid

        def near(r: float, target: float) -> bool:
            return abs(r - target) <= 1e-3 * abs(target)

        found = {name: ratio(g) for name, g in grads.items() if name != "local"}
        evidence = {name: {"ratio_to_local": round(r, 5), "residual": round(res, 6)}
                    for name, (r, res) in found.items()}
        evidence.update(expected_reduced=mean, expected_local=factor, world_size=ws)
        r_plain, res_plain = found["plain"]
        plain_ok = res_plain < 1e-3 and near(r_plain, mean)
        if not plain_ok:
            if res_plain < 1e-3 and near(r_plain, mean * ws):
                msg = (f"DDP's reduced gradient is {ws}x (world_size) the mean over ranks: the gradients are "
                       "summed or reduced twice instead of averaged once")
                conf = 0.9
            elif res_plain < 1e-3 and near(r_plain, factor) and not near(factor, mean):
                msg = "a DDP backward leaves this rank's local gradient: the communication hook does not all-reduce"
                conf = 0.9
            elif res_plain < 1e-3 and near(r_plain, mean / ws):
                msg = f"DDP's reduced gradient is 1/{ws} of the mean over ranks: it is divided twice"
                conf = 0.9
            else:
                msg = (f"DDP's reduced gradient is {r_plain:.4g}x the local one where the mean over ranks is "
                       f"{mean:g}x (residual {res_plain:.2g})")
                conf = 0.8
            self.report(ctx, "distributed", HOOK, msg, evidence=evidence, confidence=conf)
            return
        problems = []
        r_sync, res_sync = found["sync"]
        if not (res_sync < 1e-3 and near(r_sync, mean)):
            problems.append(f"grad_sync_context(sync=True) gives {r_sync:.4g}x the local gradient instead of the "
                            f"reduced {mean:g}x: the window's last micro-batch is not all-reduced")
        r_none, res_none = found["no_sync"]
        if not near(factor, mean) and not (res_none < 1e-3 and near(r_none, factor)):
            problems.append(f"grad_sync_context(sync=False) gives {r_none:.4g}x instead of the local {factor:g}x: "
                            "inner micro-batches are all-reduced")
        if problems:
            self.report(ctx, "distributed", SYNC, "; ".join(problems), evidence=evidence, confidence=0.9)


@register
class RankCollectives(_Guarded):
    id = "rank_collectives"
    needs_config = ("train.device",)
    needs_seams = (TARGET_COUNT, MEAN)
    family = "distributed"
    passive = False
    description = ("global_target_count and mean_over_ranks called with rank-dependent values on every rank must "
                   "return the sum and the mean over ranks")

    def on_start(self, ctx: RunContext) -> None:
        if not probes.group_ready(ctx):
            return
        ws, rank, device = ctx.run.world_size, ctx.run.rank, ctx.config.train.device
        # both calls are made on every rank whatever happens (each holds a collective in a healthy run)
        count = self._safely("global_target_count", lambda: ctx.seam(TARGET_COUNT)(10 * (rank + 1), device))
        mean = self._safely("mean_over_ranks", lambda: ctx.seam(MEAN)(float(rank + 1), device))
        want_count, want_mean = 10 * ws * (ws + 1) // 2, (ws + 1) / 2
        if count is not None and int(count) != want_count:
            self.report(ctx, "distributed", TARGET_COUNT, f"global_target_count(10 x (rank+1)) returned {count} on "
                        f"rank {rank}; the sum over the {ws} ranks is {want_count}", confidence=0.9,
                        evidence={"got": count, "expected": want_count, "local": 10 * (rank + 1)})
        if mean is not None and not abs(float(mean) - want_mean) <= 1e-9 * want_mean:
            self.report(ctx, "distributed", MEAN, f"mean_over_ranks(rank+1) returned {mean} on rank {rank}; the mean "
                        f"over the {ws} ranks is {want_mean}", confidence=0.9,
                        evidence={"got": mean, "expected": want_mean, "local": float(rank + 1)})


# --- replicas agree ---------------------------------------------------------------------------------


@register
class RankAgreement(_Guarded):
    id = "rank_agreement"
    family = "distributed"
    passive = True
    description = ("per-parameter norms of the weights (after sampled steps and after a checkpoint load) and of the "
                   "gradients (when the optimizer steps) must be identical on every rank; the batches must differ")

    def __init__(self) -> None:
        super().__init__()
        self._grad_norms: tuple[int, torch.Tensor] | None = None
        self._digest: tuple[int, int] | None = None
        self._params_agreed = True
        self._pending = None  # (step, parameter count, digest, wait) of the exchange in flight

    def on_batch(self, ctx: RunContext, micro_batches: list[dict]) -> None:
        if probes.group_ready(ctx) and sampled(ctx.step):
            self._digest = self._safely("digest", lambda: (ctx.step, _batch_digest(micro_batches)), None)

    def on_before_step(self, ctx: RunContext) -> None:
        # no collective here: a step the scaler skips on one rank only would never reach it there
        if probes.group_ready(ctx) and sampled(ctx.step):
            self._grad_norms = self._safely("grads", lambda: (ctx.step, _norms(
                [p.grad for p in ctx.run.model.parameters()])), None)

    def on_after_step(self, ctx: RunContext, record) -> None:
        self._settle(ctx)  # the previous sampled step's exchange has long completed by now
        step = record.step
        if not (probes.group_ready(ctx) and sampled(step)):
            return
        params = list(ctx.run.model.parameters())
        p_norms = self._safely("params", lambda: _norms(list(params)), torch.zeros(len(params), dtype=torch.float64))
        have = self._grad_norms is not None and self._grad_norms[0] == step
        g_norms = self._grad_norms[1] if have else torch.zeros(len(params), dtype=torch.float64)
        self._grad_norms = None
        if g_norms.numel() != p_norms.numel():
            g_norms = torch.zeros_like(p_norms)
        digest = self._digest[1] if self._digest is not None and self._digest[0] == step else -1
        self._digest = None
        flags = torch.tensor([1.0 if have else 0.0, float(digest)], dtype=torch.float64)
        # collective on every rank, asynchronous: it overlaps the next step instead of waiting for the slower rank
        self._pending = (step, p_norms.numel(), digest, rank_min_max_async(ctx, torch.cat([p_norms, g_norms, flags])))

    def on_checkpoint_save(self, ctx: RunContext, path) -> None:
        self._settle(ctx)

    def on_end(self, ctx: RunContext, metrics: dict) -> None:
        self._settle(ctx)

    def on_crash(self, ctx: RunContext, crash: dict) -> None:
        self._pending = None  # another rank may never have joined it: never wait after a crash

    def _settle(self, ctx: RunContext) -> None:
        """Wait for the pending exchange (every rank has issued it) and judge it."""
        if self._pending is None:
            return
        step, k, digest, wait = self._pending
        self._pending = None
        mx, mn = wait()
        self._safely("judge", lambda: self._judge(ctx, step, k, digest, mx, mn))

    def _judge(self, ctx: RunContext, step: int, k: int, digest: int, mx: torch.Tensor, mn: torch.Tensor) -> None:
        if float(mn[-1]) >= 0 and float(mx[-1]) == float(mn[-1]):
            self.report_once("data", ctx, "distributed", ctx.known_seam(NEXT_INDICES),
                             f"every rank trained on the identical batch at step {step}: the data is not sharded "
                             "across ranks", evidence={"batch_digest": digest}, confidence=0.8, step=step)
        params_differ = disagreeing(mx[:k], mn[:k])
        stepped_everywhere = float(mn[-2]) == 1.0
        grads_differ = disagreeing(mx[k:2 * k], mn[k:2 * k]) if stepped_everywhere else torch.zeros(k, dtype=bool)
        if not (params_differ.any() or grads_differ.any()):
            return
        names = [n for n, _ in ctx.run.model.named_parameters()]
        evidence = {"params_differing": int(params_differ.sum()), "grads_differing": int(grads_differ.sum()),
                    "of": k, "examples": [names[i] for i in params_differ.nonzero().flatten().tolist()[:3]
                                          if i < len(names)]}
        if grads_differ.any():
            evidence["grad_examples"] = [names[i] for i in grads_differ.nonzero().flatten().tolist()[:3]
                                         if i < len(names)]
            factors = rescale_factors(mx[k:2 * k], mn[k:2 * k], grads_differ)
            if factors is not None and len(factors) <= ctx.run.world_size:
                # equal after the reduction, then scaled by one factor per group of parameters on each rank:
                # a rank-local rescaling between the all-reduce and the step (clipping with a local norm)
                evidence["max_over_min_factors"] = factors
                self.report_once("grads", ctx, "distributed", ctx.known_seam(CLIP),
                                 f"at step {step} the ranks step with gradients that differ only by "
                                 f"{len(factors)} constant factor(s) per group of parameters: the all-reduced "
                                 "gradients were rescaled rank-locally before the step (clipping by a local norm)",
                                 evidence=evidence, confidence=0.65, step=step)
            else:
                self.report_once("grads", ctx, "distributed", ctx.known_seam(SYNC),
                                 f"at step {step} the ranks step with different gradients ({int(grads_differ.sum())} "
                                 f"of {k} parameters' gradient norms differ): the gradient all-reduce did not make "
                                 "them equal", evidence=evidence, confidence=0.7, step=step)
        elif params_differ.any() and self._params_agreed:
            self.report_once("params", ctx, "distributed", None,
                             f"after step {step} the replicas' weights differ across ranks although their "
                             "gradients agree: the update or the parameter broadcast differs per rank",
                             evidence=evidence, confidence=0.6, step=step)
        self._params_agreed = self._params_agreed and not bool(params_differ.any())

    def on_checkpoint_load(self, ctx: RunContext, path) -> None:
        self._settle(ctx)
        if not probes.group_ready(ctx):
            return
        params = list(ctx.run.model.parameters())
        p_norms = self._safely("params", lambda: _norms(list(params)), torch.zeros(len(params), dtype=torch.float64))
        mx, mn = rank_min_max(ctx, p_norms)  # collective: every rank
        differ = disagreeing(mx, mn)
        if differ.any():
            names = self._safely("names", lambda: [n for n, _ in ctx.run.model.named_parameters()], [])
            self.report_once("load", ctx, "distributed", ctx.known_seam(LOAD),
                             f"right after loading the checkpoint the ranks hold different weights "
                             f"({int(differ.sum())} of {differ.numel()} parameters differ): not every rank loaded "
                             "the saved weights (DDP broadcasts only when it wraps the model)",
                             evidence={"examples": [names[i] for i in differ.nonzero().flatten().tolist()[:3]
                                                    if i < len(names)],
                                       "max_rel_diff": float(((mx - mn).abs() / mx.abs().clamp_min(1e-30)).max())},
                             confidence=0.85)
        self._params_agreed = not bool(differ.any())


# --- the data is sharded ----------------------------------------------------------------------------


def _batch_digest(micro_batches: list[dict]) -> int:
    h = hashlib.blake2b(digest_size=6)
    for b in micro_batches:
        ids = b["input_ids"].detach().cpu().contiguous()
        h.update(str(tuple(ids.shape)).encode())
        h.update(ids.numpy().tobytes())
    return int.from_bytes(h.digest(), "little")  # < 2**48: exact in float64


@register
class RankDataDistinct(_Guarded):
    id = "rank_data_distinct"
    needs_run = ("sampler",)
    needs_seams = (NEXT_INDICES,)
    family = "distributed"
    passive = False
    description = ("the run's sampler, asked (on copies) for every rank's slice of the next global batch, must return "
                   "disjoint slices of the right size")

    def on_start(self, ctx: RunContext) -> None:
        if ctx.run.world_size > 1:
            self._safely("sampler probe", lambda: self._probe_sampler(ctx))

    def _probe_sampler(self, ctx: RunContext) -> None:
        sampler, ws = ctx.run.sampler, ctx.run.world_size
        next_indices = ctx.seam(NEXT_INDICES)
        slices = []
        for rank in range(ws):
            other = copy.deepcopy(sampler)
            other.rank = rank
            slices.append([int(i) for i in next_indices(other)])
        whole = copy.deepcopy(sampler)
        whole.rank, whole.world_size = 0, 1
        global_batch = {int(i) for i in next_indices(whole)}  # the same global batch drawn by a single process
        per_rank = sampler.global_batch // ws
        union = set().union(*map(set, slices))
        overlap = sum(len(s) for s in slices) - len(union)
        evidence = {"slice_sizes": [len(s) for s in slices], "expected_size": per_rank, "overlapping": overlap,
                    "first_indices": [s[:3] for s in slices]}
        if all(s == slices[0] for s in slices[1:]):
            self.report(ctx, "distributed", NEXT_INDICES, "the sampler gives every rank the same slice of the global "
                        "batch: the rank offset is ignored, every rank trains on the same documents",
                        evidence=evidence, confidence=0.9)
        elif overlap or any(len(s) != per_rank for s in slices) or union != global_batch:
            self.report(ctx, "distributed", NEXT_INDICES, f"the ranks' slices of one global batch overlap ({overlap} "
                        f"indices), have the wrong size (expected {per_rank} each) or do not make up the global "
                        f"batch ({len(union - global_batch)} indices outside it)", evidence=evidence,
                        confidence=0.85)


# --- the logged gradient norm is global --------------------------------------------------------------


@register
class RankGradNormAgreement(_Guarded):
    id = "rank_grad_norm_agreement"
    needs_config = ("train.grad_clip",)
    needs_seams = (CLIP,)
    family = "distributed"
    passive = True
    description = ("the logged pre-clip grad norm must be the norm of the whole all-reduced gradient (so the same on "
                   "every rank): the gradient the optimizer receives must have norm min(logged, clip)")

    def __init__(self) -> None:
        super().__init__()
        self._seen: tuple[int, float] | None = None  # (step, the whole gradient's norm) before the step
        self._reported = False

    def on_before_step(self, ctx: RunContext) -> None:
        if ctx.run.world_size > 1 and not self._reported and sampled(ctx.step):
            self._seen = self._safely("norms", lambda: self._norms(ctx), None)

    @staticmethod
    def _norms(ctx: RunContext):
        return ctx.step, float(_norms([p.grad for p in ctx.run.model.parameters()]).norm())

    def on_after_step(self, ctx: RunContext, record) -> None:
        # local only (no collective): the contract holds on each rank by itself
        seen, self._seen = self._seen, None
        logged = float(record.grad_norm)
        if self._reported or seen is None or seen[0] != record.step or not math.isfinite(logged):
            return
        step, full = seen
        clip = ctx.config.train.grad_clip
        expected = min(logged, clip) if clip > 0 else logged  # the whole gradient's norm after clipping

        def close(a: float, b: float) -> bool:
            return abs(a - b) <= 1e-3 * max(abs(a), abs(b), 1e-12)

        if close(full, expected):
            return  # consistent; gradients that differ across ranks are rank_agreement's
        evidence = {"logged_grad_norm": logged, "clip": clip, "norm_after_clip": full, "expected_after_clip": expected,
                    "rank": ctx.run.rank}
        self._reported = True
        self.report(ctx, ctx.seams.get(CLIP, "optimizer"), CLIP, f"at step {step} the logged grad norm {logged:.4g} "
                    f"does not match the whole gradient the optimizer receives (norm {full:.4g} after clipping to "
                    f"{clip:g})", evidence=evidence, confidence=0.7, step=step)
