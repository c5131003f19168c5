"""The mutant set's and the contract catalogue's commands: `faultbench mutate` prints each operator's admission,
`mutate --admit` never replaces a set without --force, `contracts --json` is the catalogue."""

import json

from faultbench.detectors.contracts import CONTRACTS
from faultbench.faults.mutants import admitted_path
from faultbench.harness import mutants
from faultbench.harness.cli import main
from tests.test_bad_input_cli import _one_line_error


def test_mutate_prints_every_operators_stages_and_admit_rate(capsys):
    assert main(["mutate", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    doc = mutants.read()
    assert {(r["target"], r["operator"]) for r in rows} == {
        (t, op) for t, d in doc["targets"].items() for op in d["operators"]}
    assert sum(r["admitted"] for r in rows) == len(doc["mutants"])
    assert all(r["admit_rate"] == round(r["admitted"] / r["run"], 3) for r in rows if r["run"])
    assert main(["mutate", "--target", "ref"]) == 0
    text = capsys.readouterr().out
    assert "| ref | off_by_one |" in text and "| hf |" not in text


def test_mutate_admit_never_replaces_a_set_without_force(capsys, tmp_path):
    before = admitted_path().read_bytes()
    _one_line_error(capsys, ["mutate", "--admit"], "pass --force")
    _one_line_error(capsys, ["mutate", "--admit", "--out", str(tmp_path / "missing" / "set.json")],
                    "does not exist")
    _one_line_error(capsys, ["mutate", "--out", str(tmp_path / "none.json")], "cannot read the mutant set")
    assert admitted_path().read_bytes() == before


def test_contracts_json_is_the_catalogue(capsys):
    assert main(["contracts", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [c["id"] for c in listed] == [c.id for c in CONTRACTS]
    assert {"id", "component", "kind", "statement", "source", "tracks", "detectors"} <= set(listed[0])
