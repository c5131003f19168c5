"""Lightning's own language-model example: ``lightning.pytorch.demos.LightningTransformer`` (a ``nn.Transformer``
encoder-decoder over word ids, its ``training_step`` an NLL of next words, SGD) on ``lightning.pytorch.demos.
WikiText2``, as Lightning's README and "LightningModule" docs run them. Offline: ``WikiText2(download=False)``
reads ``data/wikitext-2.txt``, which the harness writes from the local corpus; the sizes are the demo's own
defaults except the corpus (a few thousand words) and the steps.

faultbench is attached the documented way: ``callbacks=[FaultbenchLightning(model="model")]`` (the submodule that
computes the outputs; left out when WILD_BASELINE=1, the baseline of the overhead figure).
"""

import argparse
import os
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.demos import LightningTransformer, WikiText2
from torch.utils.data import DataLoader


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--max_steps", type=int, default=12)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()
    L.seed_everything(args.seed)

    dataset = WikiText2(data_dir=Path("data"), download=False)
    dataloader = DataLoader(dataset, batch_size=8, shuffle=True)
    model = LightningTransformer(vocab_size=dataset.vocab_size)
    callbacks = []
    if os.environ.get("WILD_BASELINE") != "1":
        from faultbench.lightning import FaultbenchLightning

        callbacks.append(FaultbenchLightning(model="model", report=False))
    trainer = L.Trainer(max_steps=args.max_steps, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks)
    trainer.fit(model=model, train_dataloaders=dataloader)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
