"""The wild programs: what each one is, where it comes from (pinned), how it is prepared offline and run.

A program's files are copied into a fresh folder per run (``prepare``), an injected bug's patch is applied to that
copy, and the program runs there through ``python -m wild.attach`` (see wild/attach.py for the two ways the watch is
attached). Nothing is downloaded: models are built from configs, data is made by wild/data.py.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

from wild import data

HERE = Path(__file__).parent / "programs"
NANOGPT_COMMIT = "3adf61e154c3fe3fca428ad6bc3818b27a3b8291"
MINGPT_COMMIT = "37baab71b9abea1b76ab957409a1cc2fbfba8a26"


@dataclass(frozen=True)
class Program:
    name: str
    title: str
    upstream: str  # project, pinned version or commit, licence
    attach: str  # how faultbench is attached, in words
    source: str  # folder under wild/programs/ copied into the run's folder
    mode: str  # wild.attach --mode: "optimizer" (the one-line wrapper) or "callback" (the program attaches it)
    args: tuple[str, ...]  # the command line, {seed} filled in
    setup: str  # what prepare() makes: "nanogpt" | "mingpt" | "hf" | "lightning"
    notes: str = ""
    declare: dict = field(default_factory=dict)

    def command(self, seed: int) -> list[str]:
        return [a.format(seed=seed) for a in self.args]

    def prepare(self, folder: Path, seed: int) -> None:
        """The program's files and its local data in ``folder`` (created)."""
        shutil.copytree(HERE / self.source, folder, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", "LICENSE", "*.md"))
        if self.setup == "nanogpt":
            data.nanogpt_char_dataset(folder / "data" / "wild", seed)
        elif self.setup == "mingpt":
            (folder / "input.txt").write_text(data.text(0))  # the seed goes to --system.seed
        elif self.setup == "hf":
            data.bpe_tokenizer(folder / "tok")
            (folder / "train.txt").write_text("\n".join(data.documents(seed)) + "\n")
        elif self.setup == "lightning":
            (folder / "data").mkdir(exist_ok=True)
            (folder / "data" / "wikitext-2.txt").write_text(data.text(seed, chars=20_000))


NANOGPT_ARGS = ("train.py", "--dataset=wild", "--device=cpu", "--dtype=float32", "--compile=False",
                "--batch_size=8", "--block_size=32", "--n_layer=2", "--n_head=2", "--n_embd=32", "--max_iters=20",
                "--eval_interval=10", "--eval_iters=5", "--gradient_accumulation_steps=2", "--warmup_iters=5",
                "--lr_decay_iters=20", "--learning_rate=1e-3", "--out_dir=out")
HF = "transformers 5.23.0 (Trainer), accelerate 1.15.0"
CLM = ("run_clm_tiny.py", "--tokenizer_name", "tok", "--train_file", "train.txt", "--seed", "{seed}")
SFT = ("sft_tiny.py", "--tokenizer_name", "tok", "--train_file", "train.txt", "--seed", "{seed}")

PROGRAMS = {p.name: p for p in (
    Program("nanogpt", "nanoGPT train.py + model.py, verbatim",
            f"karpathy/nanoGPT @ {NANOGPT_COMMIT[:12]} (MIT)",
            "one-line wrapper: watch(model, optimizer).start() once configure_optimizers returns",
            "nanogpt", "optimizer", NANOGPT_ARGS, "nanogpt",
            "train.py pins torch.manual_seed(1337) in code: the seed picks the local corpus (same vocabulary)"),
    Program("mingpt", "minGPT projects/chargpt + mingpt/, verbatim",
            f"karpathy/minGPT @ {MINGPT_COMMIT[:12]} (MIT)",
            "one-line wrapper: watch(model, optimizer).start() once Trainer.run builds the optimizer",
            "mingpt", "optimizer",
            ("chargpt.py", "--system.seed={seed}", "--model.model_type=gpt-nano", "--data.block_size=32",
             "--trainer.batch_size=8", "--trainer.max_iters=20", "--trainer.num_workers=0",
             "--trainer.device=cpu", "--system.work_dir=out"), "mingpt",
            "its callback samples 500 characters and saves the model at step 0"),
    Program("hf-gpt2", "Trainer, run_clm-style, GPT-2 from config, group_texts",
            HF, "FaultbenchCallback", "hf_clm", "callback", (*CLM, "--model_type", "gpt2"), "hf"),
    Program("hf-llama", "Trainer, run_clm-style, Llama from config, right padding",
            HF, "FaultbenchCallback", "hf_clm", "callback", (*CLM, "--model_type", "llama", "--padding", "right"),
            "hf"),
    Program("hf-qwen2-left", "Trainer, run_clm-style, Qwen2 from config, LEFT padding",
            HF, "FaultbenchCallback", "hf_clm", "callback", (*CLM, "--model_type", "qwen2", "--padding", "left"),
            "hf"),
    Program("hf-neox", "Trainer, run_clm-style, GPT-NeoX from config, group_texts",
            HF, "FaultbenchCallback", "hf_clm", "callback", (*CLM, "--model_type", "gpt_neox"), "hf"),
    Program("trl-sft", "TRL SFTTrainer, Qwen2 from config, no packing",
            "trl 1.16.0 on " + HF, "FaultbenchCallback", "trl_sft", "callback", SFT, "hf"),
    Program("trl-sft-packing", "TRL SFTTrainer, Qwen2 from config, packing (bfd)",
            "trl 1.16.0 on " + HF, "FaultbenchCallback", "trl_sft", "callback", (*SFT, "--packing"), "hf"),
    Program("lightning-demo", "Lightning's LightningTransformer demo on WikiText2 (local text)",
            "lightning 2.6.6 (lightning.pytorch.demos)", "FaultbenchLightning(model='model')",
            "lightning_lm", "callback", ("lightning_transformer.py", "--seed", "{seed}"), "lightning"),
)}

# Programs asked for that cannot run here, and why (said in results/wild.md).
CANNOT_RUN = {
    "build-nanogpt (karpathy/build-nanogpt train_gpt2.py)":
        "its sizes are constants in the code (B=64, T=1024, GPT-2 124M, 19073 steps) and it reads FineWeb-Edu "
        "shards and HellaSwag: no command line makes it tiny or offline without editing it; nanoGPT and minGPT "
        "stand for Karpathy's loops",
    "litgpt pretrain / finetune (litgpt 0.5.13)":
        "pip would downgrade huggingface_hub 2.4.0 -> 1.3.7 (litgpt pins huggingface-hub<1.4) in the venv "
        "transformers 5.23.0 runs from; not installed",
    "transformers' own examples/pytorch/language-modeling/run_clm.py":
        "not shipped in the wheel, and it loads the `evaluate` accuracy metric from the Hub when evaluating; "
        "wild/programs/hf_clm/run_clm_tiny.py keeps its data path (tokenize with .map, group_texts, "
        "default_data_collator) and its Trainer call",
    "torchtune recipes": "not attempted in the time box (its recipes need torchao and a checkpoint folder)",
}
