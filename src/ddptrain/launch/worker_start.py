"""Workers forked from a server that has already imported torch, instead of fresh interpreters.

A worker started as `python -m ddptrain` spends seconds before it can do anything: the interpreter,
`import torch`, and torch._dynamo, which torch imports the first time an optimizer is built
(~3 s each on a 2-core machine, measured by the recovery timeline). After a failure every worker
of the job pays that again, on the critical path of the restart.

With `--worker-start preloaded` (the default) the agent starts its workers through Python's
forkserver, whose server process imports PRELOAD once, when the job starts; every (re)start
then forks from it in milliseconds. The server itself is forked from the launcher when the job starts
(start_preloaded_server), once the launcher has imported what the workers need, rather than exec'd as a fresh
interpreter that would import it all a second time on the node. The worker runs the same `python -m ddptrain ...` code path
(run_worker executes ddptrain/__main__.py), so nothing else differs. Environment: a forked worker
has the agent's environment as it was when the server started, plus the variables torchrun sets
per worker; what the agent learns later (the recovery marks) comes as an argument.

The server never initialises CUDA or runs a parallel region (import only), so forking from it is
safe for CUDA, NCCL and OpenMP alike. `--worker-start exec` keeps torchrun's plain subprocesses.
"""

from __future__ import annotations

import functools
import gc
import logging
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import multiprocessing.util
import os
import runpy
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from ddptrain.observe.recovery import AGENT_MARKS_ENV
from ddptrain.train.agent_watch import leave_if_the_agent_dies

PRELOAD = ["ddptrain.launch.preload"]  # the imports, and stop signals ignored by the server
SERVER_IGNORES = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
WORKER_STARTS = ("preloaded", "exec")


# The semaphores of torch's worker context belong to multiprocessing's resource tracker, a process of
# its own started with this interpreter's -W options. A launcher that leaves without the interpreter's
# teardown (after a stop signal, train/preemption.py) never unregisters them: the tracker then unlinks
# them itself, as it should, but also warns "leaked semaphore objects" on every intended stop.
_TRACKER_QUIET = "ignore:resource_tracker:UserWarning"


def is_script(word: str) -> bool:
    """Whether a worker command's first word names a Python script (run as `python SCRIPT ARGS`, as torchrun
    runs one) rather than a ddptrain subcommand."""
    return word.endswith(".py")


def use_preloaded_server() -> str:
    """Make worker processes fork from a preloaded server; returns the start method for torch's agent."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    if _TRACKER_QUIET not in sys.warnoptions:  # read when the tracker starts (with the forkserver)
        sys.warnoptions.append(_TRACKER_QUIET)
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_no_exit_traceback)
    return "forkserver"


def import_what_workers_need() -> None:
    """Import what every training worker imports (the fork server holds it, so workers start without it)."""
    import torch._dynamo  # noqa: F401  (imported by the first optimizer: ~3 s saved per worker start)

    import ddptrain.run  # noqa: F401  (and with it torch and every ddptrain module a training worker uses)


def start_preloaded_server() -> None:
    """Start the preloaded start's fork server now, forked from this launcher once it has imported what the workers
    need, instead of the fresh interpreter multiprocessing would exec at the first worker start and that would
    import it all again: one interpreter start and torch import less per node and job (about 2-5 CPU-seconds on a
    2-core machine). The forked server runs the command line multiprocessing built for the fresh one, with the same
    descriptors, so it is the same server. With another Python thread running a fork is unsafe: the server then
    starts as multiprocessing starts it."""
    if threading.active_count() > 1:
        return
    import_what_workers_need()
    multiprocessing.resource_tracker.ensure_running()  # exec'd as always: it too starts through spawnv_passfds
    gc.collect()  # what is left to finalize is finalized here, not in the server, whose copies of it are closed
    exec_server = multiprocessing.util.spawnv_passfds
    # What ForkServer.ensure_running starts its server with; this process runs no other thread meanwhile.
    multiprocessing.util.spawnv_passfds = functools.partial(_fork_server, exec_server)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        multiprocessing.util.spawnv_passfds = exec_server


def _fork_server(exec_server: Callable[..., int], path: Any, args: Any, passfds: Sequence[int]) -> int:
    """In place of multiprocessing.util.spawnv_passfds(python, [python, ..., -c, CODE], fds): fork, and run CODE
    in the child with only the descriptors an exec'd interpreter would have (0-2 and fds); the child's pid."""
    code = args[args.index("-c") + 1] if "-c" in args else ""
    if "multiprocessing.forkserver" not in code:
        return exec_server(path, args, passfds)  # not the server's command: start it as multiprocessing would
    pid = os.fork()
    if pid:
        return pid
    try:
        for fd in {int(name) for name in os.listdir("/proc/self/fd")} - {0, 1, 2, *passfds}:
            try:
                os.close(fd)
            except OSError:
                pass  # the listing's own descriptor, closed by now
        # A fresh lock: the launcher held its own across the fork (a worker that starts a server of its own takes it).
        multiprocessing.forkserver._forkserver._lock = threading.Lock()  # type: ignore[attr-defined]
        exec(code, {"__name__": "__mp_forkserver__"})
    finally:
        os._exit(0)  # the server's end, as its exec'd interpreter's: never back into the launcher's code


def _threads_as_the_environment_says() -> None:
    """torch's threads per worker as OMP_NUM_THREADS says: the server was forked from a launcher that had imported
    torch before torchrun set it (1 for several workers on a node), so a worker applies it as a fresh interpreter's
    import would have."""
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))


def _no_exit_traceback(record: logging.LogRecord) -> bool:
    """Keep torch's "failed (exitcode: N)" line for a forked worker but not the traceback it attaches:
    that traceback is the agent's own polling code, not the worker's error (which the worker printed)."""
    if record.exc_info and record.exc_info[0] is not None and record.exc_info[0].__name__ == "ProcessExitedException":
        record.exc_info, record.exc_text = None, None
    return True


def is_forked_worker() -> bool:
    """Whether this process is a worker forked by the preloaded start (run_worker), which ends through
    multiprocessing's own exit (no interpreter teardown) once torch's agent has its return value."""
    return _forked_worker[0]


_forked_worker = [False]


def run_worker(agent_marks: str, *argv: str) -> None:
    """`python -m ddptrain ARGV` (or `python SCRIPT ARGS` when ARGV names a script) in this forked process: its
    exit code is the worker's exit code."""
    _forked_worker[0] = True
    # A session of its own, as torchrun gives exec'd workers: a terminal's Ctrl-C reaches the
    # agent only, which forwards it once (a second one means "quit now" to the workers).
    os.setsid()
    for sig in SERVER_IGNORES:
        signal.signal(sig, signal.SIG_DFL)  # the server ignores them (launch/preload.py); a worker must not
    _threads_as_the_environment_says()
    if agent_marks:
        os.environ[AGENT_MARKS_ENV] = agent_marks
    else:
        os.environ.pop(AGENT_MARKS_ENV, None)
    script = argv[0] if argv and is_script(argv[0]) else None
    # As `python -m` puts the cwd first (modules named by targets resolve from it), `python SCRIPT` its folder.
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)) if script else os.getcwd())
    sys.argv = list(argv) if script else ["ddptrain", *argv]
    # `python -u` of the exec start: output reaches the agent's log as it is written.
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(line_buffering=True)
    try:
        if script:
            runpy.run_path(script, run_name="__main__")
        else:
            runpy.run_module("ddptrain", run_name="__main__", alter_sys=True)
    finally:
        leave_if_the_agent_dies()  # torch's wrapper now waits for the agent to read the result
