"""Supervised fine-tuning with TRL's ``SFTTrainer`` the way TRL's quickstart and trl/scripts/sft.py run it (a text
dataset, ``SFTConfig``, the trainer builds the collator), at a tiny offline size: a Qwen2 model built from its
config, a tokenizer from a local folder, a ``datasets.Dataset`` of local text. ``--packing`` packs the rows into
fixed-length sequences (TRL's default "bfd" strategy: a row's position ids restart at each document).

faultbench is attached the documented way for a ``Trainer`` subclass: ``callbacks=[FaultbenchCallback()]`` (left
out when WILD_BASELINE=1, the baseline of the overhead figure).
"""

import argparse
import os

import torch
from datasets import Dataset
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, set_seed
from trl import SFTConfig, SFTTrainer


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer_name", required=True)
    parser.add_argument("--train_file", required=True)
    parser.add_argument("--packing", action="store_true")
    parser.add_argument("--max_steps", type=int, default=16)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--output_dir", default="out")
    args = parser.parse_args()
    set_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name)
    config = AutoConfig.for_model("qwen2", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=128, pad_token_id=tokenizer.pad_token_id,
                                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = AutoModelForCausalLM.from_config(config)
    with open(args.train_file) as f:
        lines = [line.strip() for line in f if line.strip()]
    dataset = Dataset.from_dict({"text": lines}).train_test_split(test_size=0.1, seed=args.seed)

    training_args = SFTConfig(
        output_dir=args.output_dir, max_length=64, packing=args.packing, per_device_train_batch_size=8,
        per_device_eval_batch_size=8, max_steps=args.max_steps, learning_rate=1e-3, warmup_steps=4,
        logging_steps=1, eval_strategy="steps", eval_steps=args.max_steps // 2, save_strategy="no", report_to=[],
        use_cpu=True, disable_tqdm=True, seed=args.seed, dataloader_num_workers=0,
    )
    callbacks = []
    if os.environ.get("WILD_BASELINE") != "1":
        from faultbench.hf import FaultbenchCallback

        callbacks.append(FaultbenchCallback(report=False))
    trainer = SFTTrainer(model=model, args=training_args, train_dataset=dataset["train"],
                         eval_dataset=dataset["test"].select(range(min(32, len(dataset["test"])))),
                         processing_class=tokenizer, callbacks=callbacks)
    trainer.train()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
