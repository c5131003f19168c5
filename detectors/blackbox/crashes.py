"""Where a crash comes from, told by what the loop was doing and by replaying what it was given (black-box track).

A crash names itself: the traceback is the user's first clue. What it does not say is which part of the run is at
fault: an index error deep in an attention kernel may be the mask the collator built, the positions, the length of
the batch, or the model. ``bb_crash_site`` answers from behaviour, never from the names of the code:

1. the batch: token ids outside the vocabulary, or longer than any batch trained on (and the golden's) -> data;
2. a library component that raised it (its files: the loss scaler, the optimizer, the scheduler, the collectives,
   serialization, the data loader, and in the loader whether the dataset or the collate function raised);
3. inside a forward, the forward replayed on the crash's batch (no grad, eval mode, RNG restored): the innermost
   module still running when it raises (module hooks on the replay only), and which input it depends on: without
   the attention mask it runs (mask), without the position ids (position), on the first half of the columns
   (position: the model's positions do not cover the length), not at all (model); a forward that raises in the
   loop but not in the replay raised on what the replay leaves out (labels: the loss; else train mode: model);
4. outside any forward, a training framework's component running (transformers' Trainer and data collators,
   accelerate): the innermost one on the stack, by what each does per its documentation (saving and loading
   checkpoints, evaluating, generating and its position and mask bookkeeping, the loss, the optimizer and scheduler,
   the loaders, mixed precision, the collectives);
5. the phase of the step it interrupted (``WatchContext.phase``): before the first forward (building the first
   batch: data; of a loop resumed past step 0: the checkpoint), while the loop reads or loads the model's or the
   optimizer's state between steps (the checkpoint), in the optimizer's step (optimizer), after a training forward
   and before the step (the loss, its backward, clipping: the loss unless the backward raised), after an evaluation
   forward (evaluation; of one token a row, a decode step: generation, the model's), between steps (the next batch:
   data).
"""

from __future__ import annotations

import os

import torch

from faultbench.detectors.api import Finding, _jsonable, register
from faultbench.detectors.blackbox.api import BlackBoxDetector, WatchContext
from faultbench.detectors.blackbox.probes import raised_in

