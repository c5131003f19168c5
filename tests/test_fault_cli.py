"""The fault-facing command line, plugins, and the pytest --inject-fault option."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from faultbench import targets
from faultbench.faults.registry import BUILTIN_MODULES, all_faults
from faultbench.harness.cli import main

ROOT = Path(__file__).resolve().parents[1]

PLUGIN = textwrap.dedent('''
    from faultbench.faults.registry import Manifest, fault
    from faultbench.model.config import TrainConfig


    @fault(
        "plugin_lr_times_100",
        seam="model.optim.lr_at",
        title="A plugin fault: the schedule returns a learning rate 100 times too large",
        subsystem="optimizer",
        trigger="always",
        symptoms=("divergence",),
        explanation="lr_at multiplies the schedule by 100, so AdamW takes steps far too large to converge.",
        fix="Return the schedule's value as computed.",
        references=("Karpathy, A Recipe for Training Neural Networks: tune the learning rate",),
        manifest=Manifest(check="loss_above", steps=40, params={"min_gap": 0.5}),
    )
    def lr_at_times_100(step, cfg):
        """Learning rate 100x the schedule."""
        import math

        if step < cfg.warmup_steps:
            return 100 * cfg.lr * (step + 1) / cfg.warmup_steps
        decay_steps = max(cfg.steps - cfg.warmup_steps, 1)
        progress = min((step - cfg.warmup_steps) / decay_steps, 1.0)
        return 100 * (cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr))
''')


def _cli(*args, check=True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "faultbench", *args], capture_output=True, text=True, check=check,
                          timeout=300, cwd=ROOT)


def test_faults_json_lists_the_registry(capsys):
    assert main(["faults", "--json"]) == 0
    listed = {f["id"] for f in json.loads(capsys.readouterr().out)}
    assert listed == set(all_faults())


def test_show_prints_metadata_and_diff(capsys):
    fault_id = sorted(all_faults())[0]
    assert main(["show", fault_id]) == 0
    out = capsys.readouterr().out
    assert fault_id in out and "\n--- a/model/" in out and "\n+++ b/model/" in out


def test_unknown_fault_id_suggests_the_closest(capsys):
    assert main(["show", "label_shift_of_by_one"]) == 2
    assert "did you mean 'label_shift_off_by_one'" in capsys.readouterr().err


def test_run_reports_against_clean_and_plots(tmp_path, capsys):
    png = tmp_path / "panel.png"
    assert main(["run", "--fault", "label_shift_off_by_one", "--steps", "30", "--json", "--plot", str(png)]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["crash"] is None
    assert report["final_loss"] < report["clean_final_loss"] - 0.5  # copying is easier than predicting
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plugin_fault_is_listed_run_and_proven_like_any_other(tmp_path):
    plugin = tmp_path / "my_faults.py"
    plugin.write_text(PLUGIN)
    listed = json.loads(_cli("faults", "--json", "--plugin", str(plugin)).stdout)
    assert "plugin_lr_times_100" in {f["id"] for f in listed}
    report = json.loads(_cli("run", "--plugin", str(plugin), "--fault", "plugin_lr_times_100", "--steps", "40",
                             "--json").stdout.strip().splitlines()[-1])
    assert report["final_loss"] > report["clean_final_loss"] + 0.5
    # proven like any other: test_pytest_fault_plugin_parametrizes_the_proofs_over_the_plugin_faults runs its proof


THROWAWAY_TEST = """
import math

import torch

from faultbench.model.loss import lm_loss


def test_uniform_logits_cost_log_vocab_per_target():
    logits, labels = torch.zeros(2, 5, 8), torch.randint(0, 8, (2, 5))
    assert math.isclose(float(lm_loss(logits, labels)), math.log(8), rel_tol=1e-5)
