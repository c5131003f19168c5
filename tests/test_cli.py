"""The command line: `faultbench train --json` and `faultbench seams --json`."""

import functools
import json
import subprocess
import sys

import pytest

from faultbench.harness.cli import main
from faultbench.model.seams import SEAMS


def test_train_json_summary(capsys):
    assert main(["train", "--preset", "tiny", "--steps", "12", "--json", "--log-every", "5"]) == 0
    out, err = capsys.readouterr()
    summary = json.loads(out.strip().splitlines()[-1])
    for key in ("final_loss", "val_loss", "loss_floor", "steps", "tokens_per_s"):
        assert key in summary
    assert summary["steps"] == 12
    assert summary["val_loss"] > summary["loss_floor"] > 0
    assert "step    10" in err  # progress goes to stderr when stdout carries JSON


def test_train_resume_continues_from_checkpoint(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    assert main(["train", "--steps", "8", "--save", str(ckpt), "--json"]) == 0
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(["train", "--steps", "8", "--resume", str(ckpt), "--json"]) == 0
    resumed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # resuming at the final step trains nothing more and reproduces the same model
    assert resumed["steps"] == first["steps"] == 8
    assert resumed["val_loss"] == first["val_loss"]


def test_bad_config_is_a_clear_error_not_a_traceback(capsys):
    assert main(["train", "--accum", "3"]) == 2
    assert "--world-size 1 x --accum 3 must divide the preset's batch of 16" in capsys.readouterr().err


def test_seams_json_lists_every_seam():
    out = subprocess.run([sys.executable, "-m", "faultbench", "seams", "--json"], capture_output=True, text=True,
                         check=True).stdout
    rows = json.loads(out)
    assert [r["name"] for r in rows] == list(SEAMS)
    assert all(r["file"].startswith("model/") and r["line"] > 0 for r in rows)


def _last_json(argv: list[str]) -> dict:
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=300).stdout
    return json.loads(out.strip().splitlines()[-1])


@functools.cache
def _single_process(args: tuple[str, ...]) -> dict:
    return _last_json([sys.executable, "-m", "faultbench", *args])


@pytest.mark.parametrize(
    "launcher",
    [[sys.executable, "-m", "faultbench"],
     [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "faultbench"]],
    ids=["world-size-flag", "torchrun"],
)
@pytest.mark.xdist_group("cli_two_ranks")
def test_two_rank_training_matches_single_process(launcher):
    # Two ranks on the same global batch reach the single-process model up to float noise.
    args = ("train", "--steps", "6", "--json")
    single = _single_process(args)  # one run for both launchers (on one worker: their group)
    ddp = _last_json([*launcher, *args, "--world-size", "2"])
    assert ddp["world_size"] == 2 and ddp["steps"] == 6
    assert ddp["val_loss"] == pytest.approx(single["val_loss"], abs=1e-4)


@pytest.mark.parametrize("argv", [["train", "--precision", "fp8"], ["train", "--preset", "tinny"]])
def test_argparse_rejects_unknown_choices(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_plugins_lists_the_installed_entry_points_and_says_when_plugin_files_load(capsys, monkeypatch):
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parent / "detector_stub"))  # an installed detector package
    assert main(["plugins", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {"group": "faultbench.detectors", "name": "stub", "loads": "faultbench_detector_stub",
            "from": "faultbench-detector-stub"} in listed
    assert main(["plugins"]) == 0
    assert "loads only when a command line names it" in capsys.readouterr().out
