"""`ddptrain launch`: start a job with the same command on every node, over torchrun's own agent.

    ddptrain launch --nnodes 2 --nproc-per-node auto --rdzv-endpoint 10.0.0.1:29500 \\
        --node-addr 10.0.0.1 -- train -c cfg.yaml          # on 10.0.0.1 (hosts the rendezvous)
    ddptrain launch --nnodes 2 --nproc-per-node auto --rdzv-endpoint 10.0.0.1:29500 \\
        --node-addr 10.0.0.2 -- train -c cfg.yaml          # on 10.0.0.2

The options become a torchrun command line (`--dry-run` prints it) that torchrun's own parser
and `config_from_args` turn into a LaunchConfig; the agent is torchrun's LocalElasticAgent with
production changes that torchrun's CLI cannot express:

* a worker exit code of 75 (preempted, checkpoint committed), 130 (Ctrl-C, checkpoint committed),
  73 (another run took the run folder's lease) or 2 (bad input) ends the job with that code instead
  of being restarted until the restart budget is gone;
* the first stop signal decides: later ones never replace it (a Ctrl-C while the workers stop is
  passed on to them, and they quit at once keeping the first signal's exit code; others are ignored);
* the exit barrier (all nodes wait for each other after success) is bounded, 300 s -> 60 s;
* stopping workers for a restart waits --shutdown-timeout, not a fixed 30 s;
* every phase that talks to the rendezvous store has a deadline (_StallGuard);
* each rendezvous round gets a fresh worker store (see torchrun_command).

Exit codes: 0 done, 1 failed (restarts used up, rendezvous failed), 2 bad input (whenever any
worker exited 2, whatever the others did), 73 the run folder's lease was taken by another run, 75
preempted and 130 interrupted (run the same command again to resume), 128+N killed by signal N
before the workers could stop cleanly.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import math
import os
import shlex
import signal
import socket
import struct
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
from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousHandler
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
from torch.distributed.launcher.api import LaunchConfig
from torch.distributed.run import config_from_args, get_args_parser

from ddptrain import streams
from ddptrain.dist import BIND_ADDR_ENV, listening_store
from ddptrain.endpoints import host_port, split_host_port
from ddptrain.errors import EXIT_INTERRUPTED, EXIT_LEASE_LOST, EXIT_PREEMPTED, EXIT_USAGE, LaunchError
from ddptrain.launch.etcd_endpoints import (
    ETCD_BACKENDS,
    ETCD_ENV,
    format_endpoints,
    parse_endpoints,
    require_client,
)
from ddptrain.launch.etcd_rdzv import etcd_handler, no_healthy_member
from ddptrain.launch.rdzv_conf import parse_rdzv_conf
from ddptrain.launch.torch_support import check_torch
from ddptrain.launch.worker_start import WORKER_STARTS, run_worker, use_preloaded_server
from ddptrain.observe.recovery import AGENT_MARKS_ENV, encode_agent_marks
from ddptrain.observe.triage import TRIAGE_STORE_ENV
from ddptrain.train.agent_watch import AGENT_PID_ENV, GRACE_ENV

EXIT_OK, EXIT_FAILED = 0, 1
# Worker exit codes that a restart cannot fix: end the job with that code right away.
FINAL_EXIT_CODES = (EXIT_PREEMPTED, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_LEASE_LOST)
DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
LOOPBACK = "127.0.0.1"
ETCD_READ_TIMEOUT_S = 10  # per etcd request, below the dynamic rendezvous' keep-alive expiry (15 s)


def add_parser(sub: Any) -> None:
    """Register the `launch` subcommand on the CLI's subparsers."""
    p = sub.add_parser(
        "launch",
        help="run a job on this node (one command per node; torchrun underneath)",
        description="Start this node's share of a (multi-node) job: `ddptrain launch [options] -- train -c cfg.yaml ...`",
    )
    p.add_argument(
        "--nnodes", default="1", help="nodes in the job, or MIN:MAX to keep training while MIN remain (default 1)"
    )
    p.add_argument(
        "--nproc-per-node",
        default="auto",
        help="workers on this node: a number, or auto = one per GPU, else one (using every CPU through threads) (default auto)",
    )
    p.add_argument(
        "--rdzv-backend",
        default="c10d",
        choices=("c10d", *ETCD_BACKENDS),
        help="c10d: a node hosts the rendezvous (losing it ends the job); etcd-v2 or etcd: an existing etcd "
        "cluster does, and any node may be lost (needs the etcd extra; docs/multinode.md) (default c10d)",
    )
    p.add_argument(
        "--rdzv-endpoint",
        help="c10d: HOST:PORT of the rendezvous, the same on every node; the node whose --node-addr is HOST hosts "
        "it. etcd: HOST[:PORT],... of the etcd members (port 2379 when left out)",
    )
    p.add_argument(
        "--node-addr",
        help="address this node advertises to the others (and the one gloo uses); default: torchrun's hostname lookup",
    )
    p.add_argument(
        "--run-id",
        help="rendezvous id, the same on every node (default: derived from --rdzv-endpoint; "
        "required with etcd, which jobs share)",
    )
    p.add_argument(
        "--max-restarts", type=int, default=3, help="worker-group restarts after failures, counted per node (default 3)"
    )
    p.add_argument(
        "--rdzv-timeout",
        type=int,
        default=600,
        help="seconds for all nodes to join a rendezvous before giving up (default 600)",
    )
    p.add_argument(
        "--rdzv-last-call",
        type=int,
        default=10,
        help="with MIN:MAX nodes: seconds to wait for more nodes once MIN have joined (default 10)",
    )
    p.add_argument(
        "--rdzv-conf",
        default="",
        help="more rendezvous options, KEY=VALUE,... (e.g. keep_alive_interval=5,read_timeout=60; checked per backend)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=int,
        default=30,
        help="seconds workers get to stop (and checkpoint) after a signal before SIGKILL (default 30)",
    )
    p.add_argument(
        "--exit-barrier-timeout",
        type=float,
        default=60.0,
        help="seconds a finished node waits for the others (default 60)",
    )
    p.add_argument(
        "--signals-to-handle",
        default=DEFAULT_SIGNALS,
        help=f"signals forwarded to the workers (default {DEFAULT_SIGNALS})",
    )
    p.add_argument(
        "--monitor-interval", type=float, default=0.1, help="seconds between checks of the workers (default 0.1)"
    )
    p.add_argument(
        "--preempted-exit-code",
        type=int,
        default=EXIT_PREEMPTED,
        help=f"exit code for 'preempted, checkpoint committed' (default {EXIT_PREEMPTED}; "
        "a Kubernetes job uses 143 "
        "so that the operator's ExitCode policy restarts it)",
    )
    p.add_argument(
        "--worker-start",
        choices=WORKER_STARTS,
        default="preloaded",
        help="preloaded: fork workers from a server that imported torch once (restarts skip seconds of imports); "
        "exec: a fresh interpreter per worker, as torchrun does (default preloaded)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the equivalent torchrun command and exit")
    p.add_argument(
        "worker_command",
        nargs=argparse.REMAINDER,
        help="after --: the ddptrain command each worker runs, e.g. train -c cfg.yaml",
    )


