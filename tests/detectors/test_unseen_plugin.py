"""The unseen plugin faults (examples/unseen_faults.py) are real: each shows next to the clean run."""

import ast
from pathlib import Path

import pytest

from faultbench.faults.registry import FAULTS, all_faults, load_plugin
from faultbench.harness.manifest import prove

PLUGIN = Path(__file__).resolve().parents[2] / "examples" / "unseen_faults.py"
# the ids, read without importing the plugin (importing at collection would add its faults to every
# other test's parametrization)
UNSEEN = [d.args[0].value for node in ast.walk(ast.parse(PLUGIN.read_text())) if isinstance(node, ast.FunctionDef)
          for d in node.decorator_list if isinstance(d, ast.Call) and getattr(d.func, "id", "") == "fault"]


@pytest.fixture
def plugin_loaded():
    all_faults()
    before = set(FAULTS)
    load_plugin(str(PLUGIN))
    yield
    for fault_id in set(FAULTS) - before:
        FAULTS.pop(fault_id)
    import sys

    from faultbench.faults.registry import plugin_module_name

    sys.modules.pop(plugin_module_name(str(PLUGIN)), None)


def test_the_plugin_registers_its_faults(plugin_loaded):
    assert len(UNSEEN) >= 6 and set(UNSEEN) <= set(FAULTS)


@pytest.mark.parametrize("fault_id", UNSEEN)
def test_unseen_fault_manifests(fault_id, plugin_loaded):
    ok, evidence = prove(fault_id, plugins=(str(PLUGIN),))
    assert ok, evidence
