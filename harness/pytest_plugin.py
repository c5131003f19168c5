"""pytest options ``--inject-fault ID`` and ``--fault-plugin PATH_OR_MODULE`` (both repeatable).

``--inject-fault`` runs the project's own tests against a broken target (the reference, or the HF stack for
an ``hf_*`` fault): the faults are injected for
the whole session in every process (xdist workers parse the same options), so a test suite's mutation
score is simply: which faults make it fail. ``--fault-plugin`` loads a plugin's faults before collection,
so the tests parametrized over the registry (``tests/faults/test_manifest.py``'s proofs,
``tests/faults/test_registry.py``) cover them too: ``pytest tests/faults/test_manifest.py --fault-plugin
my_faults.py -k my_fault`` proves a plugin fault. Loaded through faultbench's ``pytest11`` entry point in any
project that installs faultbench; without either option it imports nothing of faultbench (a user's suite pays
nothing for it).
"""

from __future__ import annotations

import contextlib
import os

import pytest

_stack = contextlib.ExitStack()


def pytest_addoption(parser):
    group = parser.getgroup("faultbench")
    group.addoption("--inject-fault", action="append", default=[], metavar="ID",
                    help="inject this fault into model/ for the whole session (repeatable)")
    group.addoption("--fault-plugin", action="append", default=[], metavar="PATH_OR_MODULE",
                    help="load faults from a plugin first (repeatable)")


def pytest_configure(config):
    """Load the ``--fault-plugin`` plugins before collection (so tests parametrized over the registry, the
    manifest proofs among them, cover their faults too), then inject the ``--inject-fault`` faults."""
    plugins = config.getoption("fault_plugin")
    ids = config.getoption("inject_fault")
    if not plugins and not ids:
        return
    from faultbench.faults.registry import FaultError, get_fault, load_plugin

    try:
        for plugin in plugins:
            load_plugin(plugin)
        stacks = {get_fault(fault_id).target for fault_id in ids}  # an HF fault loads the HF stack's faults
    except FaultError as e:  # a broken plugin or an unknown id stops the session in one line, not a traceback
        raise pytest.UsageError(str(e)) from None
    if not ids:
        return
    from faultbench import targets
    from faultbench.faults.inject import injected

    for stack in stacks:  # each target's import-time set-up (the HF stack forbids hub access) before injecting
        targets.get(stack)

    _stack.enter_context(injected(*ids))
    # rank workers started by this session (harness.launch.RankPool) inject the same faults
    from faultbench.harness.launch import INJECT_ENV, PLUGINS_ENV

    _stack.enter_context(_env({INJECT_ENV: ",".join(ids), PLUGINS_ENV: os.pathsep.join(plugins)}))


@pytest.fixture(scope="session")
def fault_plugins(request) -> tuple[str, ...]:
    """The session's ``--fault-plugin`` values, for runs that must load them in other processes (rank workers)."""
    return tuple(request.config.getoption("fault_plugin"))


@contextlib.contextmanager
def _env(values: dict):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def pytest_report_header(config):
    ids = config.getoption("inject_fault")
    return f"faults injected: {', '.join(ids)}" if ids else None


def pytest_unconfigure(config):
    _stack.close()