# ---- the torchrun command line ----------------------------------------------------------------


def node_counts(nnodes: str) -> tuple[int, int]:
    """(MIN, MAX) nodes from --nnodes N or MIN:MAX; LaunchError when malformed."""
    parts = nnodes.split(":")
    if len(parts) > 2 or not all(p.isdigit() for p in parts):
        raise LaunchError(f"--nnodes {nnodes!r} must be a number or MIN:MAX (e.g. 2 or 1:4)")
    lo, hi = int(parts[0]), int(parts[-1])
    if not 0 < lo <= hi:
        raise LaunchError(f"--nnodes {nnodes!r}: need 0 < MIN <= MAX")
    return lo, hi


def nproc_per_node(value: str) -> int | None:
    """--nproc-per-node as a number of workers (None for auto); LaunchError unless auto or >= 1."""
    if value == "auto":
        return None
    if not value.isdigit() or int(value) < 1:
        raise LaunchError(f"--nproc-per-node {value!r} must be a positive number of workers or auto")
    return int(value)


def workers_here(value: str) -> tuple[int, str | None]:
    """--nproc-per-node resolved on this node, and a note saying what `auto` chose.

    auto: one worker per GPU; on a node without one, a single worker, whose ops use every core
    through torch's intra-op threads. torchrun's own auto starts one worker per CPU: 64 ranks on a
    64-core node, each with a copy of the model and optimizer state, for about the throughput of one
    (DDP ranks of one thread each ran 0.97x one process with that many threads here).
    """
    count = nproc_per_node(value)
    if count is not None:
        return count, None
    import torch  # the agent already imports torch.distributed; this only asks for devices

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus:
        return gpus, None
    return 1, (
        f"--nproc-per-node auto: no GPU on this node, so 1 worker using its {os.cpu_count()} CPUs through "
        "intra-op threads; pass a number for more ranks"
    )


