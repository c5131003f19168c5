"""The wheel as a user gets it: the watch needs torch and numpy only (issue 26).

Built once from this checkout (``pip wheel --no-deps``). Its metadata: the only unconditional requirements are torch
and numpy, the HF callback's and the bench's libraries sit in extras, the license is an SPDX expression with its
file, ``py.typed`` ships. Installed into a fresh venv (which borrows torch and numpy from this one's site-packages
by a path line, not this checkout) and run from an empty folder: the example loop watched, with neither
transformers, tokenizers nor matplotlib imported.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.xdist_group("wheel")  # one worker builds it once


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    left = not (ROOT / "build").exists()  # setuptools builds in the tree: what it leaves is removed after
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w",
                    str(out), str(ROOT)], check=True, capture_output=True, timeout=600)
    if left:
        shutil.rmtree(ROOT / "build", ignore_errors=True)
    return next(out.glob("faultbench-*.whl"))


def test_the_wheel_requires_torch_and_numpy_only(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = Parser().parsestr(z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode())
    requires = meta.get_all("Requires-Dist")
    unconditional = sorted(r.split(";")[0].strip() for r in requires if "extra ==" not in r)
    assert unconditional == ["numpy", "torch"], requires
    extras = {r.split("extra ==")[1].strip().strip("'\"") for r in requires if "extra ==" in r}
    assert {"hf", "bench", "dev"} <= extras
    assert any(r.startswith("transformers==5.23.0") and "bench" in r for r in requires)
    assert meta["License-Expression"] == "MIT" and "LICENSE" in meta.get_all("License-File")
    assert "faultbench/py.typed" in names and any(n.endswith(".dist-info/licenses/LICENSE") for n in names)


def fresh_install(wheel: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A new venv with the wheel installed: its python and site-packages. It borrows this environment's
    libraries (torch, numpy, tokenizers, ...) as a plain path line, whose .pth files (this checkout's editable
    finder) are not read."""
    fresh = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(fresh)
    python = fresh / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--target",
                    str(site), str(wheel)], check=True, capture_output=True, timeout=300)
    return python, site


def test_installed_in_a_fresh_venv_the_watch_runs_from_an_empty_folder(wheel, tmp_path):
    python, site = fresh_install(wheel, tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    script = empty / "loop.py"
    script.write_text((ROOT / "examples" / "own_loop.py").read_text() + (
        "\nimport sys\nprint('FROM', faultbench.__file__, faultbench.__version__)\n"
        "print('HEAVY', sorted(m for m in ('transformers', 'tokenizers', 'matplotlib') if m in sys.modules))\n"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "FAULTBENCH"))}
    ran = subprocess.run([python, str(script)], cwd=empty, env=env, capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stderr[-2000:]
    origin = next(line for line in ran.stdout.splitlines() if line.startswith("FROM")).split()
    assert Path(origin[1]).is_relative_to(site) and origin[2] == "0.1.0"
    assert "HEAVY []" in ran.stdout and "findings" in ran.stdout
    assert not list(site.glob("faultbench/.cache")) and not list(empty.glob(".cache"))


def test_installed_practice_keeps_its_caches_and_keys_in_the_users_cache_folder(wheel, tmp_path):
    """`practice new` from the wheel: the exercise where asked, the answer key, the healthy run and the tokenizer in
    $XDG_CACHE_HOME/faultbench; nothing written into the installed package."""
    python, site = fresh_install(wheel, tmp_path)
    before = package_files(site)
    work, xdg = tmp_path / "work", tmp_path / "xdg"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "FAULTBENCH", "TOKENIZER"))}
    env.update(XDG_CACHE_HOME=str(xdg), HOME=str(tmp_path))
    made = subprocess.run([python, "-m", "faultbench", "practice", "new", "--dir", "ex", "--fault",
                           "ignore_index_mismatch"], cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert made.returncode == 0, made.stderr[-2000:]
    assert (work / "ex" / "README.md").is_file() and f"stays in {xdg / 'faultbench' / 'practice'}" in made.stdout
    cached = {p.name for p in (xdg / "faultbench").iterdir()}
    assert {"practice", "practice-reference", "tokenizers"} <= cached, cached
    assert package_files(site) == before


def package_files(site: Path) -> set[Path]:
    return {p.relative_to(site) for p in (site / "faultbench").rglob("*") if "__pycache__" not in p.parts}
