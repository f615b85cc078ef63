"""torchrun's LocalElasticAgent with the production changes torchrun's CLI cannot express.

* a worker exit code of 75 (preempted, checkpoint committed), 130 (Ctrl-C, checkpoint committed),
  73 (another run took the run folder's lease) or 2 (bad input) ends the job with that code instead
  of being restarted until the restart budget is gone;
* the first stop signal decides: later ones never replace it (a Ctrl-C while the workers stop is
  passed on to them, and they quit at once keeping the first signal's exit code; others are ignored);
* the exit barrier (all nodes wait for each other after success) is bounded, 300 s -> 60 s;
* stopping workers for a restart waits --shutdown-timeout, not a fixed 30 s;
* every phase that talks to the rendezvous store has a deadline (StallGuard);
* a store this node hosts listens on the one address the job uses (rendezvous_handler), and the
  etcd rendezvous is given every member (etcd_rdzv.py).

launcher.py runs it and turns its outcome into the job's exit code.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import ProcessFailure, SignalException
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.elastic.rendezvous.api import RendezvousHandler
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
from torch.distributed.launcher.api import LaunchConfig

from ddptrain import streams
from ddptrain.dist import BIND_ADDR_ENV, listening_store
from ddptrain.endpoints import split_host_port
from ddptrain.errors import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_LEASE_LOST, EXIT_PREEMPTED, EXIT_USAGE, LaunchError
from ddptrain.etcd_endpoints import ETCD_BACKENDS, parse_endpoints
from ddptrain.launch.etcd_rdzv import etcd_handler
from ddptrain.launch.options import DEFAULT_SIGNALS
from ddptrain.observe.recovery import AGENT_MARKS_ENV, encode_agent_marks

# Worker exit codes that a restart cannot fix: end the job with that code right away.
FINAL_EXIT_CODES = (EXIT_PREEMPTED, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_LEASE_LOST)


# How long workers that stopped together (exit 75) without a signal to this launcher wait for a node in the
# rendezvous's wait list before the stop counts as a preemption.
NEWCOMER_RECHECK_S = 5.0


class Agent(LocalElasticAgent):
    """torchrun's agent, plus: exit codes 75 and 2 end the job; stops wait --shutdown-timeout;
    a deadline on every phase that talks to the rendezvous store (see StallGuard)."""

    def __init__(self, *args: Any, store_limit_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.exit_codes: dict[int, int] = {}  # local rank -> exit code of the last worker group
        self.store_limit_s = store_limit_s
        self.deadline: float | None = None  # monotonic time by which the current phase must end
        # The recovery timeline's agent side (observe/recovery.py): set from the failure seen to
        # the new workers' spawn, handed to them in AGENT_MARKS_ENV.
        self.recovery_marks: dict[str, float] = {}
        self.stop_signal: signal.Signals | None = None  # the first stop signal: it decides (see _first_signal)
        self.failures: dict[int, ProcessFailure] = {}  # of the workers that just failed (said at the restart)
        self.hurried = False  # a later Ctrl-C was passed on to the workers

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = super()._monitor_workers(worker_group)
        if result.state in (WorkerState.UNHEALTHY, WorkerState.FAILED):
            self.recovery_marks.setdefault("failure_seen", time.time())
            self.failures = dict(result.failures)
        if result.is_failed() and any(f.exitcode in FINAL_EXIT_CODES for f in result.failures.values()):
            if self._stopped_for_newcomer(result):
                say("the workers stopped together with another node's, for a node joining: re-forming the group")
                return RunResult(state=WorkerState.HEALTHY)  # the base class then sees the node waiting
            # The same idiom torchrun uses for workers stuck in the kernel: no restart.
            self._remaining_restarts = 0
        # While healthy the agent next asks the store whether nodes are waiting to join.
        healthy = result.state == WorkerState.HEALTHY
        self.deadline = time.monotonic() + self.store_limit_s if healthy else None
        checked: RunResult = result
        return checked

    def _stopped_for_newcomer(self, result: RunResult) -> bool:
        """Whether the workers' exit 75 came from another agent's graceful stop for a node joining.

        An agent that sees a node waiting stops its workers with SIGTERM; they agree to stop with
        every other rank, so the workers here exit 75 too, possibly before this agent has seen the
        newcomer itself. That is a membership change, not a preemption: re-form the group. (A real
        preemption signals this launcher as well, which ends it before its workers are checked.)
        The wait list is read again for a few seconds before this is called a preemption: on a busy
        machine the newcomer can miss a heartbeat and be dropped from it, or a read of the store can
        fail, while the agent that stopped its workers for it is re-joining (the list then holds it).
        """
        if any(f.exitcode != EXIT_PREEMPTED for f in result.failures.values()):
            return False
        deadline = time.monotonic() + NEWCOMER_RECHECK_S
        while True:
            try:
                if self._worker_group.spec.rdzv_handler.num_nodes_waiting() > 0:
                    return True
            except Exception:  # noqa: BLE001 - a store unreachable for long is for the stall guard
                pass
            if time.monotonic() > deadline:
                return False
            time.sleep(0.5)

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        self.recovery_marks.setdefault("failure_seen", time.time())  # or a node waiting to join
        if self.failures:  # one line per restart, in place of torch's per-process log lines
            left = self._remaining_restarts  # already counted down for this restart
            say(f"{describe_failure(self.failures)}; restarting the workers ({left} restart(s) left)")
            self.failures = {}
        super()._restart_workers(worker_group)

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        self.deadline = time.monotonic() + 2 * self.store_limit_s  # the join timeout, then the store's
        try:
            super()._rendezvous(worker_group)
        finally:
            self.deadline = None
        if self.recovery_marks:
            self.recovery_marks["rendezvous_done"] = time.time()

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        marks = ""
        if self.recovery_marks:
            self.recovery_marks["workers_spawned"] = time.time()
            marks = encode_agent_marks(self.recovery_marks)
        self.recovery_marks = {}
        spec = worker_group.spec
        if callable(spec.entrypoint):  # preloaded: run_worker(agent_marks, *command)
            spec.args = (marks, *spec.args[1:])
            started: dict[int, Any] = super()._start_workers(worker_group)
        else:  # exec: a fresh interpreter inherits the agent's environment
            os.environ[AGENT_MARKS_ENV] = marks
            started = super()._start_workers(worker_group)
            os.environ.pop(AGENT_MARKS_ENV, None)
        if threading.current_thread() is threading.main_thread():
            # In place of torch's handlers (installed by the start above), which raise on every signal: a
            # second one raised inside the shutdown of the first, cutting it short (exit 143 after a Ctrl-C).
            for sig in handled_signals():
                signal.signal(sig, self._first_signal)
        return started

    def _first_signal(self, signum: int, frame: Any) -> None:
        """The first stop signal stops the job (as torch's handler does); a later Ctrl-C makes the workers quit
        at once (their exit code stays the first signal's); other later signals change nothing."""
        if self.stop_signal is None:
            self.stop_signal = signal.Signals(signum)
            raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=self.stop_signal)
        if signum == signal.SIGINT:
            self._forward_interrupt(signum, frame)

    def _exit_barrier(self) -> None:
        self.deadline = time.monotonic() + self._exit_barrier_timeout + self.store_limit_s
        try:
            super()._exit_barrier()  # type: ignore[no-untyped-call]
        finally:
            self.deadline = None

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        self._shutdown(timeout=self._shutdown_timeout)  # the base class waits a fixed 30 s
        if self.recovery_marks:
            self.recovery_marks["workers_stopped"] = time.time()

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        # While the workers stop (they may be committing a checkpoint), a second Ctrl-C goes to them
        # and they quit at once; torch's own handler would raise here and leave them running.
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, self._forward_interrupt) if main else None
        try:
            super()._shutdown(death_sig, timeout)
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
        # After the workers are gone, keep their exit codes: when the agent itself is stopped
        # by a signal, they tell whether the workers committed a preemption checkpoint (75).
        if self._pcontext is not None:
            done = self._pcontext.wait(0)
            if done is not None:
                self.exit_codes = {r: 0 for r in done.return_values} | {
                    f.local_rank: f.exitcode for f in done.failures.values()
                }

    def _forward_interrupt(self, signum: int, frame: Any) -> None:
        self.hurried = True
        for pid in self._pcontext.pids().values() if self._pcontext is not None else ():
            try:
                os.kill(pid, signal.SIGINT)
            except OSError:
                pass  # already gone


