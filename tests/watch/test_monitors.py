"""The black-box track on the nanoGPT-style loop: silent on the correct loop (embedding decay, (s+1)/(W+1) warmup,
no BOS, an enabled GradScaler), and each monitor-side classic bug found and localized on two seeds.

The runs are shared through a module-scoped cache: each (bugs, seed, steps) loop trains once (~1 s).
"""

from __future__ import annotations

import functools

import pytest
import torch

import faultbench
from faultbench.detectors.api import SUBSYSTEMS
from tests.watch.nanogpt import TrainConfig, build, train

SEEDS = (0, 1)
# bug -> (subsystem, where, detector) of the top-ranked finding
EXPECTED = {
    "no_zero_grad": ("optimizer", "optimizer", "bb_grads_cleared"),
    "clip_before_unscale": ("precision", "scaler", "bb_clip_scaled"),
    "endless_warmup": ("optimizer", "optimizer", "bb_lr_shape"),
}


@functools.cache
def watched(bugs: tuple = (), seed: int = 0, steps: int = 30, amp: bool = True, golden_key=None):
    """The loop (GradScaler enabled unless ``amp`` is False) under ``faultbench.watch`` with every black-box
    detector; its Watch."""
    golden = GOLDEN.get(golden_key)
    # the loop's planned length declared, as a nanoGPT user would from max_iters (its schedule's length)
    result = train(TrainConfig(amp=amp), bugs=bugs, seed=seed, steps=steps,
                   watch=lambda m, o, s: faultbench.watch(m, o, scaler=s, golden=golden, report=False,
                                                          declare={"total_steps": steps}))
    return result["watch"]


GOLDEN: dict = {}


def _messages(w) -> list[str]:
    return [f"{f.detector} [{f.subsystem}] {f.where}: {f.message}" for f in w.findings]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("amp", [True, False], ids=["scaler", "fp32"])
def test_the_correct_loop_yields_no_finding(seed, amp):
    w = watched((), seed, amp=amp)
    assert w.ctx.step == 30 and len(w.ctx.history) == 30
    assert w.findings == [], _messages(w)
    assert w.errors == {}
    # the monitors ran (were called and not excused): the ones that need a scaler only where there is one
    scaler_only = {"bb_clip_scaled", "bb_scaler_skips"}
    excused, called = set(w.not_applicable), set(w.step_seconds) | set(w.other_seconds)
    assert {"bb_lr_shape", "bb_grads_cleared", "bb_params_in_optimizer", "bb_eval_mode"} <= called - excused
    assert scaler_only.isdisjoint(excused) if amp else scaler_only <= excused


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("bug", sorted(EXPECTED))
def test_each_classic_bug_is_found_and_localized(bug, seed):
    w = watched((bug,), seed)
    assert w.findings, f"{bug} on seed {seed}: no finding"
    top = w.findings[0]
    assert (top.subsystem, top.where, top.detector) == EXPECTED[bug], _messages(w)
    assert top.seam is None and top.subsystem in SUBSYSTEMS


def test_the_records_are_what_the_loop_did():
    """StepRecords against the loop's own numbers: its lr per iteration, its mean micro-batch loss, its accum."""
    cfg = TrainConfig(amp=True)
    result = train(cfg, seed=0, steps=8, watch=lambda m, o, s: faultbench.watch(m, o, scaler=s, report=False))
    history = result["watch"].ctx.history
    assert [r.lrs[0] for r in history] == pytest.approx(result["lrs"])
    # the loop's total is the sum of loss / accum; the record is the mean of the undivided losses
    assert [r.loss for r in history] == pytest.approx(result["losses"], rel=1e-5)
    assert {r.micro_batches for r in history} == {cfg.gradient_accumulation_steps}
    assert {r.scale for r in history} == {result["scaler"].get_scale()} and not any(r.skipped for r in history)
    # the norms are measured on the sampled steps: the first 4, then every 4th
    assert [r.sampled for r in history] == [True] * 5 + [False] * 3
    assert all(r.grad_norm is None and r.backward_norm is None for r in history if not r.sampled)
    # clipping after unscale: the optimizer's norm is min(true norm, max_norm)
    for r in history[:5]:
        assert r.grad_norm == pytest.approx(min(r.backward_norm / r.scale, cfg.grad_clip), rel=1e-3)


