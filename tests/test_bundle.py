"""Repro bundles: written when a detector fires, checked by their manifest, replayed to the same finding."""

import json

import pytest
import torch

from faultbench.harness.bundle import FILES, _sha256, replay, verify
from faultbench.harness.case import run_target_case
from faultbench.harness.cli import main
from faultbench.harness.detect import detect
from faultbench.harness.record import Case


def _bundle(tmp_path, fault_id: str):
    record = detect((fault_id,), 0, ("suite",), bundle=tmp_path / "bundle", command=["test"])
    return record, tmp_path / "bundle"


def _reseal(bundle) -> None:
    """Rewrite the manifest, as a bundle written by other code would have it."""
    (bundle / "MANIFEST.sha256").write_text("".join(f"{_sha256(bundle / n)}  {n}\n" for n in FILES
                                                    if (bundle / n).exists()))


def test_capture_does_not_change_the_run(tmp_path):
    from faultbench.detectors.api import suite_ids
    from faultbench.harness.golden import load_golden

    case = Case("resume", 0, (), tuple(suite_ids()))
    golden = load_golden(["resume"])["resume"]
    plain, captured = run_target_case(case, golden), run_target_case(case, golden, capture_dir=str(tmp_path))
    assert plain["crash"] is None
    assert [h["loss"] for h in captured["history"]] == [h["loss"] for h in plain["history"]]
    assert captured["val_loss"] == plain["val_loss"] and captured["findings"] == plain["findings"] == []
    index = [json.loads(line) for line in (tmp_path / "rank0" / "index.jsonl").read_text().splitlines()]
    # steps 0..7, the resumed run's 8..15, and the end of training
    assert [c["step"] for c in index] == [*range(8), *range(8, 16), 16]


@pytest.mark.parametrize("fault_id, state_step", [
    ("loss_history_keeps_graph", 1),  # found at step 1 (its record keeps the graph): the state before step 1
    ("step_off_by_one_on_resume", 9),  # found at the resume (step 8): the state just loaded, its counter at 9
    ("sampler_ignores_rank", 0),  # two ranks
])
def test_a_replayed_bundle_gives_the_same_finding(tmp_path, fault_id, state_step, capsys):
    record, bundle = _bundle(tmp_path, fault_id)
    assert record["bundle"] == str(bundle)
    meta = verify(bundle)
    top = json.loads((bundle / "finding.json").read_text())["finding"]
    assert top == record["findings"][0] and meta["case"]["faults"] == [fault_id]
    assert len((bundle / "metrics.jsonl").read_text().splitlines()) == len(record["history"])
    state = torch.load(bundle / "checkpoint.pt", weights_only=True)
    assert state["step"] == meta["step"] == state_step and "model" in state and "rng" in state
    assert (bundle / "batch.pt").exists()  # every one of these is found before or at a step that drew a batch

    result = replay(bundle)
    assert result["reproduced"], result["differences"]
    assert result["state_identical"] and result["batch_identical"] and result["same_code"]
    assert main(["replay", str(bundle)]) == 0 and "reproduced: the same finding came back" in capsys.readouterr().out


def test_a_modified_or_incomplete_bundle_is_refused(tmp_path):
    _, bundle = _bundle(tmp_path, "label_permute")
    batch = torch.load(bundle / "batch.pt", weights_only=True)
    batch[0]["input_ids"][0, 0] += 1
    torch.save(batch, bundle / "batch.pt")
    with pytest.raises(ValueError, match="batch.pt does not match its sha256"):
        replay(bundle)
    (bundle / "batch.pt").unlink()
    with pytest.raises(ValueError, match="batch.pt is missing"):
        verify(bundle)
    assert main(["replay", str(tmp_path)]) == 2  # not a bundle: a clear error, no traceback


def test_replay_says_what_differs(tmp_path, capsys):
    _, bundle = _bundle(tmp_path, "label_permute")
    state = torch.load(bundle / "checkpoint.pt", weights_only=True)
    name = next(iter(state["model"]))
    state["model"][name] = state["model"][name] + 1e-3
    torch.save(state, bundle / "checkpoint.pt")
    finding = json.loads((bundle / "finding.json").read_text())
    finding["finding"]["seam"] = "model.data.collate"
    (bundle / "finding.json").write_text(json.dumps(finding))
    _reseal(bundle)
    result = replay(bundle)
    assert not result["reproduced"] and not result["state_identical"] and result["batch_identical"]
    assert any("did not come back" in d for d in result["differences"])
    assert main(["replay", str(bundle)]) == 1 and "NOT reproduced" in capsys.readouterr().out


