"""The gradient w.r.t. the logits as a black-box witness of the loss (detectors/blackbox/gradients.py).

On the nanoGPT-style loop (tests/watch/nanogpt.py), on a padded toy loop whose loss is computed OUTSIDE the model
(as the reference does), and on a tiny HF Llama that computes its loss inside: the implied labels, weights and
loss are exact, the correct loops are silent, and each broken label / padding / normalization is found with its
subsystem and place.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import faultbench
from faultbench.detectors.blackbox.gradients import _GradientDetector, implied
from faultbench.watch import IMPLIED_LOSS_DENSE, IMPLIED_LOSS_EVERY
from tests.watch.nanogpt import TrainConfig, train

torch.set_num_threads(1)
GRADIENT_DETECTORS = ["bb_implied_labels", "bb_loss_padding", "bb_loss_normalization"]


def _watch(**kwargs):
    return lambda m, o, s: faultbench.watch(m, o, scaler=s, detectors=GRADIENT_DETECTORS, report=False, **kwargs)


def _found(w) -> list[tuple[str, str, str | None]]:
    return [(f.detector, f.subsystem, f.where) for f in w.findings]


# ---- the analysis itself
def test_implied_labels_weights_and_loss_of_a_cross_entropy_are_exact():
    torch.manual_seed(0)
    logits = torch.randn(3, 7, 11, requires_grad=True)
    labels = torch.randint(0, 11, (3, 7))
    labels[0, :2] = labels[2, 5:] = -100
    loss = F.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1), ignore_index=-100) * 0.5
    loss.backward()
    result = implied(logits.detach(), logits.grad)
    keep = labels != -100
    assert torch.equal(result.labelled, keep)
    assert torch.equal(result.y[keep], labels[keep])
    assert torch.allclose(result.w[keep], torch.full((int(keep.sum()),), 0.5 / int(keep.sum())))
    assert bool((result.w[~keep] == 0).all())
    assert result.weights()[2] == pytest.approx(0.5, rel=1e-5)
    assert result.loss == pytest.approx(float(loss.detach()), rel=1e-5)
    assert result.residual < 1e-4


@pytest.mark.parametrize("shift", [1, 0, 2])  # next-token labels (the candidates), unshifted, shifted twice
def test_checking_the_next_tokens_first_changes_no_implied_label_weight_or_loss(shift):
    torch.manual_seed(shift)
    ids = torch.randint(0, 11, (3, 9))
    labels = ids.roll(-shift, 1)
    labels[:, -max(shift, 1):] = -100
    labels[1, 6:] = -100
    logits = torch.randn(3, 9, 11, requires_grad=True)
    F.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1), ignore_index=-100).backward()
    searched = implied(logits.detach(), logits.grad)
    guessed = implied(logits.detach(), logits.grad.clone(), {"input_ids": ids})  # a new grad object: not cached
    keep = searched.labelled
    assert torch.equal(guessed.labelled, keep) and torch.equal(guessed.y[keep], labels[keep])
    assert torch.equal(searched.y[keep], labels[keep]) and torch.allclose(guessed.nll[keep], searched.nll[keep])
    assert torch.equal(guessed.w.isnan(), searched.w.isnan()) and guessed.loss == pytest.approx(searched.loss)


def test_a_labels_only_analysis_has_the_full_ones_labels_and_is_completed_on_demand():
    torch.manual_seed(0)
    logits = torch.randn(2, 8, 11, requires_grad=True)
    labels = torch.randint(0, 11, (2, 8))
    F.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1)).backward()
    full = implied(logits.detach(), logits.grad.clone())
    grad = logits.grad
    labels_only = implied(logits.detach(), grad, check_shape=False, labels_only=True)
    assert labels_only.w is None and labels_only.loss is None
    assert torch.equal(labels_only.labelled, full.labelled) and torch.equal(labels_only.y, full.y)
    assert implied(logits.detach(), grad, check_shape=False, labels_only=True) is labels_only  # cached
    completed = implied(logits.detach(), grad)  # the same backward, now with weights, loss and shape
    assert completed.loss == pytest.approx(full.loss) and torch.equal(completed.w.isnan(), full.w.isnan())
    assert completed.residual == pytest.approx(full.residual, abs=1e-6)


def test_a_smoothed_loss_does_not_have_the_cross_entropy_shape():
    torch.manual_seed(0)
    logits = torch.randn(2, 9, 13, requires_grad=True)
    F.cross_entropy(logits.reshape(-1, 13), torch.randint(0, 13, (18,)), label_smoothing=0.2).backward()
    assert implied(logits.detach(), logits.grad).residual > _GradientDetector.MAX_RESIDUAL


# ---- the nanoGPT loop (its model returns the loss; 2 micro-batches of equal size per step)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("amp", [False, True])
def test_silent_on_the_correct_nanogpt_loop(seed, amp):
    w = train(TrainConfig(max_iters=8, amp=amp), seed=seed, watch=_watch())["watch"]
    assert w.findings == [] and w.errors == {} and w.not_applicable == {}, w.report()
    sums = w.detectors[2].sums
    assert len(sums) == 2 and all(abs(p["weight_sum"] - 1) < 1e-3 for p in sums)  # the GradScaler's scale divided out


@pytest.mark.parametrize("seed", [0, 1])
def test_targets_not_shifted_are_found_at_the_loss(seed):
    w = train(TrainConfig(max_iters=4), bugs=("no_shift",), seed=seed, watch=_watch())["watch"]
    assert _found(w) == [("bb_implied_labels", "loss", "loss")], w.report()
    assert w.findings[0].step == 0 and "OWN input token" in w.findings[0].message


# ---- a loop whose model returns logits only: the loss is computed outside (as in the reference)
class Toy(torch.nn.Module):
    """A causal toy LM: each position sees its own token and the previous one."""

    def __init__(self, vocab: int = 24, dim: int = 32):
        super().__init__()
        self.emb, self.prev = torch.nn.Embedding(vocab, dim), torch.nn.Embedding(vocab, dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, input_ids, attention_mask=None):
        prev = torch.cat([input_ids[:, :1], input_ids[:, :-1]], 1)
        return self.head(torch.tanh(self.emb(input_ids) + self.prev(prev)))


PAD, EOS, VOCAB = 0, 1, 24


def collate(docs, side="right", bug=None):
    """Padded batch: input_ids, attention_mask, labels aligned with the inputs (pads -100; the loss shifts)."""
    T = max(len(d) for d in docs)
    ids = torch.full((len(docs), T), PAD)
    mask = torch.zeros((len(docs), T), dtype=torch.long)
    labels = torch.full((len(docs), T), -100)
    for row, doc in enumerate(docs):
        start = 0 if side == "right" else T - len(doc)
        ids[row, start:start + len(doc)] = torch.tensor(doc)
        mask[row, start:start + len(doc)] = 1
        if bug == "right_offset":  # labels written at column 0 whatever the padding
            labels[row, :len(doc)] = torch.tensor(doc)
        else:
            labels[row, start:start + len(doc)] = torch.tensor(doc)
    if bug == "pads_not_ignored":
        labels = ids.clone()
    if bug == "mask_pad_id":  # the collator masks labels by id: pad == EOS, every EOS target is lost
        labels[ids == PAD] = -100
    if bug in ("eos_masked", "prompt_and_eos_masked"):  # the EOS masked with the specials: the model never stops
        labels[ids == EOS] = -100
    if bug in ("prompt_masked", "prompt_and_eos_masked"):  # fine-tuning: each row's first half is a prompt
        for row in range(len(docs)):
            real = mask[row].nonzero().flatten()
            labels[row, real[: len(real) // 2]] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def documents(rng: torch.Generator, n: int, eos: int = EOS) -> list[list[int]]:
    return [torch.randint(2, VOCAB, (int(torch.randint(4, 14, (1,), generator=rng)),), generator=rng).tolist()
            + [eos] for _ in range(n)]


def toy_loop(steps=4, accum=2, side="right", bug=None, seed=0, scaler=False, detectors=tuple(GRADIENT_DETECTORS),
             **watch_kwargs):
    """Adam on Toy; per step ``accum`` micro-batches of 4 documents, the loss: summed next-token cross-entropy
    over the window's targets / their count. ``bug`` breaks the collate or the loss. -> the Watch."""
    torch.manual_seed(seed)
    rng = torch.Generator().manual_seed(seed)
    model = Toy()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    grad_scaler = torch.amp.GradScaler("cpu", enabled=scaler, init_scale=1024.0)
    eos = PAD if bug == "mask_pad_id" else EOS
    losses = []
    with faultbench.watch(model, opt, scaler=grad_scaler, detectors=list(detectors), report=False,
                          **watch_kwargs) as w:
        for _ in range(steps):
            batches = [collate(documents(rng, 4, eos), side, bug) for _ in range(accum)]
            count = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
            total = 0.0
            for b in batches:
                ids, labels = b["input_ids"], b["labels"]
                if bug == "permuted":  # rows sorted by length for the model, labels left in order
                    order = b["attention_mask"].sum(1).argsort(descending=True)
                    ids, mask = ids[order], b["attention_mask"][order]
                else:
                    mask = b["attention_mask"]
                logits = model(ids, mask)
                if bug == "not_shifted":
                    shifted, targets = logits, labels
                elif bug == "shifted_twice":
                    shifted, targets = logits[:, :-2], labels[:, 2:]
                else:
                    shifted, targets = logits[:, :-1], labels[:, 1:]
                summed = F.cross_entropy(shifted.reshape(-1, VOCAB), targets.reshape(-1), reduction="sum")
                own = int((labels[:, 1:] != -100).sum())
                norm = {"sum": 1, "micro_mean": own, "micro_mean_over_accum": own * accum,
                        "divided_twice": count * accum}.get(bug, count)
                loss = summed / norm
                grad_scaler.scale(loss).backward()
                total += float(loss.detach())
            grad_scaler.step(opt)
            grad_scaler.update()
            opt.zero_grad(set_to_none=True)
            losses.append(total)
    w.loop_losses, w.last_logits = losses, logits
    return w


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("scaler", [False, True])
def test_silent_on_a_correct_padded_loop_and_the_step_loss_is_the_implied_one(side, scaler):
    w = toy_loop(steps=IMPLIED_LOSS_EVERY + 1, side=side, scaler=scaler)
    assert w.findings == [] and w.errors == {} and w.not_applicable == {}, w.report()
    # the model returns no loss: the sampled StepRecords carry the loss its backwards differentiated
    _assert_sampled(w)