class QuietStops(logging.Filter):
    """Drops torchelastic's per-process log lines about stopping workers: the launcher says each event in
    one line of its own (`stopped by SIGINT; ...`, `rank 1 (host) ended with exit code 1...; restarting
    the workers`, `job failed ...`), and each worker names its own error."""

    LOGGERS = (
        "torch.distributed.elastic.agent.server.api",
        "torch.distributed.elastic.multiprocessing.api",
        "torch.multiprocessing.spawn",
    )
    REPLACED = ("Received %s death signal", "Closing process", "Terminating process", "failed (exitcode: %s)")

    def filter(self, record: logging.LogRecord) -> bool:
        """False for a line the launcher's own line replaces."""
        return not str(record.msg).startswith(self.REPLACED)

    def install(self) -> None:
        """Attach to torch's loggers of the worker processes' life."""
        for name in self.LOGGERS:
            logging.getLogger(name).addFilter(self)


def describe_failure(failures: dict[int, ProcessFailure]) -> str:
    """The first failed worker in one phrase: its rank, this host, its exit code or signal, and its error."""
    rank, first = min(failures.items(), key=lambda kv: kv[1].timestamp)
    how = f"signal {first.signal_name()}" if first.exitcode < 0 else f"exit code {first.exitcode}"
    # The error file written by record() in the worker holds {"message": {"message": "Type: text", ...}}.
    cause = first.message.get("message", "") if isinstance(first.message, dict) else ""
    said = f": {cause}" if cause else "" if first.exitcode < 0 else " (its error is in the log above)"
    return f"rank {rank} ({socket.gethostname()}) ended with {how}{said}"