# a library's component, by the files it lives in: (path fragment, subsystem, name), innermost frame first
LIBRARY_SITES = (
    ("torch/amp/grad_scaler.py", "precision", "scaler"), ("torch/cuda/amp/grad_scaler.py", "precision", "scaler"),
    ("torch/optim/lr_scheduler.py", "optimizer", "scheduler"), ("torch/optim/", "optimizer", "optimizer"),
    ("torch/nn/utils/clip_grad.py", "optimizer", "gradient clipping"),
    ("torch/nn/parallel/", "distributed", "ranks"), ("torch/distributed/", "distributed", "ranks"),
    ("torch/serialization.py", "checkpoint", "checkpoint"), ("safetensors/", "checkpoint", "checkpoint"),
)
# the training frameworks' components, by file and (where one file holds many) function: what each does per its
# documentation (transformers' Trainer, accelerate), never a model's code; the innermost one on the stack is named
COMPONENTS = (
    ("transformers/trainer.py", "checkpoint", (
        "_save_checkpoint", "_save_optimizer_and_scheduler", "_save_rng_state", "_save_scaler", "save_model", "_save",
        "_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_rng_state", "_load_scaler",
        "_load_best_model", "_rotate_checkpoints", "_sorted_checkpoints", "_init_training_state")),
    ("transformers/trainer.py", "eval", (
        "evaluate", "_evaluate", "evaluation_loop", "prediction_step", "get_eval_dataloader", "predict",
        "get_test_dataloader")),
    ("transformers/trainer.py", "loss", ("compute_loss", "_get_num_items_in_batch")),
    ("transformers/trainer.py", "optimizer", (
        "create_optimizer", "create_scheduler", "create_optimizer_and_scheduler", "get_decay_parameter_names",
        "get_optimizer_cls_and_kwargs")),
    ("transformers/trainer.py", "data", (
        "get_train_dataloader", "_get_train_sampler", "_get_dataloader", "get_batch_samples",
        "_remove_unused_columns")),
    ("transformers/generation/utils.py", "position", (  # the decode's bookkeeping of positions and cache offsets
        "_prepare_position_ids_for_generation", "_update_model_kwargs_for_generation", "_get_initial_cache_position",
        "prepare_inputs_for_generation", "_cache_dependant_input_preparation")),
    ("transformers/generation/utils.py", "mask", ("_prepare_attention_mask_for_generation",)),
    ("transformers/generation/", "model", None),  # the decode loop itself, its logits processing, its cache
    ("transformers/data/data_collator.py", "collate", None), ("transformers/loss/", "loss", None),
    ("transformers/optimization.py", "optimizer", None),
    ("accelerate/data_loader.py", "checkpoint", ("skip_first_batches",)), ("accelerate/data_loader.py", "data", None),
    ("accelerate/optimizer.py", "optimizer", None), ("accelerate/scheduler.py", "optimizer", None),
    ("accelerate/accelerator.py", "optimizer", ("clip_grad_norm_", "clip_grad_value_")),
    ("accelerate/accelerator.py", "checkpoint", ("save_state", "load_state", "save_model")),
    ("accelerate/accelerator.py", "distributed", ("prepare_model", "no_sync", "gather", "reduce")),
    ("accelerate/utils/operations.py", "distributed", None),
    ("accelerate/utils/modeling.py", "precision", ("get_mixed_precision_context_manager",)),
)
# the components that call the user's code (a schedule's lambda, a scaler's or optimizer's hook, a tensor's own
# serialization): one running further out on the stack names a crash in what it called; not the collectives'
# wrappers, which run every forward
CALLING_SITES = ("scheduler", "optimizer", "scaler", "checkpoint")
FETCH = "torch/utils/data/_utils/fetch.py"  # the loader's fetch: dataset items, then the collate function
BACKWARD = ("torch/autograd/", "torch/_tensor.py")  # a backward's frames

# what a crash outside any forward says, by the phase it interrupted: (subsystem, where, what ran there)
PHASES = {
    "setup": ("data", "batch", "the loop was building its first batch (no training forward had run)"),
    "resuming": ("checkpoint", "checkpoint", "the loop was resuming from a checkpoint (it had not run a training "
                 "forward since its restore)"),
    "checkpoint": ("checkpoint", "checkpoint", "the loop was saving or restoring a checkpoint (it had read or loaded "
                   "the model's or the optimizer's state since its last step)"),
    "between steps": ("data", "batch", "the loop was between optimizer steps (its next batch, its schedule)"),
    "backward": ("loss", "loss", "a training forward had returned and the optimizer had not stepped: the loop was "
                 "computing the loss from the model's output"),
    "step": ("optimizer", "optimizer", "the optimizer was stepping"),
    "evaluation": ("eval", "eval", "the loop was evaluating (a forward without grad had run since the last step)"),
    "generation": ("model", "generate", "the loop was generating (its last forward, without grad, decoded one token "
                   "a row)"),
}


def _path(frame) -> str:
    return frame[0].replace(os.sep, "/")