def test_a_golden_envelope_from_the_users_runs_flags_a_run_that_leaves_it(tmp_path):
    path = tmp_path / "golden.json"
    faultbench.record_golden([watched((), s) for s in SEEDS], path)
    GOLDEN["clean"] = faultbench.load_golden(path)
    assert GOLDEN["clean"]["runs"] == 2 and len(GOLDEN["clean"]["steps"]) == 30
    clean, broken = watched((), 2, golden_key="clean"), watched(("endless_warmup",), 2, golden_key="clean")
    assert clean.findings == [], _messages(clean)
    assert "bb_golden_loss" in {f.detector for f in broken.findings}, _messages(broken)
    golden = next(f for f in broken.findings if f.detector == "bb_golden_loss")
    assert (golden.subsystem, golden.where) == ("loss", "loss") and golden.confidence < broken.findings[0].confidence


@pytest.mark.xfail(strict=True, reason="a warmup that never ends in a run shorter than bb_lr_shape.MIN_STEPS (20) "
                   "looks like the first steps of a normal warmup: the LR shape alone cannot tell them apart")
def test_an_endless_warmup_in_a_short_run():
    w = watched(("endless_warmup",), 0, steps=15)
    assert any(f.detector == "bb_lr_shape" for f in w.findings)


class Log(torch.nn.Module):
    """A user's activation with a bug: log of values that can be negative (NaN)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


def test_a_non_finite_forward_is_localized_to_its_first_module_and_explains_the_scalers_skips():
    cfg = TrainConfig(amp=True)
    model, optimizer, scaler = build(cfg, seed=0)
    model.transformer.h[1].mlp.gelu = Log()
    w = train(cfg, steps=12, parts=(model, optimizer, scaler),
              watch=lambda m, o, s: faultbench.watch(m, o, scaler=s, report=False))["watch"]
    assert w.ctx.step == 0 and w.ctx.skipped_steps == 12  # every step skipped: no optimizer hook ever fired
    top = w.findings[0]
    assert (top.detector, top.subsystem, top.where) == ("bb_first_nonfinite", "model", "transformer.h.1.mlp.gelu")
    skips = next(f for f in w.findings if f.detector == "bb_scaler_skips")
    assert skips.where == "scaler" and skips.confidence < top.confidence and skips.evidence["non_finite_loss"]


# ---- monitors v2: against the user's golden runs, across a resume, at a crash -----------------------------------
# A resumable loop of our own in the usual style (AdamW, a LambdaLR warmup then decay, its batches fixed by a seed),
# trained in segments: each segment is a fresh model/optimizer/scheduler loaded from the previous one's state dicts,
# under a watch told the step it resumes at and handed the previous segment's watch.
MONITORS = ["bb_golden_lr", "bb_golden_grad_norm", "bb_golden_config", "bb_resume_continuity", "bb_batch_replay",
            "bb_golden_layout", "bb_crash_site", "bb_rng_continuity"]
STEPS, RESUME = 12, 6


def _batches(seed: int, n: int = STEPS, bos: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """n (x, y) batches of 8 rows "BOS text EOS" (ids 0 and 1 of the char vocabulary stand for BOS and EOS); y is x
    shifted, its last target ignored (-1, nanoGPT's ignore_index)."""
    from tests.watch.nanogpt import SPLITS

    g, data, out = torch.Generator().manual_seed(seed), SPLITS["train"], []
    for _ in range(n):
        ix = torch.randint(len(data) - 40, (8,), generator=g)
        text = torch.stack([data[i:i + 30] for i in ix]).clamp_min(2)
        first = torch.zeros(8, 1, dtype=torch.long) if bos else text[:, :1]
        x = torch.cat([first, text, torch.ones(8, 1, dtype=torch.long)], 1)
        out.append((x, torch.cat([x[:, 1:], torch.full((8, 1), -1)], 1)))
    return out


class Tok:
    from tests.watch.nanogpt import TOKENIZER

    bos_token_id, eos_token_id, vocab_size = 0, 1, TOKENIZER.vocab_size


def _parts(seed: int, state: dict | None = None, load=("model", "optimizer", "scheduler")):
    model, optimizer, _ = build(TrainConfig(), seed=seed)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4) * 0.9 ** max(0, s - 4))
    for key, obj in (("model", model), ("optimizer", optimizer), ("scheduler", scheduler)):
        if state is not None and key in load:
            obj.load_state_dict(state[key])
    return model, optimizer, scheduler