"""


def test_any_project_that_installs_faultbench_gets_the_fault_options(tmp_path):
    """A project of its own (no faultbench conftest, no addopts): the pytest11 entry point brings --inject-fault;
    its test of the reference's loss passes clean, fails with the loss summed instead of averaged, and an unknown id
    stops the session in one line with the closest one."""
    (tmp_path / "test_mine.py").write_text(THROWAWAY_TEST)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "test_mine.py"]
    clean = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    faulty = subprocess.run([*args, "--inject-fault", "loss_sum_reduction"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert faulty.returncode == 1 and "1 failed" in faulty.stdout
    unknown = subprocess.run([*args, "--inject-fault", "loss_sum"], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=300)
    assert unknown.returncode == 4 and "did you mean" in unknown.stderr and "'loss_sum_reduction'" in unknown.stderr


@pytest.mark.parametrize("argv", [["run", "--fault", "nope_not_a_fault", "--steps", "2"]])
def test_run_with_unknown_fault_is_a_clear_error(argv, capsys):
    assert main(argv) == 2
    assert "unknown fault id" in capsys.readouterr().err


def test_inject_fault_reaches_the_rank_workers():
    # the DDP test fails when the ranks' gradient sync is broken in the pool workers (it passes clean: the suite
    # itself runs it)
    args = [sys.executable, "-m", "pytest", "tests/distributed/test_ddp.py", "-q", "-p", "no:cacheprovider",
            "-k", "accum"]
    faulty = subprocess.run([*args, "--inject-fault", "no_sync_on_last_micro_batch"], capture_output=True,
                            text=True, cwd=ROOT, timeout=300)
    assert faulty.returncode == 1 and "failed" in faulty.stdout


def test_pytest_fault_plugin_parametrizes_the_proofs_over_the_plugin_faults(tmp_path):
    plugin = tmp_path / "my_faults.py"
    plugin.write_text(PLUGIN)
    args = [sys.executable, "-m", "pytest", "tests/faults/test_manifest.py", "-q", "-p", "no:cacheprovider",
            "--fault-plugin", str(plugin)]
    proof = subprocess.run([*args, "-k", "plugin_lr_times_100"], capture_output=True, text=True, cwd=ROOT,
                           timeout=300)
    # the plugin's proof ran and passed, and every builtin fault was still collected (deselected by -k)
    builtin = {m for modules in BUILTIN_MODULES.values() for m in modules}
    builtins = sum(all(fn.__module__ in builtin for fn in f.replacements.values()) for f in all_faults(None).values())
    assert proof.returncode == 0 and f"1 passed, {builtins} deselected" in proof.stdout, proof.stdout[-2000:]
    broken = tmp_path / "broken.py"
    broken.write_text("def f(:\n")
    refused = subprocess.run([*args[:-1], str(broken), "--collect-only"], capture_output=True, text=True, cwd=ROOT,
                             timeout=300)
    assert refused.returncode == 4 and f"{broken}:1: " in refused.stderr and "Traceback" not in refused.stderr


def test_seams_and_faults_of_the_hf_target(capsys):
    assert main(["seams", "--target", "hf", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == list(targets.get("hf").seams())
    assert all(r["file"].startswith(("transformers/", "accelerate/", "targets/hf/")) and r["line"] > 0 for r in rows)
    assert main(["faults", "--target", "hf", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {f["id"] for f in listed} == set(all_faults("hf")) and {f["target"] for f in listed} == {"hf"}
    assert main(["faults", "--target", "all", "--json"]) == 0
    assert {f["id"] for f in json.loads(capsys.readouterr().out)} == set(all_faults(None))


def test_show_diffs_an_hf_fault_against_the_installed_transformers(capsys):
    assert main(["show", "hf_label_shift_off_by_one"]) == 0
    out = capsys.readouterr().out
    assert "target           hf" in out and "\n--- a/transformers/" in out and "\n+++ b/transformers/" in out


def test_run_an_hf_fault_against_the_clean_hf_run(capsys):
    assert main(["run", "--fault", "hf_label_shift_off_by_one", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["target"] == "hf" and report["scenario"] == "train" and report["crash"] is None
    assert report["val_loss"] < report["clean_val_loss"] - 0.3  # the manifest's symptom: copying the input is easy


@pytest.mark.parametrize("argv, refusal", [
    (["seams", "--target", "hff"], "unknown target 'hff'; did you mean 'hf'?"),
    (["faults", "--target", "reff"], "unknown target 'reff'; did you mean 'ref'?"),
    (["bench", "--target", "hg"], "unknown target 'hg'; did you mean 'hf'?"),
])
def test_an_unknown_target_is_a_one_line_refusal(argv, refusal, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and refusal in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv, refusal", [
    (["bench", "--target", "ref", "--fault", "hf_label_shift_off_by_one"], "is not a fault of --target ref"),
    (["run", "--fault", "hf_label_shift_off_by_one", "--precision", "bf16"], "--precision configure the reference"),
    (["run", "--fault", "hf_label_shift_off_by_one", "--fault", "label_permute"], "belong to different targets"),
])
def test_a_fault_outside_its_target_is_a_one_line_refusal(argv, refusal, capsys, tmp_path):
    assert main([*argv, *(["--out", str(tmp_path)] if argv[0] == "bench" else [])]) == 2
    err = capsys.readouterr().err
    assert refusal in err and len(err.strip().splitlines()) == 1