@register
class CrashSite(BlackBoxDetector):
    """A crash located by its batch, the library component that raised it, the phase of the step it interrupted,
    and, inside a forward, a replay of that forward on the crash's batch (see the module's docstring)."""

    id = "bb_crash_site"
    family = "data"
    description = "a crash located by its batch, the library part that raised it, the step's phase, a replayed forward"

    def __init__(self) -> None:
        super().__init__()
        self._longest = 0

    def on_forward(self, ctx: WatchContext, batch: dict, logits, loss) -> None:
        ids = batch.get("input_ids")
        if isinstance(ids, torch.Tensor) and ids.dim():
            self._longest = max(self._longest, ids.shape[-1])

    def on_crash(self, ctx: WatchContext, crash: dict) -> None:
        what = f"the run crashed ({crash['type']}: {crash['message'][:160]}{_at(crash.get('code'))})"
        frames = crash.get("frames") or []
        phase = crash.get("phase")
        for locate in (lambda: self._batch(ctx), lambda: library_site(frames), lambda: self._forward(ctx, phase),
                       lambda: component_site(frames, crash.get("qualnames")), lambda: self._phase(ctx, frames, phase)):
            found = locate()
            if found is not None:
                subsystem, where, why, evidence, confidence = found
                self.report(ctx, subsystem, where, f"{what} {why}",
                            {"phase": phase, "code": crash.get("code"), **evidence}, confidence=confidence)
                return

    # -- each returns (subsystem, where, why, evidence, confidence) or None
    def _batch(self, ctx: WatchContext):
        ids = (ctx.pending_batch or {}).get("input_ids")
        if not isinstance(ids, torch.Tensor) or not ids.numel() or ids.is_floating_point():
            return None
        vocab = _vocab_size(ctx)
        if vocab is not None and (int(ids.max()) >= vocab or int(ids.min()) < 0):
            return ("data", "batch", f"on a batch holding token id {int(ids.max())} while the vocabulary has {vocab} "
                    "ids: the batch was built with an id outside the vocabulary (a pad or special id that the "
                    "tokenizer does not have)", {"max_id": int(ids.max()), "vocab": vocab}, 0.75)
        longest = max(self._longest, (ctx.golden or {}).get("max_len") or 0)
        if longest and ids.dim() and ids.shape[-1] > longest:
            return ("data", "batch", f"on a batch of length {ids.shape[-1]}, longer than any batch trained on before "
                    f"({longest}): a document escaped truncation", {"length": ids.shape[-1], "longest": longest}, 0.65)
        return None

    def _forward(self, ctx: WatchContext, phase: str | None):
        batch = ctx.pending_batch or {}
        if phase not in ("forward", "eval forward") or "input_ids" not in batch:
            return None
        if ctx.world_size > 1:  # a replayed forward's collectives (a DDP buffer broadcast) would wait for every rank
            return ("model", "", "inside a forward (not replayed: other ranks would have to join it)", {}, 0.4)
        replay = _Replay(ctx, batch)
        where = replay.raises()
        call = replay.inputs  # the innermost module's call as the loop's batch makes it
        if where is None:  # the replay ran: what it leaves out made the loop's forward raise
            if "labels" in batch:
                return ("loss", "loss", "in a forward given labels; the same forward without them runs: the loss the "
                        "model computes from its labels raised", {"replayed": True}, 0.5)
            return ("model", "", "in a training forward that runs in eval mode without grad: what train mode "
                    "changes (dropout, a training-only branch) raised", {"replayed": True}, 0.4)
        for drop, subsystem, why in (("attention_mask", "mask", "without its attention mask it runs: the mask the "
                                      "loop passed does not fit the model"),
                                     ("position_ids", "position", "without its position ids it runs: the positions "
                                      "the loop passed do not fit the model")):
            if drop in batch and replay.raises(drop=drop) is None:
                return (subsystem, where, f"in {where or 'the model'}; replayed, the forward raises again, and {why}",
                        {"module": where, "without": drop}, 0.6)
        if batch["input_ids"].dim() == 2 and batch["input_ids"].shape[1] >= 4 and replay.raises(half=True) is None:
            return ("position", where, f"in {where or 'the model'}; replayed, the forward raises again at the batch's "
                    f"length ({batch['input_ids'].shape[1]}) and runs on half of it: the model's positions (a table, "
                    "a rotary cache, a length limit) do not cover the batch", {"module": where, "length":
                                                                               batch["input_ids"].shape[1]}, 0.6)
        if where and _given_positions(call, batch["input_ids"]):
            return ("position", where, f"in {where}, the innermost module running, which was given the positions (an "
                    "integer tensor counting along the batch's columns); replayed, it raises again, with or without "
                    "the mask and positions and on half the length: the code that turns positions into the model's "
                    "position signal", {"module": where, "given_positions": True}, 0.55)
        module = f"in {where}, the innermost module running" if where else "in the model's own forward"
        return ("model", where, f"{module}; replayed on the crash's batch it raises again, with or without the "
                "mask and positions and on half the length: the model's code", {"module": where}, 0.55)

    def _phase(self, ctx: WatchContext, frames: list, phase: str | None):
        if phase == "backward" and any(b in _path(f) for f in frames for b in BACKWARD):
            return ("model", "", "in the backward of a training step: the graph its forward built cannot be "
                    "differentiated (an in-place change of a saved tensor, a dtype or shape the backward rejects)",
                    {}, 0.45)
        if phase == "setup" and ctx.start_step > 0:  # a loop that starts past step 0 was restored
            phase = "resuming"
        if phase not in PHASES:
            return None
        subsystem, where, during = PHASES[phase]
        return (subsystem, where, f"while {during}", {}, 0.35)


