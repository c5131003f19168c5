"""Installing faultbench shadows none of a user's modules (issue 14): everything lives under ``faultbench``.

A user's script next to its own ``model.py`` and ``harness.py`` gets those, and ours under the namespace;
the distribution installs no other top-level name, and pyproject lists every package of the checkout.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUR_FOLDERS = ("model", "harness", "detectors", "faults", "peers", "targets")

USER_SCRIPT = textwrap.dedent("""
    import importlib.util
    import sys

    import harness, model  # the user's own (one statement: faultbench's move script leaves it alone)

    import faultbench
    from faultbench.harness.cli import main
    from faultbench.model.gpt import GPT

    assert model.GPT.MARK == "user", model.__file__
    assert harness.WHO == "user", harness.__file__
    assert GPT is not model.GPT and GPT.__module__ == "faultbench.model.gpt"
    assert callable(main)
    hidden = [n for n in ("detectors", "faults", "targets", "peers") if importlib.util.find_spec(n) is not None]
    assert hidden == [], hidden
    print("ok", faultbench.__name__)
""")


def test_a_users_model_and_harness_are_not_shadowed(tmp_path):
    (tmp_path / "model.py").write_text("class GPT:\n    MARK = 'user'\n")
    (tmp_path / "harness.py").write_text("WHO = 'user'\n")
    (tmp_path / "script.py").write_text(USER_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # the script's folder (tmp_path) is first on the path; nothing puts the checkout on it
    proc = subprocess.run([sys.executable, "script.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["ok", "faultbench"]


def test_the_distribution_installs_only_the_faultbench_namespace():
    """setuptools writes the top-level names a distribution installs to top_level.txt (wheel or editable)."""
    dist = importlib.metadata.distribution("faultbench")
    assert dist.read_text("top_level.txt").split() == ["faultbench"]
    named = {(ep.group, ep.value) for ep in dist.entry_points if ep.name == "faultbench"}
    assert named == {("console_scripts", "faultbench.harness.cli:main"),  # the command
                     ("pytest11", "faultbench.harness.pytest_plugin")}  # --inject-fault in any project


def test_pyproject_lists_every_package_of_the_checkout():
    """A package the list misses would not be installed (setuptools installs only what it is told)."""
    block = re.search(r"^packages = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(), re.S | re.M)[1]
    listed = set(re.findall(r'"([\w.]+)"', block))
    on_disk = {".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "faultbench").rglob("__init__.py")}
    on_disk |= {"faultbench." + ".".join(init.parent.relative_to(ROOT).parts)
                for top in OUR_FOLDERS for init in (ROOT / top).rglob("__init__.py")}
    assert listed == on_disk


def test_python_dash_m_faultbench_is_the_command_line():
    proc = subprocess.run([sys.executable, "-m", "faultbench", "seams", "--json"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "model.data.collate" in proc.stdout  # seams keep their logical names
