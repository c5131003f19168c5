"""Standalone reproduction (no download, CPU, seconds): transformers 5.23.0's Trainer divides GPT-2's causal-LM loss
by a target count taken over the UNSHIFTED labels, because GPT-2's ``loss_type`` is None.

    python wild/repro/gpt2_num_items_in_batch.py

1. The decision, from public attributes: Trainer (trainer.py, ``Trainer.__init__``) counts over ``labels[..., 1:]``
   only when ``LOSS_MAPPING.get(model.loss_type) is ForCausalLMLoss``. ``GPT2LMHeadModel.loss_type`` is None (its
   class name matches no LOSS_MAPPING key), yet the loss the model computes IS ``ForCausalLMLoss`` (the
   ``loss_function`` property falls back to it), which shifts the labels.
2. The effect, with the model's own public ``num_items_in_batch`` argument: the count Trainer passes (every label
   that is not -100) makes the loss smaller than the mean next-token NLL by (N) / (N + rows).
3. The same through the public ``Trainer.evaluate()``: ``eval_loss`` vs the mean NLL computed by hand.
Exit status 1 while the bug is present, 0 once fixed.
"""

import sys
import tempfile

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

torch.manual_seed(0)
torch.set_num_threads(1)
model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)).eval()
llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2))
print(f"GPT2LMHeadModel.loss_type = {model.loss_type!r}; LlamaForCausalLM.loss_type = {llama.loss_type!r}")
print(f"Trainer shifts the count for GPT-2: {LOSS_MAPPING.get(model.loss_type) is ForCausalLMLoss}; "
      f"for Llama: {LOSS_MAPPING.get(llama.loss_type) is ForCausalLMLoss}")
print(f"the loss GPT-2 computes is ForCausalLMLoss: {model.loss_function is ForCausalLMLoss}")

ids = torch.randint(1, 64, (4, 16))
with torch.no_grad():
    logits = model(ids).logits
    nll = F.cross_entropy(logits[:, :-1].reshape(-1, 64), ids[:, 1:].reshape(-1))  # the mean next-token NLL
    unshifted = int(ids.ne(-100).sum())  # what Trainer passes for GPT-2 (4 x 16 = 64)
    shifted = int(ids[:, 1:].ne(-100).sum())  # the targets the loss scores (4 x 15 = 60)
    with_trainer_count = model(ids, labels=ids, num_items_in_batch=torch.tensor(unshifted)).loss
    with_right_count = model(ids, labels=ids, num_items_in_batch=torch.tensor(shifted)).loss
print(f"mean next-token NLL {nll:.5f}; loss with Trainer's count ({unshifted}) {with_trainer_count:.5f} "
      f"(ratio {with_trainer_count / nll:.4f} = {shifted}/{unshifted}); with the shifted count ({shifted}) "
      f"{with_right_count:.5f}")


class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return {"input_ids": ids[i], "labels": ids[i]}


with tempfile.TemporaryDirectory() as out:
    args = TrainingArguments(output_dir=out, per_device_eval_batch_size=4, report_to=[], use_cpu=True)
    eval_loss = Trainer(model=model, args=args, eval_dataset=Rows()).evaluate()["eval_loss"]
print(f"Trainer.evaluate(): eval_loss {eval_loss:.5f} vs the mean NLL {nll:.5f} (ratio {eval_loss / nll:.4f})")
bug = abs(eval_loss / float(nll) - 1) > 1e-3
print("BUG PRESENT: GPT-2's loss is normalized by the unshifted label count" if bug else "fixed")
sys.exit(1 if bug else 0)