def library_site(frames: list):
    """A crash raised inside a library component (the loader's dataset or collate function, the scaler, the
    optimizer, ...), by its files; (subsystem, where, why, evidence, confidence) or None."""
    paths = [_path(f) for f in frames]
    fetches = [i for i, p in enumerate(paths) if FETCH in p]
    if fetches:  # what the loader's fetch called: the dataset's item (data) or the collate function (collate)
        called = frames[fetches[-1] + 1] if fetches[-1] + 1 < len(frames) else None
        item = called is None or called[2] in ("__getitem__", "__getitems__")
        subsystem, part = ("data", "dataset") if item else ("collate", "collate function")
        return (subsystem, "data loader", f"inside the data loader's {part}, building a batch",
                {"frame": (called or frames[-1])[0]}, 0.55)
    innermost = paths[-1] if paths else ""  # the library raised it itself
    for site, subsystem, where in LIBRARY_SITES:
        if site in innermost:
            return (subsystem, where, f"inside the {where} ({innermost.rsplit('/', 1)[-1]}): the {where} was "
                    "used out of its contract", {"frame": innermost}, 0.5)
    for path in reversed(paths):  # a component that was running and called the code that raised (a schedule's lambda)
        for site, subsystem, where in LIBRARY_SITES:
            if site in path and where in CALLING_SITES:
                return (subsystem, where, f"in code the {where} called ({path.rsplit('/', 1)[-1]} was running): "
                        f"what the {where} was given raised", {"frame": path, "called": innermost}, 0.45)
    return None


def component_site(frames: list, qualnames: list | None = None):
    """The innermost training-framework component on the crash's stack (``COMPONENTS``), named by its qualified
    name where ``qualnames`` (one per frame) has it; (subsystem, where, why, evidence, confidence) or None."""
    for i in reversed(range(len(frames))):  # innermost first
        path, name = _path(frames[i]), frames[i][2]
        for site, subsystem, functions in COMPONENTS:
            if site in path and (functions is None or name in functions):
                module = path.split("site-packages/")[-1].removesuffix(".py").replace("/", ".")
                known = qualnames and len(qualnames) == len(frames) and not qualnames[i].startswith("?.")
                qualname = qualnames[i] if known else f"{module}.{name}"
                return (subsystem, qualname, f"in {qualname}, the framework's {subsystem} component, the "
                        "innermost one running", {"frame": path, "function": name}, 0.45)
    return None


def unwatched_crash(crash: dict) -> Finding:
    """A crash no watch saw (``faultbench.guard``: the program raised before its loop was watched), located by the
    library component that raised it, else by what the program had built: inside a method of a torch module (the
    model being built or initialized), before any module registered a parameter (the data: corpus, tokenizer,
    datasets), else after the model and before training (what surrounds the model: the optimizer first).
    ``crash``: ``faultbench.guard.crash_of`` plus "parameters" (registered before it raised)."""
    frames, code = crash.get("frames") or [], crash.get("code")
    found = library_site(frames) or component_site(frames, crash.get("qualnames"))
    if found is None:
        if code is not None and code["method_of_module"]:
            found = ("model", "", "inside a method of a torch module: the model was being built or initialized",
                     {}, 0.4)
        elif not crash.get("parameters"):
            found = ("data", "", "before any module had registered a parameter: the program was preparing its "
                     "data (the corpus, the tokenizer, the datasets)", {}, 0.4)
        else:
            found = ("optimizer", "", "after the model's parameters were registered and before its training loop "
                     "was watched: the program was building what surrounds the model (the optimizer and its "
                     "schedule, the loss scaler, the ranks)", {}, 0.3)
    subsystem, where, why, evidence, confidence = found
    message = (f"the program crashed before its training loop was watched ({crash['type']}: "
               f"{crash['message'][:160]}{_at(code)}) {why}")
    return Finding(CrashSite.id, 0, subsystem, None, message, _jsonable(
        {"phase": "unwatched", "code": code, "parameters": crash.get("parameters"), **evidence}), confidence,
        where or (code or {}).get("qualname"))


