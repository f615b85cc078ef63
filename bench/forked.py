"""Smoke mode's processes: forked from one preloaded server instead of an interpreter (and torchrun) each.

A variant of N ranks under torchrun starts N + 1 interpreters, each importing torch (~3 CPU-seconds on a
2-core machine); `python -m bench all --smoke` started ~30 of them, most of what the smoke test cost. In
smoke mode (`Variant.forked`) a variant's processes fork from one server per bench run (multiprocessing's
forkserver, preloading what `ddptrain launch`'s server preloads), each with the environment torchrun gives
a worker on one host (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT: rank 0
serves the store, on a free port of its own per job), and runs `python -m MODULE ARGS` (runpy, as `-m`
does). The measured bench keeps torchrun and its interpreters: what a user's job starts.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import socket
import subprocess
import sys
import time
from multiprocessing.process import BaseProcess
from pathlib import Path

PRELOAD = ["torch._dynamo", "ddptrain.run", "bench.forked"]
_POLL_S = 0.05


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _run_module(module: str, args: list[str], env: dict[str, str], log: str, cwd: str) -> None:
    """In the forked process: become `python -m MODULE ARGS` with `env`, output appended to `log`."""
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path.insert(0, cwd)  # as `python -m` puts the working directory first
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


class ForkedJob:
    """The processes of one variant, forked from the preloaded server; Popen's poll/wait/kill/returncode."""

    def __init__(self, module: str, args: list[str], nproc: int, env: dict[str, str], log: Path, cwd: Path) -> None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        port = str(_free_port())
        self.name = module
        self.procs: list[BaseProcess] = []
        for rank in range(max(nproc, 1)):
            rank_env = dict(env)
            if nproc:  # a plain process (nproc 0) gets no torchrun variables, as without torchrun
                rank_env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc))
                rank_env.update(LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            proc = ctx.Process(target=_run_module, args=(module, args, rank_env, str(log), str(cwd)))
            proc.start()
            self.procs.append(proc)
        self.returncode: int | None = None
        self.failure: int | None = None  # the exit code of the first process that failed

    def poll(self) -> int | None:
        """The job's exit code once every process has ended (the first failure's, else 0), else None. As torchrun
        does, a failed process ends the others (they would wait on it until their timeouts)."""
        if self.returncode is None:
            failed = [p.exitcode for p in self.procs if p.exitcode not in (None, 0)]
            if failed and self.failure is None:
                self.failure = failed[0]
                self.kill()
            codes = [p.exitcode for p in self.procs]
            if all(c is not None for c in codes):
                self.returncode = self.failure if self.failure is not None else next((c for c in codes if c), 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for every process; subprocess.TimeoutExpired (the caller kills) when `timeout` passes first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.name, timeout)
            time.sleep(_POLL_S)
        return self.returncode or 0

    def kill(self) -> None:
        """SIGKILL the processes still running, and reap them."""
        for p in self.procs:
            if p.exitcode is None:
                p.kill()
        for p in self.procs:
            p.join()