def _segment(parts, batches, start, stop, *, golden=None, previous=None, betas=None):
    model, optimizer, scheduler = parts
    if betas is not None:
        for group in optimizer.param_groups:
            group["betas"] = betas
    w = faultbench.watch(model, optimizer, scheduler=scheduler, tokenizer=Tok(), golden=golden, report=False,
                         detectors=MONITORS, step=start, previous=previous)
    with w:
        for s in range(start, stop):
            x, y = batches[s]
            _, loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
    return w


def _state(parts) -> dict:
    return {k: obj.state_dict() for k, obj in zip(("model", "optimizer", "scheduler"), parts, strict=True)}


@functools.cache
def _golden() -> dict:
    """The user's known-good runs: two uninterrupted runs on other seeds."""
    return faultbench.record_golden([_segment(_parts(s), _batches(s), 0, STEPS) for s in (100, 101)])


def _resumed(seed: int, bug: str | None = None):
    """(first watch, resumed watch) of a run resumed at RESUME, with ``bug`` in the resume."""
    golden, batches = _golden(), _batches(seed)
    first = _segment(_parts(seed), batches, 0, RESUME, golden=golden)
    state = _state((first.ctx.model, first.ctx.optimizer, first.ctx.scheduler))
    load = {"optimizer_lost": ("model", "scheduler"), "scheduler_lost": ("model", "optimizer")}.get(
        bug, ("model", "optimizer", "scheduler"))
    state["rng"] = torch.get_rng_state()
    data = batches[:RESUME] * 2 if bug == "data_replayed" else batches  # the data order restarts from its start
    start = RESUME + 1 if bug == "step_ahead" else RESUME  # the restored step counter is one ahead
    parts = _parts(seed + 50, state, load)  # a fresh process: its own seed, then the checkpoint
    if bug != "rng_lost":
        torch.set_rng_state(state["rng"])
    second = _segment(parts, data, start, STEPS, golden=golden, previous=first)
    return first, second


def test_golden_records_the_optimizer_the_lr_the_layout_and_the_data():
    golden = _golden()
    assert golden["runs"] == 2 and len(golden["steps"]) == STEPS
    lrs = [s["lrs"][0] for s in golden["steps"]]
    assert lrs[0] == pytest.approx([3e-3 / 4] * 2) and lrs[3] == pytest.approx([3e-3] * 2)  # the schedule's LR
    assert [g["params"] for g in golden["groups"]] == [len(g["params"]) for g in _parts(0)[1].param_groups]
    assert golden["groups"][0]["betas"] == [0.9, 0.99] and golden["groups"][0]["dtypes"] == ["float32"]
    assert golden["layout"] == {"bos": [1.0, 1.0], "bos2": [0.0, 0.0], "full_eos": [1.0, 1.0], "eos": [1.0, 1.0],
                                "idle": [0.0, 0.0]}
    assert golden["repeats"] == 0 and golden["max_len"] == 32 and golden["scaled"] is False


@pytest.mark.parametrize("seed", SEEDS)
def test_a_correct_resume_with_its_golden_yields_no_finding(seed):
    first, second = _resumed(seed)
    assert second.ctx.start_step == RESUME and [r.step for r in second.ctx.history] == list(range(7, STEPS + 1))
    assert second.ctx.history[0].opt_count == RESUME + 1  # the optimizer's own counter continued
    assert first.findings == [] and second.findings == [], _messages(second)
    assert not {"bb_golden_lr", "bb_resume_continuity", "bb_batch_replay", "bb_golden_layout", "bb_rng_continuity"} & \
        set(second.not_applicable), second.not_applicable


