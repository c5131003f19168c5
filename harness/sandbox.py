"""Running a candidate's code with none of the grader's rights: what ``practice check`` executes of a folder.

A check runs code the candidate wrote (their ``train.py``, their ``model/``). Run as a child of the grader it could
read the answer keys, the grader's command line and environment, rewrite the session's event log, poison the
caches the grade is computed from, or leave a process behind that changes them later. Here it runs:

- in a fresh interpreter (never a fork of the grader: nothing of the grader's memory), with a scrubbed
  environment (no ``FAULTBENCH_*``, ``HOME`` and ``TMPDIR`` a private folder), stdin from ``/dev/null``;
- on Linux, in new user, mount and PID namespaces (``unshare``, no privileges needed): the grader's processes are
  not in its ``/proc``, the answer keys' folders are covered by empty tmpfs, every other mount is read-only but the
  exercise folder and the private folder, and a nested namespace locks those mounts (``harness/jail.py``); its
  instructions travel on stdin, never on a command line;
- in its own session, killed with everything it started when it exits or times out (in the namespace the kernel
  does it: the program is PID 1 there).

Where namespaces are not available (macOS, a container that forbids them), only the first and last hold; the result
says so (``isolated``) and ``practice check`` prints it.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

JAIL = Path(__file__).with_name("jail.py")
NAMESPACES = ("unshare", "--user", "--map-root-user", "--mount", "--pid", "--fork", "--mount-proc", "--kill-child")
JAIL_FAILED = 125  # jail.py's exit code when it could not shape the sandbox


@dataclass(frozen=True)
class Sandboxed:
    """What a sandboxed program left: its stdout and stderr interleaved, its exit code (None: killed at the
    timeout), and whether it ran isolated (namespaces) or only in a fresh interpreter with a scrubbed env."""

    output: str
    code: int | None
    isolated: bool


def scrubbed_env(private: str, pythonpath: str | None) -> dict[str, str]:
    """The whole environment a sandboxed program gets: a path to find programs, a locale, a private home."""
    env = {"PATH": os.environ.get("PATH", os.defpath), "HOME": private, "TMPDIR": private,
           "LANG": os.environ.get("LANG", "C.UTF-8"), "TOKENIZERS_PARALLELISM": "false", "PYTHONDONTWRITEBYTECODE": "1"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return env


def _launch(argv: list[str], cwd: Path, hidden: list[Path], pythonpath: str | None, timeout_s: float,
            isolate: bool, program: list[str] | None = None, passed: dict[str, str] | None = None) -> Sandboxed:
    with tempfile.TemporaryDirectory(prefix="faultbench-sandbox-") as private, tempfile.TemporaryFile() as out:
        env = {**scrubbed_env(private, pythonpath), **(passed or {})}
        program = program or [sys.executable, "-s", *argv]
        if isolate:
            spec = {"hidden": [str(p) for p in hidden if p.exists()], "writable": [str(cwd), private],
                    "cwd": str(cwd), "argv": program, "env": env}
            command, stdin = [*NAMESPACES, sys.executable, "-I", str(JAIL)], json.dumps(spec).encode()
        else:
            command, stdin = program, None
        proc = subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        if stdin:
            proc.stdin.write(stdin)
            proc.stdin.close()
        try:
            code = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        finally:  # whatever it started in its session goes with it (in the namespace the kernel already did)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        out.seek(0)
        output = out.read().decode(errors="replace")
    if isolate and code == JAIL_FAILED and output.startswith("faultbench-jail:"):
        raise RuntimeError(f"the grading sandbox could not be built: {output.strip()}")
    return Sandboxed(output, code, isolate)


@functools.cache
def unavailable() -> str | None:
    """None when this machine can build the namespaces sandbox, else why not (one line)."""
    if sys.platform != "linux":
        return f"namespaces are Linux's ({sys.platform} here)"
    try:
        probe = _launch(["-c", "pass"], Path(tempfile.gettempdir()), [], None, 30, isolate=True)
    except (OSError, RuntimeError) as exc:
        return str(exc).splitlines()[0]
    return None if probe.code == 0 else f"unshare failed: {probe.output.strip()[:200]}"


def run_sandboxed(argv: list[str], cwd, hidden=(), pythonpath: str | None = None,
                  timeout_s: float = 600.0) -> Sandboxed:
    """``python -s argv`` in ``cwd`` (the only folder it may write, with a private temporary one), ``hidden``
    folders out of its sight, ``pythonpath`` its only ``PYTHONPATH``; isolated where ``unavailable()`` is None.
    ValueError when ``cwd`` lies inside a hidden folder (hiding the keys would hide the program)."""
    cwd, hidden = _folders(cwd, hidden)
    return _launch(argv, cwd, hidden, pythonpath, timeout_s, isolate=unavailable() is None)


def _folders(cwd, hidden) -> tuple[Path, list[Path]]:
    cwd = Path(cwd).resolve()
    hidden = [Path(h).resolve() for h in hidden]
    for folder in hidden:
        if cwd == folder or folder in cwd.parents:
            raise ValueError(f"{cwd} lies inside {folder}, which the sandbox hides (the answer keys): keep "
                             "exercises and keys in separate folders")
    return cwd, hidden


def run_command_sandboxed(command: str, cwd, hidden=(), timeout_s: float = 600.0,
                          passed: dict[str, str] | None = None) -> Sandboxed:
    """A shell ``command`` (an agent's) as ``run_sandboxed`` runs Python, with ``passed`` added to its scrubbed
    environment (what the agent needs, e.g. its API key; never the grader's)."""
    cwd, hidden = _folders(cwd, hidden)
    return _launch([], cwd, hidden, None, timeout_s, isolate=unavailable() is None, program=["/bin/sh", "-c", command],
                   passed=passed)