class StallGuard(threading.Thread):
    """Ends the launcher when the agent overruns a phase's deadline.

    torchrun's agent can block for minutes in a call to an unreachable rendezvous store: seen
    here with the network of a non-host node cut, its keep-alive thread held the lock that the
    monitoring loop waited on, long after the workers had failed. Bounded instead: once the store
    has been unreachable for the rendezvous timeout, the workers are killed and we exit 1.
    """

    def __init__(self, agent: Agent) -> None:
        super().__init__(name="ddptrain-stall-guard", daemon=True)
        self.agent = agent

    def run(self) -> None:
        while True:
            time.sleep(1.0)
            deadline = self.agent.deadline
            if deadline is not None and time.monotonic() > deadline:
                break
        say(
            f"the rendezvous store was unreachable for over {self.agent.store_limit_s:g} s "
            "(host node or network gone?): stopping this node"
        )
        pcontext = self.agent._pcontext
        for pid in pcontext.pids().values() if pcontext is not None else ():
            try:  # exec'd workers lead sessions of their own (their children go too); forked ones do not
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        os._exit(EXIT_FAILURE)  # the main thread is stuck in the store call: no cleanup is possible


def rendezvous_handler(params: RendezvousParameters, bind: str | None) -> RendezvousHandler:
    """torch's c10d rendezvous; when this node hosts it, its store listens on `bind` only.

    torch's own c10d backend creates a TCPStore that listens on every interface; here the store
    is created on a socket bound to the one address the job uses (loopback for a one-node job).
    """
    if params.backend in ETCD_BACKENDS:
        return etcd_handler(params, parse_endpoints("--rdzv-endpoint", params.endpoint))
    endpoint = split_host_port(params.endpoint or "")
    hosts = params.config.get("is_host") in (True, "true", "1") or params.max_nodes == 1
    if bind is None or not hosts or endpoint is None:
        return rdzv_registry.get_rendezvous_handler(params)
    port = endpoint[1]
    read_timeout = timedelta(seconds=int(params.config.get("read_timeout", 60)))
    try:
        store = listening_store(bind, port, read_timeout)
    except OSError as e:
        raise LaunchError(f"cannot serve the rendezvous on {bind}:{port}: {e.strerror or e}") from None
    return create_handler(store, C10dRendezvousBackend(store, params.run_id), params)


def make_agent(
    config: LaunchConfig, entrypoint: str | Callable[..., None], args: list[str], exit_barrier_timeout: float
) -> Agent:
    """What torch.distributed.launcher.api.launch_agent builds, with our agent class."""
    params = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle  # read by the worker context
    spec = WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=entrypoint,
        args=tuple(args),
        rdzv_handler=rendezvous_handler(params, os.environ.get(BIND_ADDR_ENV)),
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        local_addr=config.local_addr,
    )
    return Agent(
        spec=spec,
        logs_specs=config.logs_specs,
        start_method=config.start_method,
        exit_barrier_timeout=exit_barrier_timeout,
        log_line_prefix_template=config.log_line_prefix_template,
        shutdown_timeout=config.shutdown_timeout,
        store_limit_s=float(config.rdzv_configs.get("join_timeout", config.rdzv_configs["timeout"])),
    )


def handled_signals() -> list[signal.Signals]:
    """The signals the agent handles (and forwards), as make_agent told torch's worker context."""
    names = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", DEFAULT_SIGNALS).split(",")
    return [signal.Signals[name.strip()] for name in names if name.strip()]


def say(text: str) -> None:
    """One line on stderr from `ddptrain launch`; never fails: the reader of stderr may be gone (`| tee`)."""
    streams.say(f"ddptrain launch: {text}")