# bug -> (detector, subsystem, where) of the resumed watch's top finding
RESUME_BUGS = {
    "optimizer_lost": ("bb_resume_continuity", "checkpoint", "optimizer"),
    "scheduler_lost": ("bb_golden_lr", "checkpoint", "scheduler"),
    "data_replayed": ("bb_batch_replay", "checkpoint", "data loader"),
    "step_ahead": ("bb_resume_continuity", "checkpoint", "checkpoint"),
    "rng_lost": ("bb_rng_continuity", "checkpoint", "checkpoint"),  # dropout draws from another generator state
}


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("bug", sorted(RESUME_BUGS))
def test_a_broken_resume_is_found_at_the_checkpoint(bug, seed):
    first, second = _resumed(seed, bug)
    assert first.findings == [], _messages(first)  # the run was fine until the resume
    assert second.findings, f"{bug}: no finding"
    top = second.findings[0]
    assert (top.detector, top.subsystem, top.where) == RESUME_BUGS[bug], _messages(second)
    assert top.step <= RESUME + 2  # found at the first resumed steps


@pytest.mark.parametrize("seed", SEEDS)
def test_a_schedule_that_differs_from_the_golden_is_an_optimizer_finding(seed):
    parts = _parts(seed)
    parts[2].lr_lambdas[0] = lambda s: 16 * min(1.0, (s + 1) / 4)  # an LR scaled x16, never decayed
    w = _segment(parts, _batches(seed), 0, STEPS, golden=_golden())
    top = w.findings[0]
    assert (top.detector, top.subsystem, top.where) == ("bb_golden_lr", "optimizer", "scheduler"), _messages(w)
    assert top.step == 2 and top.evidence["points"][0] == {"step": 2, "group": 0, "lr": pytest.approx(16 * 3e-3 / 2),
                                                           "golden": pytest.approx([3e-3 / 2] * 2)}


@pytest.mark.parametrize("seed", SEEDS)
def test_an_optimizer_configured_unlike_the_golden_and_rows_without_bos_are_found(seed):
    w = _segment(_parts(seed), _batches(seed), 0, STEPS, golden=_golden(), betas=(0.99, 0.9))
    config = next(f for f in w.findings if f.detector == "bb_golden_config")
    assert (config.subsystem, config.where) == ("optimizer", "optimizer") and "betas" in config.message
    w = _segment(_parts(seed), _batches(seed, bos=False), 0, STEPS, golden=_golden())
    top = w.findings[0]
    assert (top.detector, top.subsystem, top.evidence["key"], top.evidence["fraction"]) == \
        ("bb_golden_layout", "data", "bos", 0.0), _messages(w)


def test_a_crash_on_an_id_outside_the_vocabulary_is_a_data_finding():
    batches = _batches(0)
    batches[3][0][2, 5] = Tok.vocab_size  # one id past the vocabulary: the embedding raises
    w = None
    with pytest.raises(IndexError):
        parts = _parts(0)
        w = faultbench.watch(*parts[:2], scheduler=parts[2], tokenizer=Tok(), report=False, detectors=MONITORS)
        with w:
            for x, y in batches:
                parts[0](x, y)[1].backward()
                parts[1].step()
    assert w.ctx.step == 3
    top = w.findings[0]
    assert (top.detector, top.subsystem, top.where) == ("bb_crash_site", "data", "batch")
    code = top.evidence.pop("code")  # where it raised: the user's forward that looked the id up, not torch's
    assert code["qualname"].endswith(".forward") and code["library"] is None
    assert top.evidence == {"max_id": Tok.vocab_size, "vocab": Tok.vocab_size, "phase": "forward"}


def test_no_per_parameter_hook_runs_in_the_steps_without_a_scaler_and_one_with_it():
    """The watch's passive cost: without an enabled scaler no parameter carries a hook; with one, after the first
    backward a single parameter does (the one a backward completes last)."""
    for amp in (False, True):
        cfg = TrainConfig(amp=amp)
        model, optimizer, scaler = build(cfg, seed=0)
        ids = ["bb_grads_cleared", "bb_clip_scaled"] if amp else ["bb_grads_cleared"]
        result = train(cfg, steps=3, parts=(model, optimizer, scaler),
                       watch=lambda m, o, s, ids=ids: faultbench.watch(m, o, scaler=s, report=False, detectors=ids))
        w = result["watch"]
        assert not w.attached
        hooked = [p for p in model.parameters() if getattr(p, "_post_accumulate_grad_hooks", None)]
        assert hooked == []  # all removed at exit
        assert w.errors == {}
        if amp:  # the backward norm was measured every step from one hook
            assert all(r.backward_norm for r in w.ctx.history)
            assert w._last_param is not None and len(w._grad_handles) == len(w._trainable)
        else:
            assert w._grad_handles == {} and all(r.backward_norm is None for r in w.ctx.history)


