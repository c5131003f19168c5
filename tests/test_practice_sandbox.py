"""``practice check`` runs the candidate's code where it cannot reach the grader (harness/sandbox.py).

A hostile train.py tries each route a candidate found (issue 25): the grader's command line and environment
through /proc, its own environment, reading and writing the answer key (the event log), a new key beside it,
poisoning the cache the grade is computed from, unmounting what hides the keys, and a process that outlives the
check. Each attempt's result is written into the exercise folder (the one place it may write). The same script run
without the sandbox, on a decoy key, gets through: the probes can see a breach.
"""

import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from faultbench.harness import practice, sandbox

HOSTILE = r'''
import ctypes, fcntl, json, os, signal, sys, time
KEYS, KEY, CACHE = {keys!r}, {key!r}, {cache!r}
attempts = {{}}

def attempt(name, action):
    try:
        attempts[name] = "got " + repr(action())[:120]
    except Exception as exc:
        attempts[name] = "refused " + type(exc).__name__

def grader_in_proc():
    for pid in (p for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()):
        for name in ("cmdline", "environ"):
            try:
                text = open(f"/proc/{{pid}}/{{name}}", "rb").read()
            except OSError:
                continue
            if KEYS.encode() in text or b"FAULTBENCH_PRACTICE_KEYS" in text or b"pytest" in text:
                return pid, name
    raise LookupError("no process of the grader in sight")

def own_environment():
    leaks = [k for k, v in os.environ.items() if "FAULTBENCH" in k or KEYS in v]
    if leaks:
        return leaks
    raise LookupError("nothing of the grader in the environment")

def unmount():
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.umount2(KEYS.encode(), 2) != 0:
        raise PermissionError(os.strerror(ctypes.get_errno()))
    return os.listdir(KEYS)

attempt("grader in /proc", grader_in_proc)
attempt("parent's command line", lambda: open(f"/proc/{{os.getppid()}}/cmdline", "rb").read())
attempt("environment", own_environment)
attempt("read the key", lambda: open(KEY).read())
attempt("rewrite the key", lambda: open(KEY, "a").write(" "))
attempt("a key of its own", lambda: open(os.path.join(KEYS, "0000000000000000.json"), "w").write("{{}}"))
attempt("poison the cache", lambda: open(os.path.join(CACHE, "poisoned.json"), "w").write("{{}}"))
attempt("unmount the cover", unmount)

if os.fork() == 0:  # a process that means to outlive the check: its own session, a lock held until it dies
    os.setsid()
    lock = open("lingering.lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    open("lingering.ready", "w").write(str(os.getpid()))
    while True:
        signal.pause()
deadline = time.monotonic() + 10
while not os.path.exists("lingering.ready") and time.monotonic() < deadline:
    time.sleep(0.01)
json.dump(attempts, open("attempts.json", "w"), indent=1)
print("step    0  loss 5.0000")
'''


@pytest.fixture
def exercise(tmp_path, monkeypatch):
    """A splice-only exercise with a sealed key made by hand (no training), its healthy log stubbed."""
    if why := sandbox.unavailable():
        pytest.skip(f"no grading sandbox on this machine: {why}")
    folder = practice.build_folder(tmp_path / "ex", "label_permute")
    keys = tmp_path / "keys"
    practice.write_key(folder, keys, {"fault": "label_permute", "seed": None, "args": [], "difficulty": "medium"},
                       1000.0)
    monkeypatch.setattr(practice, "_healthy", lambda args: ("step    0  loss 5.0000\n", 0))
    monkeypatch.setenv("FAULTBENCH_PRACTICE_KEYS", str(keys))  # in the grader's environment, as a user may set it
    return folder, keys


def hostile(folder, keys, cache=practice.ROOT / ".cache" / "practice-reference") -> Path:
    """Write the hostile train.py, told where the keys folder, the exercise's key and the reference cache are;
    the key's path."""
    cache.mkdir(parents=True, exist_ok=True)
    key = practice.load_key(folder, keys)[1]
    (folder / "train.py").write_text(HOSTILE.format(keys=str(keys), key=str(key), cache=str(cache)))
    return key


def lock_is_free(path) -> bool:
    with open(path) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True


def test_a_hostile_train_py_gets_nothing_out_of_check(exercise):
    folder, keys = exercise
    path = hostile(folder, keys)
    key_before = path.read_text()

    result = practice.check(folder, keys, clock=lambda: 2000.0, strict=False)

    attempts = json.loads((folder / "attempts.json").read_text())
    assert len(attempts) == 8 and all(v.startswith("refused") for v in attempts.values()), attempts
    assert result["isolated"] and result["code"] == 0, result
    key = json.loads(path.read_text())
    assert [e["kind"] for e in key["events"]] == ["check"] and not key.get("altered")  # only the grader wrote it
    assert key["fault"] == json.loads(key_before)["fault"]
    assert sorted(p.name for p in keys.iterdir()) == sorted([".secret", path.name, path.with_suffix(".handed").name])
    assert not (practice.ROOT / ".cache" / "practice-reference" / "poisoned.json").exists()
    assert (folder / "lingering.ready").exists() and lock_is_free(folder / "lingering.lock")  # it died with the run


def test_without_the_sandbox_the_same_script_gets_through(exercise, tmp_path):
    """The control: run as a plain child of the grader, on a decoy copy of the keys and cache, the probes see the
    breach."""
    folder, keys = exercise
    decoy = tmp_path / "decoy"
    shutil.copytree(keys, decoy)
    hostile(folder, decoy, tmp_path / "cache")
    env = {**os.environ, "FAULTBENCH_PRACTICE_KEYS": str(decoy)}
    subprocess.run([sys.executable, "train.py"], cwd=folder, env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, timeout=60)
    attempts = json.loads((folder / "attempts.json").read_text())
    try:
        for route in ("grader in /proc", "environment", "read the key", "rewrite the key", "a key of its own",
                      "poison the cache"):
            assert attempts[route].startswith("got"), (route, attempts)
        assert not lock_is_free(folder / "lingering.lock")  # the lingering process is still there
    finally:
        os.kill(int((folder / "lingering.ready").read_text()), 9)


def test_where_namespaces_are_missing_the_check_says_so(tmp_path, monkeypatch):
    """Without namespaces the program still gets a fresh interpreter, a scrubbed environment and its own session;
    the result says it was not isolated."""
    monkeypatch.setattr(sandbox, "unavailable", lambda: "forced by the test")
    monkeypatch.setenv("FAULTBENCH_PRACTICE_KEYS", str(tmp_path))
    ran = sandbox.run_sandboxed(["-c", "import os; print(sorted(os.environ))"], tmp_path)
    assert not ran.isolated and ran.code == 0
    assert "FAULTBENCH_PRACTICE_KEYS" not in ran.output and "'HOME'" in ran.output


def test_an_exercise_inside_the_keys_folder_is_refused(tmp_path):
    with pytest.raises(ValueError, match="which the sandbox hides"):
        sandbox.run_sandboxed(["-c", "pass"], tmp_path / "keys" / "ex", hidden=[tmp_path / "keys"])
