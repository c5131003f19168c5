"""`faultbench golden record RUN.json ... --out golden.json`: a golden from watches saved with ``out=`` (a script-style
loop records its known-good runs without handing Watch objects around), the same envelope record_golden makes of
the watches themselves; a crashed, truncated or foreign file is refused in one line naming it, nothing written."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

import faultbench
from faultbench.harness.cli import main
from tests.watch.nanogpt import TrainConfig, build, get_batch


def saved_run(path, seed: int, steps: int = 6, crash: bool = False) -> faultbench.Watch:
    torch.manual_seed(seed)
    model, optimizer, _ = build(TrainConfig())
    w = faultbench.watch(model, optimizer, report=False, out=path)
    with pytest.raises(KeyError) if crash else contextlib.nullcontext(), w:
        for step in range(steps):
            x, y = get_batch("train", 4, 16)
            _, loss = model(x, targets=y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if crash and step == 2:
                raise KeyError("the loop's own error")
    return w


def test_the_golden_of_saved_runs_is_the_golden_of_their_watches(tmp_path, capsys):
    watches = [saved_run(tmp_path / f"run{s}.json", s) for s in (0, 1)]
    argv = ["golden", "record", str(tmp_path / "run0.json"), str(tmp_path / "run1.json"), "--out",
            str(tmp_path / "golden.json")]
    assert main(argv) == 0
    assert "the envelope of 2 known-good runs over 6 steps" in capsys.readouterr().out
    golden = json.loads((tmp_path / "golden.json").read_text())
    assert golden == json.loads(json.dumps(faultbench.record_golden(watches)))
    assert golden["runs"] == 2 and len(golden["steps"]) == 6
    assert main(argv) == 2 and "exists: pass --force" in capsys.readouterr().err
    assert main([*argv, "--force"]) == 0


@pytest.mark.parametrize(("edit", "says"), [
    ("crashed", "is a run that crashed"),
    ("truncated", "kept the last 6 of its 2000 step records"),
    ("no history", "holds no step history"),
    ("record", "holds a step record StepRecord cannot read"),
    ("not json", "Expecting property name"),
])
def test_a_run_that_is_no_known_good_one_is_refused_naming_its_file(tmp_path, capsys, edit, says):
    good = tmp_path / "good.json"
    saved_run(good, 0)
    bad = tmp_path / "bad.json"
    if edit == "crashed":
        saved_run(bad, 1, crash=True)
    else:
        data = json.loads(good.read_text())
        data = {"truncated": {**data, "recorded": 2000},
                "no history": {k: v for k, v in data.items() if k != "history"},
                "record": {**data, "history": [{"loss": 1.0}], "recorded": 1}, "not json": None}[edit]
        bad.write_text("{" if data is None else json.dumps(data))
    assert main(["golden", "record", str(good), str(bad), "--out", str(tmp_path / "g.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"faultbench: error: {bad}: ") and says in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "g.json").exists()