def default_run_id(endpoint: str) -> str:
    """A rendezvous id every node derives alike from the endpoint, so none has to be passed around."""
    return "ddptrain-" + hashlib.sha256(endpoint.encode()).hexdigest()[:12]


def interface_of(addr: str) -> str | None:
    """The network interface holding IPv4 address `addr` on this machine, or None."""
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on this interface
            if socket.inet_ntoa(raw[20:24]) == addr:
                return name
    return None


def _check_numbers(args: argparse.Namespace) -> None:
    checks = [
        ("--max-restarts", args.max_restarts, 0),
        ("--rdzv-timeout", args.rdzv_timeout, 1),
        ("--rdzv-last-call", args.rdzv_last_call, 0),
        ("--shutdown-timeout", args.shutdown_timeout, 0),
        ("--exit-barrier-timeout", args.exit_barrier_timeout, 0),
        ("--monitor-interval", args.monitor_interval, 0.01),
    ]
    for flag, value, least in checks:
        if not (math.isfinite(value) and least <= value <= 7 * 24 * 3600):
            raise LaunchError(f"{flag} {value} must be a finite number between {least} and 604800 (a week)")
    for name in args.signals_to_handle.split(","):
        if name.strip() not in signal.Signals.__members__:
            raise LaunchError(f"--signals-to-handle: {name.strip()!r} is not a signal name (e.g. SIGTERM,SIGINT)")
    parse_rdzv_conf(args.rdzv_backend, args.rdzv_conf)  # every key and value, for --dry-run too