def _assert_sampled(w) -> None:
    """The StepRecords' losses: the loop's own at the watch's first IMPLIED_LOSS_DENSE steps and every
    IMPLIED_LOSS_EVERY-th after, None between."""
    losses = [r.loss for r in w.ctx.history]
    assert len(losses) == len(w.loop_losses) > IMPLIED_LOSS_EVERY > IMPLIED_LOSS_DENSE
    for i, (seen, loop) in enumerate(zip(losses, w.loop_losses, strict=True)):
        sampled = i < IMPLIED_LOSS_DENSE or i % IMPLIED_LOSS_EVERY == 0
        assert seen == (pytest.approx(loop, rel=1e-4) if sampled else None), (i, losses)


def test_the_gradient_checks_retire_and_then_no_logits_gradient_is_hooked():
    """Each gradient analysis examines the first micro-batches only; once none takes on_backward, the watch stops
    hooking the logits (no implied loss is due at the last step either: the model returns none, and the step is
    neither one of the dense ones nor an IMPLIED_LOSS_EVERY-th)."""
    w = toy_loop(steps=IMPLIED_LOSS_EVERY - 1, accum=2)
    assert w.findings == [] and w.errors == {} and w.not_applicable == {}, w.report()
    assert all("on_backward" in det.retired for det in w.detectors), [(d.id, d.retired) for d in w.detectors]
    assert not w.last_logits._backward_hooks  # the last forward's logits: nothing hooked