# ---- across ranks: two gloo processes, each a replica of the same loop -------------------------------------------
REPLICA_BUGS = [None, "not_averaged", "same_data", "buffer_per_rank"]


def _replica_loop(rank: int, world: int, bug: str | None) -> tuple:
    """One rank of a data-parallel loop that averages its gradients by hand (all_reduce / world), under a watch
    with bb_cross_rank; ``bug``: "not_averaged" (rank 1 skips the all-reduce), "same_data" (every rank draws the
    batches of rank 0), "buffer_per_rank" (a buffer the forward uses holds a rank-dependent value). Returns
    ([(detector, subsystem, where, step)], not-applicable ids, the first finding's message)."""
    model, optimizer, _ = build(TrainConfig(), seed=0)  # the same initial weights on every rank
    if bug == "buffer_per_rank":  # an embedding scale kept as a buffer, computed from the rank
        model.register_buffer("emb_scale", torch.tensor(1.0 + 0.1 * rank))
        model.transformer.wte.register_forward_hook(lambda m, a, o: o * model.emb_scale)
    batches = _batches(0 if bug == "same_data" else rank, n=5)
    w = faultbench.watch(model, optimizer, report=False, detectors=["bb_cross_rank"])
    with w:
        for x, y in batches:
            model(x, y)[1].backward()
            if not (bug == "not_averaged" and rank == 1):
                for p in model.parameters():
                    torch.distributed.all_reduce(p.grad)
                    p.grad /= world
            else:  # keeps the collectives paired: rank 0 reduces with rank 1's zeros
                for p in model.parameters():
                    torch.distributed.all_reduce(torch.zeros_like(p.grad))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return ([(f.detector, f.subsystem, f.where, f.step) for f in w.findings], sorted(w.not_applicable),
            w.findings[0].message if w.findings else "")


def _replica_rank(rank: int, init: str, out) -> None:
    """Every loop of REPLICA_BUGS on this rank, one after another in one process group (spawning ranks costs
    seconds); puts (rank, {bug: result}) on ``out``."""
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        out.put((rank, {bug: _replica_loop(rank, 2, bug) for bug in REPLICA_BUGS}))
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="session")  # not module: other files' tests run between these and would tear it down
def replicas(tmp_path_factory) -> dict:
    """{rank: {bug: (findings, not applicable, message)}} of both ranks."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"file://{tmp_path_factory.mktemp('replicas')}/rendezvous"
    procs = [ctx.Process(target=_replica_rank, args=(r, init, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=180) for _ in procs)
    for p in procs:
        p.join(30)
    assert all(p.exitcode == 0 for p in procs)
    return got


@pytest.mark.xdist_group("watch_replicas")  # one worker spawns the two ranks
@pytest.mark.parametrize("bug", REPLICA_BUGS, ids=str)
def test_replicas_are_compared_across_ranks(bug, replicas):
    findings = {r: got[bug][0] for r, got in replicas.items()}
    messages = {r: got[bug][2] for r, got in replicas.items()}
    assert all(got[bug][1] == [] for got in replicas.values())  # the check ran on both ranks
    if bug is None:
        assert findings == {0: [], 1: []}
    elif bug == "not_averaged":  # both ranks see it at the first check after the replicas diverged (step 1)
        assert findings[0] == findings[1] == [("bb_cross_rank", "distributed", "ranks", 1)]
    elif bug == "same_data":
        assert findings[0] == findings[1] == [("bb_cross_rank", "distributed", "data loader", 0)]
    else:  # the buffers differ from the first check on; the replicas' parameters then drift apart too
        assert findings[0][0] == findings[1][0] == ("bb_cross_rank", "distributed", "ranks", 0)
        assert all("buffers differ" in m for m in messages.values())
