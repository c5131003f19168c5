"""The seam table is the localization vocabulary: every entry must resolve and be well-formed."""

import inspect
import pathlib
import re

import pytest

from faultbench.model.seams import SEAMS, SUBSYSTEMS, live_module, resolve, seams

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", sorted(SEAMS))
def test_seam_resolves_to_a_reference_function(name):
    fn = inspect.unwrap(resolve(name))
    assert inspect.isfunction(fn), f"{name} is not a plain function or method"
    assert fn.__module__ == live_module(name.rsplit(".", 2 if fn.__qualname__.count(".") else 1)[0])
    assert name.endswith(fn.__qualname__)


def test_every_seam_has_a_known_subsystem():
    assert set(SEAMS.values()) <= set(SUBSYSTEMS)


def test_seams_report_their_definition_line():
    for seam in seams():
        source = (ROOT / seam.file).read_text().splitlines()
        short_name = seam.name.rsplit(".", 1)[-1]
        assert re.match(rf"\s*(@.*|def {re.escape(short_name)}\b.*)", source[seam.line - 1]), seam


def test_unknown_seam_is_a_clear_error():
    with pytest.raises(ValueError, match="does not name a function"):
        resolve("model.data.colate")


def test_reference_never_mentions_faults():
    # The reference must stand on its own: faults replace its seams from outside.
    offenders = [
        f"{path.relative_to(ROOT)}:{i}"
        for path in (ROOT / "model").rglob("*.py")
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\bfault|inject", line, re.IGNORECASE)
    ]
    assert offenders == []
