"""The contract catalogue (detectors/contracts.py, detectors/CONTRACTS.md): its shape, its honesty about which
detector checks what, its coverage arithmetic, and the generated document that must not go stale."""

import json
import re
import subprocess
import sys
from pathlib import Path

from faultbench.detectors import contracts as C
from faultbench.detectors.api import all_detectors
from faultbench.faults.registry import all_faults

ROOT = Path(__file__).resolve().parents[2]
DOCUMENT = ROOT / "detectors" / "CONTRACTS.md"

ROWS = ("corpus/tokenizer", "sampler/loader", "collate", "embeddings and positions", "attention and masks",
        "normalization/residual/MLP blocks", "head and tying", "loss", "optimizer and its groups", "LR schedule",
        "gradient path", "checkpoint and resume", "ranks (DDP/ZeRO)", "evaluation", "generation and the KV cache")
COLUMNS = ("invariance", "accounting", "declared = executed", "state", "numerics", "isolation")


def _builtin() -> dict:
    """The built-in detectors (a plugin another test loaded registers too, but is not the suite's)."""
    return {d: cls for d, cls in all_detectors().items() if cls.__module__.startswith("faultbench.detectors.")}


def _contract(cid, detectors=(), uncheckable="", tracks=("white-box",)):
    component, kind = cid.split(".")[:2]
    return C.Contract(cid, C.COMPONENT_KEYS[component], C.KIND_KEYS[kind], "a statement", "a source",
                      () if uncheckable else tracks, tuple(detectors), uncheckable)


# ---------------------------------------------------------------------------------------------- the grid
def test_the_grid_has_the_rows_and_columns_of_the_issue_each_described():
    assert C.COMPONENT_NAMES == ROWS and C.KIND_NAMES == COLUMNS
    assert all(text.strip() for _, text in C.COMPONENTS + C.KINDS)
    assert sorted(C.COMPONENT_KEYS.values()) == sorted(ROWS) and sorted(C.KIND_KEYS.values()) == sorted(COLUMNS)


def test_there_are_at_least_80_contracts_with_unique_well_formed_ids():
    ids = [c.id for c in C.CONTRACTS]
    assert len(ids) >= 80
    assert len(set(ids)) == len(ids), sorted({i for i in ids if ids.count(i) > 1})
    assert C.CONTRACTS_BY_ID == {c.id: c for c in C.CONTRACTS}
    for c in C.CONTRACTS:
        component, kind, slug = c.id.split(".")
        assert C.COMPONENT_KEYS[component] == c.component and C.KIND_KEYS[kind] == c.kind, c.id
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", slug), c.id


def test_every_cell_holds_a_contract_or_an_argument_why_it_is_empty():
    missing, both = [], []
    for component in ROWS:
        for kind in COLUMNS:
            held = [c for c in C.CONTRACTS if c.component == component and c.kind == kind]
            argued = C.EMPTY_CELLS.get((component, kind), "").strip()
            if not held and not argued:
                missing.append((component, kind))
            if held and (component, kind) in C.EMPTY_CELLS:
                both.append((component, kind))
    assert not missing, f"cells with no contract and no argument: {missing}"
    assert not both, f"cells argued empty that hold contracts: {both}"
    assert set(C.EMPTY_CELLS) <= {(r, k) for r in ROWS for k in COLUMNS}
    assert C.coverage()["cells"]["missing"] == []


def test_each_contract_is_one_line_with_a_source():
    for c in C.CONTRACTS:
        assert c.statement.strip() and "\n" not in c.statement and len(c.statement) <= 200, c.id
        assert c.source.strip() and "\n" not in c.source, c.id


def test_tracks_are_valid_and_a_contract_no_track_can_check_says_why():
    for c in C.CONTRACTS:
        assert set(c.tracks) <= set(C.TRACKS) and len(set(c.tracks)) == len(c.tracks), c.id
        assert bool(c.tracks) != bool(c.uncheckable.strip()), f"{c.id}: tracks and an uncheckable reason exclude " \
                                                                f"each other, and one of them is needed"
        assert not (c.uncheckable and c.detectors), f"{c.id}: a detector checks what no track can check?"


def test_contracts_are_not_named_after_registry_faults():
    faults = set(all_faults())
    for c in C.CONTRACTS:
        slug = c.id.split(".")[-1]
        assert slug.replace("-", "_") not in faults, c.id
        assert not [f for f in faults if re.search(rf"\b{re.escape(f)}\b", c.statement + " " + c.source)], c.id


# ------------------------------------------------------------------------------------------ the detectors
def test_every_named_detector_is_registered_outside_the_baselines_and_in_a_track_of_its_contract():
    registered = all_detectors()
    for c in C.CONTRACTS:
        assert len(set(c.detectors)) == len(c.detectors), c.id
        for d in c.detectors:
            assert d in registered, f"{c.id} names {d!r}, which is no registered detector"
            assert not registered[d].baseline, f"{c.id} names the baseline {d!r}"
            assert registered[d].track in c.tracks, f"{c.id}: {d} is {registered[d].track}, not in {c.tracks}"
    assert set(C.BASELINES) == {d for d, cls in _builtin().items() if cls.baseline}
    assert set(C.DETECTOR_CAVEATS) <= set(registered)