def test_the_implied_loss_fills_the_step_record_with_no_detector():
    w = toy_loop(steps=IMPLIED_LOSS_EVERY + 1, detectors=[])
    _assert_sampled(w)


@pytest.mark.parametrize(("bug", "side", "expected", "words"), [
    ("not_shifted", "right", ("bb_implied_labels", "loss", "loss"), "OWN input token"),
    ("shifted_twice", "right", ("bb_implied_labels", "loss", "loss"), "token after next"),
    ("permuted", "right", ("bb_implied_labels", "loss", "loss"), "OTHER rows"),
    ("right_offset", "left", ("bb_implied_labels", "collate", "batch"), "padding offset"),
    ("pads_not_ignored", "right", ("bb_loss_padding", "collate", "batch"), "targets that are padding"),
    ("mask_pad_id", "right", ("bb_loss_padding", "collate", "batch"), "(the pad id;"),
    ("sum", "right", ("bb_loss_normalization", "loss", "loss"), "summed over the tokens"),
    ("micro_mean", "right", ("bb_loss_normalization", "loss", "loss"), "averaged over its own targets"),
    ("divided_twice", "right", ("bb_loss_normalization", "loss", "loss"), "divided by the accumulation steps twice"),
    # each micro-batch's own mean / accum: the weights sum to 1 but differ between micro-batches of unequal length
    ("micro_mean_over_accum", "right", ("bb_loss_normalization", "loss", "loss"), "weigh their tokens differently"),
])
def test_each_broken_label_padding_or_normalization_is_found(bug, side, expected, words):
    w = toy_loop(side=side, bug=bug)
    assert w.findings and _found(w)[0] == expected, w.report()
    assert words in w.findings[0].message and w.findings[0].step == 0
    assert len(w.findings) == 1, w.report()  # one explanation, not a cascade


