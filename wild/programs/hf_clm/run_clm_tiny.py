"""Causal-LM fine-tuning with ``transformers.Trainer``, the way transformers' examples/pytorch/language-modeling/
run_clm.py does it, at a tiny offline size: a model built from its config (``AutoConfig.for_model`` with
``config_overrides``), a tokenizer loaded from a local folder, a ``datasets`` text dataset tokenized with ``.map``,
then either run_clm's ``group_texts`` (concatenate and cut into blocks; ``labels = input_ids``;
``default_data_collator``) or one document per row padded by ``DataCollatorForLanguageModeling(mlm=False)`` (labels
-100 on the pads), with the tokenizer's padding side (``--padding left`` for a decoder padded on the left).

faultbench is attached the documented way: ``callbacks=[FaultbenchCallback()]`` (left out when WILD_BASELINE=1,
the baseline of the overhead figure).
"""

import argparse
import os

import torch
from datasets import Dataset
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    Trainer,
    TrainingArguments,
    default_data_collator,
    set_seed,
)

ARCH = {  # model_type -> config_overrides (run_clm's --config_overrides), all tiny
    "gpt2": dict(n_embd=32, n_layer=2, n_head=2, n_positions=128),
    "llama": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128),
    "qwen2": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128),
    "gpt_neox": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                     max_position_embeddings=128),
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_type", choices=sorted(ARCH), required=True)
    parser.add_argument("--tokenizer_name", required=True)
    parser.add_argument("--train_file", required=True)
    parser.add_argument("--padding", choices=("group", "right", "left"), default="group")
    parser.add_argument("--block_size", type=int, default=64)
    parser.add_argument("--max_steps", type=int, default=16)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--output_dir", default="out")
    args = parser.parse_args()
    set_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name)
    if args.padding != "group":
        tokenizer.padding_side = args.padding
    config = AutoConfig.for_model(args.model_type, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                  **ARCH[args.model_type])
    model = AutoModelForCausalLM.from_config(config)

    with open(args.train_file) as f:
        lines = [line.strip() for line in f if line.strip()]
    raw = Dataset.from_dict({"text": lines}).train_test_split(test_size=0.1, seed=args.seed)

    def tokenize_function(examples):
        return tokenizer(examples["text"])

    tokenized = raw.map(tokenize_function, batched=True, remove_columns=["text"])
    block_size = args.block_size

    if args.padding == "group":
        def group_texts(examples):  # run_clm.py's
            concatenated = {k: sum(examples[k], []) for k in examples.keys()}
            total_length = len(concatenated[list(examples.keys())[0]])
            total_length = (total_length // block_size) * block_size
            result = {k: [t[i: i + block_size] for i in range(0, total_length, block_size)]
                      for k, t in concatenated.items()}
            result["labels"] = result["input_ids"].copy()
            return result

        lm_datasets = tokenized.map(group_texts, batched=True)
        collator = default_data_collator
    else:
        def truncate(examples):
            return {k: [v[:block_size] for v in vs] for k, vs in examples.items()}

        lm_datasets = tokenized.map(truncate, batched=True)
        collator = DataCollatorForLanguageModeling(tokenizer=tokenizer, mlm=False)

    training_args = TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=8, per_device_eval_batch_size=8,
        gradient_accumulation_steps=2, max_steps=args.max_steps, learning_rate=1e-3, warmup_steps=4,
        lr_scheduler_type="cosine", weight_decay=0.01, logging_steps=1, eval_strategy="steps",
        eval_steps=args.max_steps // 2, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
        seed=args.seed, dataloader_num_workers=0,
    )
    callbacks = []
    if os.environ.get("WILD_BASELINE") != "1":
        from faultbench.hf import FaultbenchCallback

        callbacks.append(FaultbenchCallback(report=False))
    trainer = Trainer(model=model, args=training_args, train_dataset=lm_datasets["train"],
                      eval_dataset=lm_datasets["test"].select(range(min(32, len(lm_datasets["test"])))),
                      processing_class=tokenizer, data_collator=collator, callbacks=callbacks)
    trainer.train()
    metrics = trainer.evaluate()
    print(metrics)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
