"""The watch on ``transformers.Trainer`` loops of two models no one here wrote, GPT-2 and GPT-NeoX, built from tiny
configs (offline), trained on variable-length rows of random tokens, right-padded by the user's collate, with
``FaultbenchCallback`` (issue 24: library findings labelled as such, clean loops silent about the user's code).

On the clean GPT-NeoX loop the watch finds nothing. On the clean GPT-2 loop it finds two things that are true and
are transformers 5.23's own: GPT-2's ``loss_type`` is None, so Trainer counts ``num_items_in_batch`` over the
unshifted labels and both the training loss and the reported evaluation loss are normalized by too many targets.
Both name the code that called the model (Trainer's ``compute_loss``) as transformers', rank after any finding about
the user's code, and a golden recorded from two known-good runs acknowledges them in a third.
"""

from __future__ import annotations

import torch

import faultbench
from faultbench.hf import FaultbenchCallback

VOCAB, PAD, ROWS = 64, 0, 96


def model_of(kind: str, seed: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel, GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(seed)
    if kind == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                          pad_token_id=PAD))
    return GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                            num_attention_heads=2, intermediate_size=64, max_position_embeddings=64,
                                            pad_token_id=PAD))


class Rows(torch.utils.data.Dataset):
    """Rows of 8 to 23 random tokens (never the pad id)."""

    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.rows = [torch.randint(1, VOCAB, (int(torch.randint(8, 24, (1,), generator=g)),), generator=g)
                     for _ in range(ROWS)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i]}


def collate(features: list[dict]) -> dict:
    """Right padding with PAD, the mask, and labels = the ids with -100 on the pads (the model shifts them)."""
    width = max(len(f["input_ids"]) for f in features)
    ids = torch.full((len(features), width), PAD)
    mask = torch.zeros((len(features), width), dtype=torch.long)
    for i, f in enumerate(features):
        ids[i, : len(f["input_ids"])], mask[i, : len(f["input_ids"])] = f["input_ids"], 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def trained(kind: str, seed: int, tmp_path, golden=None) -> faultbench.Watch:
    """12 steps of Trainer (batch 8, warmup 2, an evaluation at step 6) under the callback; its watch."""
    from transformers import Trainer, TrainingArguments

    torch.set_num_threads(1)
    args = TrainingArguments(output_dir=str(tmp_path / f"{kind}-{seed}"), per_device_train_batch_size=8,
                             per_device_eval_batch_size=8, max_steps=12, learning_rate=1e-3, warmup_steps=2,
                             logging_steps=1, eval_strategy="steps", eval_steps=6, save_strategy="no", report_to=[],
                             use_cpu=True, disable_tqdm=True, seed=seed)
    callback = FaultbenchCallback(report=False, golden=golden)
    Trainer(model=model_of(kind, seed), args=args, train_dataset=Rows(seed), eval_dataset=Rows(seed + 100),
            data_collator=collate, callbacks=[callback]).train()
    assert callback.watch.errors == {}
    return callback.watch


def users(watch) -> list:
    """The findings about the user's code (not an installed library's)."""
    return [f for f in watch.findings if not (f.evidence.get("code") or {}).get("library")]


def test_the_clean_gpt_neox_loop_is_silent(tmp_path):
    assert trained("neox", 0, tmp_path).findings == []


def test_the_clean_gpt2_loop_hears_only_of_transformers_own_loss_count(tmp_path):
    w = trained("gpt2", 0, tmp_path)
    assert users(w) == []
    assert [(f.detector, f.where) for f in w.findings] == [("bb_loss_normalization", "loss"), ("bb_eval_loss", "eval")]
    for f in w.findings:
        code = f.evidence["code"]
        assert code["qualname"] == "transformers.trainer.Trainer.compute_loss"
        assert code["library"].startswith("transformers ") and not code["method_of_module"]
    weights = w.findings[0].message.split("sum to ")[1].split(" ")[0]
    assert 0.85 < float(weights) < 0.99  # too many targets counted: the rows' first labels too
    lines = w.report().splitlines()
    assert all("(transformers " in line for line in lines[1:3])


def test_a_golden_of_known_good_gpt2_runs_acknowledges_transformers_findings(tmp_path):
    golden = faultbench.record_golden([trained("gpt2", seed, tmp_path) for seed in (1, 2)])
    assert sorted(d for d, _ in golden["acknowledged"]) == ["bb_eval_loss", "bb_loss_normalization"]
    w = trained("gpt2", 0, tmp_path, golden=golden)
    assert w.findings == []
    assert sorted(f.detector for f in w.acknowledged) == ["bb_eval_loss", "bb_loss_normalization"]
    assert "acknowledged: 2 findings about library code" in w.report()