def _at(code: dict | None) -> str:
    """" at pkg.mod.fn (file:line)", saying whose code that is."""
    if code is None:
        return ""
    whose = f", in {code['library']}, not your code" if code["library"] else ""
    return f" at {code['qualname']} ({code['file'].rsplit('/', 1)[-1]}:{code['line']}{whose})"


class _Replay:
    """The crash's forward called again on its batch, as a probe (no grad, eval mode, RNG restored): ``raises()``
    says the innermost module running when it raised ("" for the model's own code), None when it runs."""

    def __init__(self, ctx: WatchContext, batch: dict):
        self.ctx, self.batch = ctx, batch
        self.inputs: tuple = ((), {})  # the innermost module's call (args, kwargs) in the last replay that raised

    def raises(self, drop: str | None = None, half: bool = False) -> str | None:
        kwargs = {k: v for k, v in self.batch.items() if k in ("attention_mask", "position_ids") and k != drop}
        ids = self.batch["input_ids"]
        if half:
            cut = ids.shape[1] // 2
            ids, kwargs = ids[:, :cut], {k: v[:, :cut] for k, v in kwargs.items()}
        calls: list = []
        with self.ctx.probe():
            where = raised_in(self.ctx.model, lambda: self._call(ids, kwargs), calls)
        if calls:
            self.inputs = calls[0]
        return where

    def _call(self, ids: torch.Tensor, kwargs: dict) -> None:
        """The model called the way the loop calls it: by keyword where its forward names its input ids."""
        try:
            by_name = self.ctx.lm.by_name
        except Exception:  # noqa: BLE001 - no call convention found (the plainest call raises): call positionally
            by_name = False
        if by_name:
            self.ctx.model(input_ids=ids, **kwargs)
        else:
            self.ctx.model(ids, **kwargs)


def _given_positions(call: tuple, ids: torch.Tensor) -> bool:
    """Whether a module call (args, kwargs) was given positions and no mask: an integer tensor, not the token ids,
    whose last dimension is the batch's length and which counts up by one along it for most of its steps (left
    padding and packed documents restart or hold it). A module given a mask too (a boolean tensor, or one whose last
    two dimensions are the length: a whole layer passes both on) is not singled out."""
    args, kwargs = call
    length = ids.shape[-1]
    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    if any(t.dtype == torch.bool or (t.dim() >= 2 and t.shape[-2:] == (length, length)) for t in tensors):
        return False
    for t in tensors:
        if t.is_floating_point() or not t.dim() or t.shape[-1] != length or length < 3 \
                or (t.shape == ids.shape and torch.equal(t, ids)):
            continue
        if float((t.diff(dim=-1) == 1).float().mean()) >= 0.5:
            return True
    return False


def _vocab_size(ctx: WatchContext) -> int | None:
    """The vocabulary the model embeds: the tokenizer's size, else the largest embedding table."""
    tok = ctx.tokenizer
    for size in (_safe_len(tok), getattr(tok, "vocab_size", None)):
        if isinstance(size, int) and size > 0:
            return size
    tables = [m.num_embeddings for m in ctx.model.modules() if isinstance(m, torch.nn.Embedding)]
    return max(tables) if tables else None


def _safe_len(obj) -> int | None:
    try:
        return len(obj) if obj is not None else None
    except TypeError:
        return None