def worker_command(args: argparse.Namespace) -> list[str]:
    """The ddptrain command each worker runs (what follows `--`); LaunchError when there is none."""
    command = list(args.worker_command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise LaunchError(
            "nothing to launch: add the worker command after --, e.g. ddptrain launch ... -- train -c cfg.yaml"
        )
    return command


def torchrun_command(args: argparse.Namespace) -> tuple[dict[str, str], list[str]]:
    """(environment additions, torchrun arguments) equivalent to the launch options."""
    command = worker_command(args)
    _, max_nodes = node_counts(args.nnodes)
    workers, _ = workers_here(args.nproc_per_node)
    _check_numbers(args)
    etcd = args.rdzv_backend in ETCD_BACKENDS
    # torch's older etcd rendezvous calls the join timeout `timeout`; etcd-v2 shares c10d's keys.
    join = "timeout" if args.rdzv_backend == "etcd" else "join_timeout"
    conf = [f"{join}={args.rdzv_timeout}", f"last_call_timeout={args.rdzv_last_call}"]
    # Each rendezvous round gets a fresh worker store (on rank 0, new port): the store shared
    # across rounds keeps the previous workers' keys, and a restarted worker that starts early
    # reads a dead peer's address from them and fails to connect. With etcd it is also what lets
    # the job outlive the first node: the shared store lives in that node's agent.
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = "1"  # what torchrun sets then, without its 4-line warning saying so
    # A worker whose agent dies gets the time the agent would have given it to stop (train/agent_watch.py).
    env[GRACE_ENV] = str(args.shutdown_timeout)
    if etcd:
        if not args.rdzv_endpoint:
            raise LaunchError(
                f"--rdzv-backend {args.rdzv_backend} needs --rdzv-endpoint HOST[:PORT],... (etcd members)"
            )
        if not args.run_id:
            raise LaunchError(
                f"--rdzv-backend {args.rdzv_backend} needs --run-id: jobs share the etcd cluster, so its "
                "address cannot tell them apart (use e.g. the scheduler's job id)"
            )
        endpoint, run_id = format_endpoints(parse_endpoints("--rdzv-endpoint", args.rdzv_endpoint)), args.run_id
        env[ETCD_ENV] = endpoint  # `ddptrain doctor` as the worker command checks every member
        if "read_timeout=" not in args.rdzv_conf:
            # torch waits 60 s on an etcd request; a member that stopped answering then holds a node's
            # keep-alive past its expiry (3 x 5 s) and the others drop it. After this long the client
            # moves on to another member: etcd answers in milliseconds when it answers at all.
            conf.append(f"read_timeout={ETCD_READ_TIMEOUT_S}")
        if args.node_addr:
            env[BIND_ADDR_ENV] = args.node_addr  # the workers' store listens on this address only
    elif args.rdzv_endpoint:
        host, _ = host_port("--rdzv-endpoint", args.rdzv_endpoint)
        endpoint = args.rdzv_endpoint
        run_id = args.run_id or default_run_id(endpoint)
        env[TRIAGE_STORE_ENV] = endpoint  # the rendezvous store outlives any worker: triage checks in there
        if args.node_addr:
            # torchrun guesses whether it hosts the store by resolving hostnames, which fails
            # wherever hostnames do not resolve (containers, namespaces): say it explicitly.
            conf.insert(0, f"is_host={'true' if args.node_addr == host else 'false'}")
            env[BIND_ADDR_ENV] = args.node_addr  # stores listen on this address only
    elif max_nodes > 1:
        raise LaunchError(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT (the same on every node)")
    else:
        endpoint, run_id = "localhost:0", args.run_id or "ddptrain-local"  # one node: a free port
        # Nothing of a one-node job needs to be reachable from elsewhere: loopback only (or the
        # address given), for the stores, gloo and NCCL's bootstrap alike.
        args = argparse.Namespace(**{**vars(args), "node_addr": args.node_addr or LOOPBACK})
        env[BIND_ADDR_ENV] = args.node_addr
        iface = interface_of(args.node_addr)
        if iface and "NCCL_SOCKET_IFNAME" not in os.environ:
            env["NCCL_SOCKET_IFNAME"] = iface
    if args.rdzv_conf:
        conf.append(args.rdzv_conf)
    argv = [
        "--nnodes",
        args.nnodes,
        "--nproc-per-node",
        str(workers),
        "--rdzv-backend",
        args.rdzv_backend,
        "--rdzv-endpoint",
        endpoint,  # torchrun itself takes one etcd member; the agent here is given all of them
        "--rdzv-id",
        run_id,
        "--rdzv-conf",
        ",".join(conf),
        "--max-restarts",
        str(args.max_restarts),
        "--monitor-interval",
        str(args.monitor_interval),
        "--signals-to-handle",
        args.signals_to_handle,
        "--shutdown-timeout",
        str(args.shutdown_timeout),
    ]
    if args.node_addr:
        argv += ["--local-addr", args.node_addr]
        iface = interface_of(args.node_addr)
        if iface and "GLOO_SOCKET_IFNAME" not in os.environ:
            env["GLOO_SOCKET_IFNAME"] = iface  # gloo would otherwise pick by resolving the hostname
    argv += ["-m", "ddptrain", *command]
    return env, argv


# ---- the agent ----------------------------------------------------------------------------------


class _Agent(LocalElasticAgent):
    """torchrun's agent, plus: exit codes 75 and 2 end the job; stops wait --shutdown-timeout;
    a deadline on every phase that talks to the rendezvous store (see _StallGuard)."""

    def __init__(self, *args: Any, store_limit_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.exit_codes: dict[int, int] = {}  # local rank -> exit code of the last worker group
        self.store_limit_s = store_limit_s
        self.deadline: float | None = None  # monotonic time by which the current phase must end
        # The recovery timeline's agent side (observe/recovery.py): set from the failure seen to
        # the new workers' spawn, handed to them in AGENT_MARKS_ENV.
        self.recovery_marks: dict[str, float] = {}
        self.stop_signal: signal.Signals | None = None  # the first stop signal: it decides (see _first_signal)
        self.hurried = False  # a later Ctrl-C was passed on to the workers

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = super()._monitor_workers(worker_group)
        if result.state in (WorkerState.UNHEALTHY, WorkerState.FAILED):
            self.recovery_marks.setdefault("failure_seen", time.time())
        if result.is_failed() and any(f.exitcode in FINAL_EXIT_CODES for f in result.failures.values()):
            if self._stopped_for_newcomer(result):
                _say("the workers stopped together with another node's, for a node joining: re-forming the group")
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
        The newcomer stays in the wait list until every old participant, this node included, has
        left the round, so the check cannot miss it.
        """
        if any(f.exitcode != EXIT_PREEMPTED for f in result.failures.values()):
            return False
        try:
            return self._worker_group.spec.rdzv_handler.num_nodes_waiting() > 0
        except Exception:  # noqa: BLE001 - the rendezvous being unreachable is for the stall guard
            return False

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        self.recovery_marks.setdefault("failure_seen", time.time())  # or a node waiting to join
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
            for sig in _handled_signals():
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


class _StallGuard(threading.Thread):
    """Ends the launcher when the agent overruns a phase's deadline.

    torchrun's agent can block for minutes in a call to an unreachable rendezvous store: seen
    here with the network of a non-host node cut, its keep-alive thread held the lock that the
    monitoring loop waited on, long after the workers had failed. Bounded instead: once the store
    has been unreachable for the rendezvous timeout, the workers are killed and we exit 1.
    """

    def __init__(self, agent: _Agent) -> None:
        super().__init__(name="ddptrain-stall-guard", daemon=True)
        self.agent = agent

    def run(self) -> None:
        while True:
            time.sleep(1.0)
            deadline = self.agent.deadline
            if deadline is not None and time.monotonic() > deadline:
                break
        _say(
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
        os._exit(EXIT_FAILED)  # the main thread is stuck in the store call: no cleanup is possible


def _rendezvous_handler(params: RendezvousParameters, bind: str | None) -> RendezvousHandler:
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


def _make_agent(
    config: LaunchConfig, entrypoint: str | Callable[..., None], args: list[str], exit_barrier_timeout: float
) -> _Agent:
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
        rdzv_handler=_rendezvous_handler(params, os.environ.get(BIND_ADDR_ENV)),
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        local_addr=config.local_addr,
    )
    return _Agent(
        spec=spec,
        logs_specs=config.logs_specs,
        start_method=config.start_method,
        exit_barrier_timeout=exit_barrier_timeout,
        log_line_prefix_template=config.log_line_prefix_template,
        shutdown_timeout=config.shutdown_timeout,
        store_limit_s=float(config.rdzv_configs.get("join_timeout", config.rdzv_configs["timeout"])),
    )


def _stopped_by_signal(agent: _Agent, first: signal.Signals, args: argparse.Namespace) -> int:
    """The launcher's exit code after its first stop signal (`first`: a later one never renames the stop)."""
    for sig in _handled_signals():  # the workers are stopped and the code decided: nothing may cut the exit
        signal.signal(sig, signal.SIG_IGN)  # short now (Python restores default handlers as it exits)
    code = exit_code_for(list(agent.exit_codes.values()))
    if code in _RESUMABLE:
        done = (
            "the workers quit at once on the Ctrl-C that followed (with or without this stop's checkpoint)"
            if agent.hurried
            else "the workers committed a checkpoint"
        )
        _say(f"stopped by {first.name}; {done}. Run the same command again to resume.")
        return _resumable_exit(code, args)
    if code in (EXIT_USAGE, EXIT_LEASE_LOST):
        return code  # the worker said why, in one line
    _say(f"killed by {first.name} before the workers could stop cleanly")
    return 128 + int(first)


def _handled_signals() -> list[signal.Signals]:
    """The signals the agent handles (and forwards), as _make_agent told torch's worker context."""
    names = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", DEFAULT_SIGNALS).split(",")
    return [signal.Signals[name.strip()] for name in names if name.strip()]


def exit_code_for(codes: list[int]) -> int:
    """The job's exit code from its workers' codes (on this node).

    Bad input (2) wins over everything: when one rank exits 2 the agent stops the others, and
    whatever they exit with then must not turn the job into a retryable failure.
    """
    for final in (EXIT_USAGE, EXIT_LEASE_LOST, EXIT_PREEMPTED, EXIT_INTERRUPTED):
        if final in codes:
            return final
    return EXIT_OK if all(c == 0 for c in codes) else EXIT_FAILED


_RESUMABLE = {EXIT_PREEMPTED: "preempted", EXIT_INTERRUPTED: "interrupted"}


def _resumable_exit(code: int, args: argparse.Namespace) -> int:
    """The launcher's exit code for a coordinated stop: a preemption exits --preempted-exit-code (a scheduler's
    restart policy may key on it), a Ctrl-C keeps its own code."""
    return args.preempted_exit_code if code == EXIT_PREEMPTED else code


def _describe(failures: dict[int, ProcessFailure]) -> str:
    rank, first = min(failures.items(), key=lambda kv: kv[1].timestamp)
    how = f"signal {first.signal_name()}" if first.exitcode < 0 else f"exit code {first.exitcode}"
    # The error file written by record() in the worker holds {"message": {"message": "Type: text", ...}}.
    cause = first.message.get("message", "") if isinstance(first.message, dict) else ""
    return f"rank {rank} ({socket.gethostname()}) ended with {how}" + (
        f": {cause}" if cause else " (its error is in the log above)"
    )


# torchrun variables a scheduler may set (the Kubeflow operator does) and the launch option each stands for.
_PET_OPTIONS = {
    "PET_NNODES": "nnodes",
    "PET_NPROC_PER_NODE": "nproc_per_node",
    "PET_RDZV_ENDPOINT": "rdzv_endpoint",
    "PET_RDZV_ID": "run_id",
    "PET_MAX_RESTARTS": "max_restarts",
}


def pet_conflicts(args: argparse.Namespace, inherited: dict[str, str]) -> list[str]:
    """One line per inherited torchrun variable that contradicts the command line (which wins)."""
    lines = []
    for key, value in inherited.items():
        dest = _PET_OPTIONS.get(key)
        ours = getattr(args, dest, None) if dest is not None else None
        if dest is not None and ours is not None and str(ours) != value:
            lines.append(
                f"warning: {key}={value} from the environment differs from --{dest.replace('_', '-')} {ours}; "
                "using the command line"
            )
    return lines


def _say(text: str) -> None:
    streams.say(f"ddptrain launch: {text}")  # never fails: the reader of stderr may be gone (`| tee`)


def launch(args: argparse.Namespace) -> int:
    """Run this node's agent until the job ends; returns the job's exit code."""
    check_torch()
    if not 0 < args.preempted_exit_code < 256 or args.preempted_exit_code in (EXIT_OK, EXIT_FAILED, EXIT_USAGE):
        raise LaunchError(
            f"--preempted-exit-code {args.preempted_exit_code} must be 3-255 (0, 1 and 2 mean something else)"
        )
    inherited = {k: os.environ.pop(k) for k in sorted(os.environ) if k.startswith("PET_")}
    # torchrun reads every PET_<FLAG> as a flag: stale ones join old jobs, so the command line decides.
    env, argv = torchrun_command(args)
    note = workers_here(args.nproc_per_node)[1]  # said once the launch goes ahead: a refusal is one line
    if args.dry_run:
        if note:
            _say(note)
        print(shlex.join([*(f"{k}={v}" for k, v in env.items()), "torchrun", *argv]))
        print(
            f"# beyond torchrun: worker exit {EXIT_PREEMPTED}, {EXIT_INTERRUPTED}, {EXIT_LEASE_LOST} or {EXIT_USAGE} "
            "ends the job with "
            f"that code (no restart), exit barrier {args.exit_barrier_timeout:g} s, restarts stop workers within "
            f"{args.shutdown_timeout} s, "
            + (
                f"the etcd client is given every member ({args.rdzv_endpoint}), "
                if args.rdzv_backend in ETCD_BACKENDS
                else ""
            )
            + "stores listen on "
            + (f"{env[BIND_ADDR_ENV]} only" if BIND_ADDR_ENV in env else "every interface (pass --node-addr)")
            + (
                ", workers fork from a server that imported torch once (--worker-start preloaded)"
                if args.worker_start == "preloaded"
                else ""
            )
        )
        return EXIT_OK
    for line in pet_conflicts(args, inherited):
        _say(line)
    if args.rdzv_backend in ETCD_BACKENDS:
        require_client()
        why = no_healthy_member(parse_endpoints("--rdzv-endpoint", args.rdzv_endpoint), args.rdzv_timeout)
        if why is not None:
            _say(f"rendezvous failed: {why}")
            return EXIT_FAILED
    os.environ.update(env)
    os.environ[AGENT_PID_ENV] = str(os.getpid())  # what the workers watch (train/agent_watch.py)
    try:
        config, entrypoint, entry_args = config_from_args(get_args_parser().parse_args(argv))
    except (ValueError, AssertionError, RuntimeError) as e:
        raise LaunchError(f"invalid launch options: {e}") from None
    if note:
        _say(note)
    if args.worker_start == "preloaded":
        config.start_method = use_preloaded_server()
        entrypoint, entry_args = run_worker, ["", *worker_command(args)]
    agent = _make_agent(config, entrypoint, entry_args, args.exit_barrier_timeout)
    _StallGuard(agent).start()
    shutdown_rdzv = True
    try:
        result = agent.run()
    except SignalException as e:
        # Keep the rendezvous open (as torchrun does): the other nodes may still re-form without us.
        shutdown_rdzv = False
        return _stopped_by_signal(agent, agent.stop_signal or e.sigval, args)
    except RendezvousError as e:
        if exit_code_for(list(agent.exit_codes.values())) == EXIT_PREEMPTED:
            return int(args.preempted_exit_code)  # the host node left first after the same coordinated stop
        _say(f"rendezvous failed: {type(e).__name__}: {str(e) or 'the nodes did not all join in time'}")
        return EXIT_FAILED
    finally:
        if shutdown_rdzv:
            try:
                agent.get_worker_group().spec.rdzv_handler.shutdown()
            except Exception as e:  # the host node (and its store) may already be gone
                _say(f"note: could not close the rendezvous ({type(e).__name__})")
    if result.state == WorkerState.SUCCEEDED:
        return EXIT_OK
    code = exit_code_for([f.exitcode for f in result.failures.values()])
    if code in _RESUMABLE:
        _say(f"{_RESUMABLE[code]}: the workers committed a checkpoint. Run the same command again to resume.")
        return _resumable_exit(code, args)
    if code == EXIT_USAGE:
        _say("bad input (a worker exited 2; not restarted): see its error above")
    elif code == EXIT_LEASE_LOST:
        _say(f"another run took the run folder's lease (a worker exited {code}; not restarted): see its error above")
    else:
        allowed = agent.get_worker_group().spec.max_restarts
        _say(f"job failed after {allowed} restart(s) allowed: {_describe(result.failures)}")
    return code