def test_bench_bundles_every_flagged_case(tmp_path):
    from faultbench.harness.bench import BenchConfig, run_bench

    cfg = BenchConfig(seeds=(0,), detectors=("suite",), faults=("label_permute",), clean=False, jobs=1,
                      out=tmp_path / "out", progress=False, bundles=tmp_path / "bundles", command=("faultbench",))
    summary = run_bench(cfg)
    assert summary["targets"]["ref"]["suite"]["detection_rate"] == 1.0
    (bundle,) = (tmp_path / "bundles").iterdir()
    assert bundle.name == "label_permute-fp32-s0" and verify(bundle)["command"] == "faultbench"
    assert replay(bundle)["reproduced"]


def _fake_bundle(directory, **case_changes):
    """The files of a bundle, without running a case: enough for ``verify`` and the CLI's refusals."""
    directory.mkdir()
    case = {"recipe": "fp32", "seed": 0, "faults": ["label_permute"], "detectors": ["loss_contract"], "plugins": [],
            **case_changes}
    meta = {"format": 1, "case": case, "seed": 0, "step": 0, "capture": 1, "rank": 0, "code_digest": "x"}
    (directory / "bundle.json").write_text(json.dumps(meta))
    finding = {"detector": "loss_contract", "step": 0, "subsystem": "loss", "seam": None, "message": "m"}
    (directory / "finding.json").write_text(json.dumps({"finding": finding}))
    for name in ("checkpoint.pt", "metrics.jsonl"):
        (directory / name).write_bytes(b"")
    _reseal(directory)
    return directory


@pytest.mark.parametrize("manifest, expect", [
    ("", "does not list bundle.json, finding.json, checkpoint.pt, metrics.jsonl"),  # emptied
    ("not a manifest line\n", "line 1 is not '<sha256>  <one of"),
    (f"{'0' * 64}  ../../etc/passwd\n", "line 1 is not"),  # a file outside the bundle
    (None, "does not list metrics.jsonl"),  # one line deleted
])
def test_an_edited_or_emptied_manifest_is_refused_in_one_line(tmp_path, capsys, manifest, expect):
    bundle = _fake_bundle(tmp_path / "bundle")
    assert verify(bundle)["case"]["recipe"] == "fp32"
    lines = (bundle / "MANIFEST.sha256").read_text().splitlines(keepends=True)
    (bundle / "MANIFEST.sha256").write_text("".join(lines[:-1]) if manifest is None else manifest)
    assert main(["replay", str(bundle)]) == 2
    err = capsys.readouterr().err
    assert expect in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("edit, expect", [
    (lambda b: (b / "bundle.json").write_text("{not json"), "bundle.json is not valid JSON"),
    (lambda b: (b / "bundle.json").write_text("{}"), "bundle.json lacks (or mistypes) case, seed, step"),
    (lambda b: (b / "finding.json").write_text('{"finding": {"step": 0}}'), "its finding lacks one of"),
])
def test_resealed_malformed_json_is_refused_in_one_line(tmp_path, capsys, edit, expect):
    bundle = _fake_bundle(tmp_path / "bundle")
    edit(bundle)
    _reseal(bundle)
    assert main(["replay", str(bundle)]) == 2
    err = capsys.readouterr().err
    assert expect in err and len(err.strip().splitlines()) == 1


def test_a_bundle_of_an_unknown_recipe_is_refused(tmp_path, capsys):
    assert main(["replay", str(_fake_bundle(tmp_path / "bundle", recipe="no_such_recipe"))]) == 2
    assert "recipe 'no_such_recipe' is not one of this checkout's" in capsys.readouterr().err


def test_a_resealed_unreadable_checkpoint_is_refused_before_the_run(tmp_path, capsys, monkeypatch):
    bundle = _fake_bundle(tmp_path / "bundle")  # its checkpoint.pt is empty: not a torch file
    monkeypatch.setattr("faultbench.harness.bundle.run_captured", lambda *a: pytest.fail("ran the case"))
    assert main(["replay", str(bundle)]) == 2
    err = capsys.readouterr().err
    assert "checkpoint.pt cannot be loaded" in err and len(err.strip().splitlines()) == 1


def test_a_tampered_bundle_that_names_a_plugin_runs_no_code(tmp_path, capsys, monkeypatch):
    """A plugin named in bundle.json (resealed, as anyone can) is imported only when the user passes it again."""
    marker = tmp_path / "ran"
    plugin = tmp_path / "evil.py"
    plugin.write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    bundle = _fake_bundle(tmp_path / "bundle", plugins=[str(plugin)])
    monkeypatch.setattr("faultbench.harness.bundle.run_captured", lambda *a: pytest.fail("ran the case"))
    assert main(["replay", str(bundle)]) == 2
    err = capsys.readouterr().err
    assert f"pass --plugin {plugin}" in err and len(err.strip().splitlines()) == 1
    assert not marker.exists()
