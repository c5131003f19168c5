"""Launching data-parallel work: a persistent pool of rank processes with one process group.

Starting a 2-rank case naively (spawn two interpreters, import torch, rendezvous, run, tear down)
costs seconds before the first step. ``RankPool`` pays that once: its workers keep their process
group and run case after case. A case is a picklable top-level function ``fn(rank, *args)`` run on
every rank at once; the pool returns the per-rank results in rank order.

Nothing a case does can hang or kill the caller: a rank that raises, dies or outlives the timeout
makes ``run`` raise ``RankFailure`` naming the rank, and the pool is torn down (its process group
may be mid-collective) and rebuilt on the next call. A case that may leave process-global state behind (an
injected fault patches modules; a plugin registers faults) is run with ``retire=True``: its ranks stop after it,
and the next call forks fresh ones from the warm forkserver (about 0.1 s).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import queue
import signal
import sys
import tempfile
import time
import traceback
from datetime import timedelta

import torch.multiprocessing as mp


class RankFailure(RuntimeError):
    """A rank raised, died, or did not finish in time."""


def die_with_parent() -> None:
    """In a worker: be killed when the process that started it dies, even by SIGKILL (Linux's parent-death
    signal), so a killed bench leaves no worker behind; a parent already gone means exit now."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent or parent == 1:
        os._exit(1)


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
INJECT_ENV, PLUGINS_ENV = "FAULTBENCH_INJECT", "FAULTBENCH_FAULT_PLUGINS"
_worker_injection = contextlib.ExitStack()


def _inject_from_env() -> None:
    """Faults injected in the launching process (``pytest --inject-fault``) reach the ranks through the
    environment; they stay injected for the worker's life."""
    ids = [f for f in os.environ.get(INJECT_ENV, "").split(",") if f]
    if not ids:
        return
    from faultbench.faults.inject import injected
    from faultbench.faults.registry import load_plugin

    for plugin in filter(None, os.environ.get(PLUGINS_ENV, "").split(os.pathsep)):
        load_plugin(plugin)
    _worker_injection.enter_context(injected(*ids))  # held (not collected) for the worker's life


def _worker(rank: int, world_size: int, init_file: str, backend: str, tasks, results, pg_timeout_s: float):
    import torch
    import torch.distributed as dist

    die_with_parent()  # the forkserver, which exits when the bench does
    torch.set_num_threads(1)
    _inject_from_env()
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=pg_timeout_s))
    gc.freeze()  # the imported stack is never garbage: a case's collections (accelerate's, per train()) stay young
    results.put((rank, "ready", None))
    while (task := tasks.get()) is not None:
        fn, args = task
        try:
            results.put((rank, "ok", fn(rank, *args)))
        except BaseException as e:  # reported to the caller, never fatal to the worker loop
            results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    dist.destroy_process_group()


class RankPool:
    """``world_size`` worker processes in one torch.distributed group, reused across cases."""

    def __init__(self, world_size: int, backend: str = "gloo", start_method: str = "forkserver",
                 pg_timeout_s: float = 60.0, preload: tuple[str, ...] = ()):
        """``preload``: modules the forkserver imports besides the reference's training stack (a target's,
        e.g. ``targets.hf.case``: transformers costs seconds per worker otherwise)."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size, self.backend, self.pg_timeout_s = world_size, backend, pg_timeout_s
        self._ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            # workers fork from a server that has already imported the training stack, and torch._dynamo: the first
            # optimizer a process builds imports it (torch._disable_dynamo), 2-4 s for every worker otherwise
            self._ctx.set_forkserver_preload(["torch", "torch._dynamo", "faultbench.model.run",
                                              "faultbench.model.train", "faultbench.model.checkpoint", *preload])
        self._procs: list = []

    def _start(self, timeout_s: float) -> None:
        fd, init_file = tempfile.mkstemp(prefix="faultbench-pg-")
        os.close(fd)
        os.unlink(init_file)  # the file store must not exist yet
        self._results = self._ctx.Queue()
        self._tasks = [self._ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            self._ctx.Process(target=_worker, daemon=True,
                              args=(r, self.world_size, init_file, self.backend, self._tasks[r], self._results,
                                    self.pg_timeout_s))
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        self._collect(timeout_s)  # every rank has joined the group

    def run(self, fn, *args, timeout_s: float = 120.0, retire: bool = False) -> list:
        """Run ``fn(rank, *args)`` on every rank; return the results in rank order. ``retire``: stop these ranks
        after it, so that nothing it left in their processes reaches the next call."""
        if not self._procs:
            self._start(timeout_s)
        for q in self._tasks:
            q.put((fn, args))
        try:
            return self._collect(timeout_s)
        finally:
            if retire:
                self.close()

    def _collect(self, timeout_s: float) -> list:
        deadline = time.monotonic() + timeout_s
        out: dict[int, object] = {}
        while len(out) < self.world_size:
            try:
                rank, status, value = self._results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in out]
                if dead:
                    self._fail(f"rank {dead[0]} died (exit code {self._procs[dead[0]].exitcode})")
                if time.monotonic() > deadline:
                    missing = sorted(set(range(self.world_size)) - set(out))
                    self._fail(f"rank(s) {missing} did not finish within {timeout_s:.0f}s (hung?)")
                continue
            if status == "error":
                self._fail(f"rank {rank} raised {value}")
            out[rank] = value
        return [out[r] for r in range(self.world_size)]

    def _fail(self, message: str):
        self.close(force=True)
        raise RankFailure(message)

    def close(self, force: bool = False) -> None:
        """Stop the workers (politely, or by killing them when ``force`` or when they do not stop)."""
        if not self._procs:
            return
        if not force:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=10)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join()
        self._procs = []

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