def test_a_masked_eos_is_found_and_prompt_masking_is_not():
    """The declared EOS never trained while the other real targets are: found. A fine-tuning loop that masks its
    prompts trains fewer than 90% of the other real targets: its masking is its own choice, nothing is judged."""
    declare = {"declare": {"eos_id": EOS}}
    w = toy_loop(bug="eos_masked", detectors=["bb_loss_padding"], **declare)
    assert _found(w) == [("bb_loss_padding", "collate", "batch")] and "never learns to stop" in w.findings[0].message
    assert toy_loop(bug="prompt_masked", detectors=["bb_loss_padding"], **declare).findings == []
    assert toy_loop(bug="prompt_and_eos_masked", detectors=["bb_loss_padding"], **declare).findings == []
    assert toy_loop(detectors=["bb_loss_padding"], **declare).findings == []


def test_a_golden_envelope_with_the_users_weight_sums_accepts_a_summed_loss():
    golden = {"runs": 1, "steps": [{"loss": None, "grad_norm": None, "weight_sum": [20.0, 120.0]}]}
    w = toy_loop(bug="sum", golden=golden)
    assert w.findings == [], w.report()


# ---- a tiny HF Llama: the model computes the loss from `labels` itself (it shifts them)
@pytest.fixture(scope="module")
def llama():
    from faultbench import targets

    targets.get("hf")  # offline hub before transformers is imported
    from transformers import LlamaConfig, LlamaForCausalLM

    def make(seed: int):
        torch.manual_seed(seed)
        return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                            max_position_embeddings=64, pad_token_id=PAD))

    return make


def hf_loop(make, bug=None, seed=0, steps=3):
    model = make(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rng = torch.Generator().manual_seed(seed)
    with faultbench.watch(model, opt, detectors=GRADIENT_DETECTORS, report=False) as w:
        for _ in range(steps):
            batch = collate(documents(rng, 6), "right", "pads_not_ignored" if bug == "pads_not_ignored" else None)
            labels = batch["labels"]
            if bug == "pre_shifted":  # the collator shifts, and the model shifts again
                labels = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)
            if bug == "rows_rolled":  # labels of the next row
                labels = labels.roll(1, 0)
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels).loss.backward()
            opt.step()
            opt.zero_grad()
    return w


@pytest.mark.parametrize("seed", [0, 1])
def test_silent_on_a_correct_hf_llama_loop(llama, seed):
    w = hf_loop(llama, seed=seed)
    assert w.findings == [] and w.errors == {} and w.not_applicable == {}, w.report()
    assert all(abs(p["weight_sum"] - 1) < 1e-3 for p in w.detectors[2].sums)


@pytest.mark.parametrize(("bug", "expected"), [
    ("pre_shifted", ("bb_implied_labels", "loss", "loss")),
    ("rows_rolled", ("bb_implied_labels", "collate", "batch")),  # the batch's own labels are another row's
    ("pads_not_ignored", ("bb_loss_padding", "collate", "batch")),
])
def test_hf_llama_label_faults_are_found(llama, bug, expected):
    w = hf_loop(llama, bug=bug)
    assert _found(w) and _found(w)[0] == expected, w.report()