def _without_contract() -> list[str]:
    mapped = {d for c in C.CONTRACTS for d in c.detectors}
    return sorted(d for d, cls in _builtin().items() if not cls.baseline and d not in mapped)


def test_every_detector_implements_a_catalogue_contract():
    assert _without_contract() == []
    assert C.coverage()["detectors_without_contract"] == []


# ------------------------------------------------------------------------------------------- coverage
def test_a_contract_with_no_detector_and_no_reason_counts_as_uncovered():
    bare = _contract("loss.state.made-up-bare")
    checked = _contract("loss.state.made-up-checked", detectors=("loss_contract",))
    argued = _contract("loss.isolation.made-up-argued", uncheckable="no run shows it")
    black = _contract("loss.numerics.made-up-black", detectors=("bb_loss_normalization",),
                      tracks=("white-box", "black-box"))
    cov = C.coverage([bare, checked, argued, black])
    assert (cov["contracts"], cov["checked"], cov["uncovered"], cov["uncheckable"]) == (4, 2, 1, 1)
    assert cov["uncovered_ids"] == [bare.id] and cov["uncheckable_ids"] == [argued.id]
    assert cov["per_track"] == {"white-box": {"checkable": 3, "checked": 1},
                                "black-box": {"checkable": 1, "checked": 1}}
    assert cov["per_component"]["loss"] == {"contracts": 4, "checked": 2, "uncovered": 1, "uncheckable": 1}
    assert cov["per_kind"]["state"] == {"contracts": 2, "checked": 1, "uncovered": 1, "uncheckable": 0}
    assert cov["cells"]["with_contracts"] == 3 and cov["cells"]["with_a_detector"] == 2
    assert len(cov["cells"]["missing"]) == 90 - 3  # the other cells hold nothing and are argued nowhere


def test_the_catalogue_coverage_adds_up():
    cov = C.coverage()
    bare = [c.id for c in C.CONTRACTS if not c.detectors and not c.uncheckable]
    assert cov["uncovered_ids"] == bare and cov["uncovered"] == len(bare)
    assert cov["contracts"] == len(C.CONTRACTS) == cov["checked"] + cov["uncovered"] + cov["uncheckable"]
    assert sum(v["contracts"] for v in cov["per_component"].values()) == len(C.CONTRACTS)
    assert sum(v["checked"] for v in cov["per_kind"].values()) == cov["checked"]
    tracks = {d: cls.track for d, cls in all_detectors().items()}
    for t in C.TRACKS:
        assert cov["per_track"][t]["checked"] == sum(any(tracks[d] == t for d in c.detectors) for c in C.CONTRACTS)
        assert cov["per_track"][t]["checkable"] >= cov["per_track"][t]["checked"]


def test_as_json_has_exactly_the_promised_keys():
    rows = C.as_json()
    assert len(rows) == len(C.CONTRACTS)
    keys = {"id", "component", "kind", "statement", "source", "tracks", "detectors", "uncheckable"}
    assert all(set(r) == keys for r in rows)
    assert json.loads(json.dumps(rows)) == rows
    assert rows[0]["id"] == C.CONTRACTS[0].id and rows[0]["tracks"] == list(C.CONTRACTS[0].tracks)


# ------------------------------------------------------------------------------------------- the document
def test_contracts_md_is_the_output_of_markdown():
    assert DOCUMENT.read_text() == C.markdown(), (
        "detectors/CONTRACTS.md is stale: regenerate it with "
        "`.venv/bin/python -m faultbench.detectors.contracts > detectors/CONTRACTS.md`")


def test_the_module_prints_the_document():
    out = subprocess.run([sys.executable, "-m", "faultbench.detectors.contracts"], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    assert out == C.markdown()


def test_the_document_shows_each_contract_with_its_status():
    text = C.markdown()
    for c in C.CONTRACTS:
        (row,) = [line for line in text.splitlines() if f"`{c.id}`:" in line]
        assert row.startswith(f"| {c.kind} |"), c.id
        if c.detectors:
            assert all(f"`{d}`" in row.split("|")[-2] for d in c.detectors), c.id
        elif c.uncheckable:
            assert "cannot be checked:" in row, c.id
        else:
            assert "not checked yet" in row and f"`{c.id}`" in text.split("Not checked yet:")[1].split("\n")[0], c.id
    assert f"contracts: {len(C.CONTRACTS)};" in text


def test_an_empty_cell_is_shown_with_its_argument_or_as_missing(monkeypatch):
    only = [_contract("loss.state.made-up-bare")]
    monkeypatch.setitem(C.EMPTY_CELLS, ("loss", "numerics"), "an argued reason")
    text = C.markdown(only)
    loss = text.split("## loss\n")[1].split("\n## ")[0]
    assert "| numerics | (empty) | - | - | an argued reason |" in loss
    assert "| accounting | (empty) | - | - | no contract yet, and no argument why |" in loss
    assert "not checked yet" in loss
