"""pytest option ``--inject-fault ID`` (repeatable): run the project's own tests against a broken reference.

Loaded by ``-p harness.pytest_plugin`` (pyproject addopts). The faults are injected for the whole
session in every process (xdist workers parse the same options), so a test suite's mutation score
is simply: which faults make it fail.
"""

from __future__ import annotations

import contextlib
import os

_stack = contextlib.ExitStack()


def pytest_addoption(parser):
    group = parser.getgroup("faultbench")
    group.addoption("--inject-fault", action="append", default=[], metavar="ID",
                    help="inject this fault into model/ for the whole session (repeatable)")
    group.addoption("--fault-plugin", action="append", default=[], metavar="PATH_OR_MODULE",
                    help="load faults from a plugin first (repeatable)")


def pytest_configure(config):
    ids = config.getoption("inject_fault")
    if not ids:
        return
    from faults.inject import injected
    from faults.registry import get_fault, load_plugin

    plugins = config.getoption("fault_plugin")
    for plugin in plugins:
        load_plugin(plugin)
    import pytest

    from faults.registry import FaultError

    try:
        for fault_id in ids:
            get_fault(fault_id)
    except FaultError as e:  # an unknown id stops the session with a suggestion, not a traceback
        raise pytest.UsageError(str(e)) from None
    _stack.enter_context(injected(*ids))
    # rank workers started by this session (harness.launch.RankPool) inject the same faults
    from harness.launch import INJECT_ENV, PLUGINS_ENV

    _stack.enter_context(_env({INJECT_ENV: ",".join(ids), PLUGINS_ENV: os.pathsep.join(plugins)}))


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
