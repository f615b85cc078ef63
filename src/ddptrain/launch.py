"""`ddptrain launch`: start a job with the same command on every node, over torchrun's own agent.

    ddptrain launch --nnodes 2 --nproc-per-node auto --rdzv-endpoint 10.0.0.1:29500 \\
        --node-addr 10.0.0.1 -- train -c cfg.yaml          # on 10.0.0.1 (hosts the rendezvous)
    ddptrain launch --nnodes 2 --nproc-per-node auto --rdzv-endpoint 10.0.0.1:29500 \\
        --node-addr 10.0.0.2 -- train -c cfg.yaml          # on 10.0.0.2

The options become a torchrun command line (`--dry-run` prints it) that torchrun's own parser
and `config_from_args` turn into a LaunchConfig; the agent is torchrun's LocalElasticAgent with
three production changes that torchrun's CLI cannot express:

* a worker exit code of 75 (preempted, checkpoint committed) or 2 (bad input) ends the job
  with that code instead of being restarted until the restart budget is gone;
* the exit barrier (all nodes wait for each other after success) is bounded, 300 s -> 60 s;
* stopping workers for a restart waits --shutdown-timeout, not a fixed 30 s.

Exit codes: 0 done, 1 failed (restarts used up, rendezvous failed), 2 bad input,
75 preempted (run the same command again to resume), 128+N killed by signal N before the
workers could stop cleanly.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import shlex
import signal
import socket
import struct
import sys
import threading
import time
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import ProcessFailure, SignalException
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.elastic.rendezvous.api import RendezvousError
from torch.distributed.launcher.api import LaunchConfig
from torch.distributed.run import config_from_args, get_args_parser

from ddptrain.errors import LaunchError, UserError
from ddptrain.preemption import EXIT_PREEMPTED
from ddptrain.triage import TRIAGE_STORE_ENV

EXIT_OK, EXIT_FAILED = 0, 1
EXIT_USAGE = UserError.exit_code
# Worker exit codes that a restart cannot fix: end the job with that code right away.
FINAL_EXIT_CODES = (EXIT_PREEMPTED, EXIT_USAGE)
DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def add_parser(sub: Any) -> None:
    """Register the `launch` subcommand on the CLI's subparsers."""
    p = sub.add_parser(
        "launch", help="run a job on this node (one command per node; torchrun underneath)",
        description="Start this node's share of a (multi-node) job: `ddptrain launch [options] -- train -c cfg.yaml ...`",
    )
    p.add_argument("--nnodes", default="1", help="nodes in the job, or MIN:MAX to keep training while MIN remain (default 1)")
    p.add_argument("--nproc-per-node", default="auto", help="workers on this node: a number, or auto = one per GPU, else one per CPU (default auto)")
    p.add_argument("--rdzv-endpoint", help="HOST:PORT of the rendezvous, the same on every node; the node whose --node-addr is HOST hosts it")
    p.add_argument("--node-addr", help="address this node advertises to the others (and the one gloo uses); default: torchrun's hostname lookup")
    p.add_argument("--run-id", help="rendezvous id, the same on every node (default: derived from --rdzv-endpoint)")
    p.add_argument("--max-restarts", type=int, default=3, help="worker-group restarts after failures, counted per node (default 3)")
    p.add_argument("--rdzv-timeout", type=int, default=600, help="seconds for all nodes to join a rendezvous before giving up (default 600)")
    p.add_argument("--rdzv-last-call", type=int, default=10, help="with MIN:MAX nodes: seconds to wait for more nodes once MIN have joined (default 10)")
    p.add_argument("--rdzv-conf", default="", help="more c10d rendezvous options, KEY=VALUE,... (e.g. keep_alive_interval=5,read_timeout=60)")
    p.add_argument("--shutdown-timeout", type=int, default=30, help="seconds workers get to stop (and checkpoint) after a signal before SIGKILL (default 30)")
    p.add_argument("--exit-barrier-timeout", type=float, default=60.0, help="seconds a finished node waits for the others (default 60)")
    p.add_argument("--signals-to-handle", default=DEFAULT_SIGNALS, help=f"signals forwarded to the workers (default {DEFAULT_SIGNALS})")
    p.add_argument("--monitor-interval", type=float, default=0.1, help="seconds between checks of the workers (default 0.1)")
    p.add_argument("--dry-run", action="store_true", help="print the equivalent torchrun command and exit")
    p.add_argument("worker_command", nargs=argparse.REMAINDER, help="after --: the ddptrain command each worker runs, e.g. train -c cfg.yaml")


# ---- the torchrun command line ----------------------------------------------------------------


def _split_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise LaunchError(f"--rdzv-endpoint {endpoint!r} must look like HOST:PORT (e.g. 10.0.0.1:29500)")
    return host.strip("[]"), int(port)


def _node_counts(nnodes: str) -> tuple[int, int]:
    parts = nnodes.split(":")
    if len(parts) > 2 or not all(p.isdigit() for p in parts):
        raise LaunchError(f"--nnodes {nnodes!r} must be a number or MIN:MAX (e.g. 2 or 1:4)")
    lo, hi = int(parts[0]), int(parts[-1])
    if not 0 < lo <= hi:
        raise LaunchError(f"--nnodes {nnodes!r}: need 0 < MIN <= MAX")
    return lo, hi


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


def torchrun_command(args: argparse.Namespace) -> tuple[dict[str, str], list[str]]:
    """(environment additions, torchrun arguments) equivalent to the launch options."""
    command = list(args.worker_command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise LaunchError("nothing to launch: add the worker command after --, e.g. ddptrain launch ... -- train -c cfg.yaml")
    _, max_nodes = _node_counts(args.nnodes)
    if args.max_restarts < 0:
        raise LaunchError(f"--max-restarts {args.max_restarts} must be >= 0")
    conf = [f"join_timeout={args.rdzv_timeout}", f"last_call_timeout={args.rdzv_last_call}"]
    # Each rendezvous round gets a fresh worker store (on rank 0, new port): the store shared
    # across rounds keeps the previous workers' keys, and a restarted worker that starts early
    # reads a dead peer's address from them and fails to connect.
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    if args.rdzv_endpoint:
        host, _ = _split_endpoint(args.rdzv_endpoint)
        endpoint = args.rdzv_endpoint
        run_id = args.run_id or default_run_id(endpoint)
        env[TRIAGE_STORE_ENV] = endpoint  # the rendezvous store outlives any worker: triage checks in there
        if args.node_addr:
            # torchrun guesses whether it hosts the store by resolving hostnames, which fails
            # wherever hostnames do not resolve (containers, namespaces): say it explicitly.
            conf.insert(0, f"is_host={'true' if args.node_addr == host else 'false'}")
    elif max_nodes > 1:
        raise LaunchError(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT (the same on every node)")
    else:
        endpoint, run_id = "localhost:0", args.run_id or "ddptrain-local"  # one node: a free port
    if args.rdzv_conf:
        conf.append(args.rdzv_conf)
    argv = [
        "--nnodes", args.nnodes, "--nproc-per-node", str(args.nproc_per_node),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
        "--rdzv-conf", ",".join(conf), "--max-restarts", str(args.max_restarts),
        "--monitor-interval", str(args.monitor_interval), "--signals-to-handle", args.signals_to_handle,
        "--shutdown-timeout", str(args.shutdown_timeout),
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

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = super()._monitor_workers(worker_group)
        if result.is_failed() and any(f.exitcode in FINAL_EXIT_CODES for f in result.failures.values()):
            # The same idiom torchrun uses for workers stuck in the kernel: no restart.
            self._remaining_restarts = 0
        # While healthy the agent next asks the store whether nodes are waiting to join.
        healthy = result.state == WorkerState.HEALTHY
        self.deadline = time.monotonic() + self.store_limit_s if healthy else None
        return result

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        self.deadline = time.monotonic() + 2 * self.store_limit_s  # the join timeout, then the store's
        try:
            super()._rendezvous(worker_group)
        finally:
            self.deadline = None

    def _exit_barrier(self) -> None:
        self.deadline = time.monotonic() + self._exit_barrier_timeout + self.store_limit_s
        try:
            super()._exit_barrier()
        finally:
            self.deadline = None

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        self._shutdown(timeout=self._shutdown_timeout)  # the base class waits a fixed 30 s

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        super()._shutdown(death_sig, timeout)
        # After the workers are gone, keep their exit codes: when the agent itself is stopped
        # by a signal, they tell whether the workers committed a preemption checkpoint (75).
        if self._pcontext is not None:
            done = self._pcontext.wait(0)
            if done is not None:
                self.exit_codes = {r: 0 for r in done.return_values} | {f.local_rank: f.exitcode for f in done.failures.values()}


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
        _say(f"the rendezvous store was unreachable for over {self.agent.store_limit_s:g} s "
             "(host node or network gone?): stopping this node")
        pcontext = self.agent._pcontext  # the worker processes are in sessions of their own
        for pid in (pcontext.pids().values() if pcontext is not None else ()):
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
        os._exit(EXIT_FAILED)  # the main thread is stuck in the store call: no cleanup is possible


def _make_agent(config: LaunchConfig, entrypoint: str, args: list[str], exit_barrier_timeout: float) -> _Agent:
    """What torch.distributed.launcher.api.launch_agent builds, with our agent class."""
    params = RendezvousParameters(
        backend=config.rdzv_backend, endpoint=config.rdzv_endpoint, run_id=config.run_id,
        min_nodes=config.min_nodes, max_nodes=config.max_nodes, local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle  # read by the worker context
    spec = WorkerSpec(
        role=config.role, local_world_size=config.nproc_per_node, entrypoint=entrypoint, args=tuple(args),
        rdzv_handler=rdzv_registry.get_rendezvous_handler(params), max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval, local_addr=config.local_addr,
    )
    return _Agent(
        spec=spec, logs_specs=config.logs_specs, start_method=config.start_method,  # type: ignore[arg-type]
        exit_barrier_timeout=exit_barrier_timeout, log_line_prefix_template=config.log_line_prefix_template,
        shutdown_timeout=config.shutdown_timeout,  # type: ignore[arg-type]
        store_limit_s=float(config.rdzv_configs["join_timeout"]),
    )


def exit_code_for(codes: list[int]) -> int:
    """The job's exit code from its workers' codes (on this node)."""
    if EXIT_PREEMPTED in codes:
        return EXIT_PREEMPTED
    if codes and all(c == EXIT_USAGE for c in codes):
        return EXIT_USAGE
    return EXIT_OK if all(c == 0 for c in codes) else EXIT_FAILED


def _describe(failures: dict[int, ProcessFailure]) -> str:
    rank, first = min(failures.items(), key=lambda kv: kv[1].timestamp)
    how = f"signal {first.signal_name()}" if first.exitcode < 0 else f"exit code {first.exitcode}"
    # The error file written by record() in the worker holds {"message": {"message": "Type: text", ...}}.
    cause = first.message.get("message", "") if isinstance(first.message, dict) else ""
    return f"rank {rank} ({socket.gethostname()}) ended with {how}" + (f": {cause}" if cause else " (its error is in the log above)")


def _say(text: str) -> None:
    print(f"ddptrain launch: {text}", file=sys.stderr, flush=True)


def launch(args: argparse.Namespace) -> int:
    """Run this node's agent until the job ends; returns the job's exit code."""
    stale = sorted(k for k in os.environ if k.startswith("PET_"))
    for key in stale:  # torchrun reads every PET_<FLAG> as a flag: stale ones join old jobs
        del os.environ[key]
    env, argv = torchrun_command(args)
    if args.dry_run:
        print(shlex.join([*(f"{k}={v}" for k, v in env.items()), "torchrun", *argv]))
        print(f"# beyond torchrun: worker exit {EXIT_PREEMPTED} or {EXIT_USAGE} ends the job with that code (no restart), "
              f"exit barrier {args.exit_barrier_timeout:g} s, restarts stop workers within {args.shutdown_timeout} s")
        return EXIT_OK
    if stale:
        _say(f"ignoring stale torchrun variables {', '.join(stale)}")
    os.environ.update(env)
    try:
        config, entrypoint, entry_args = config_from_args(get_args_parser().parse_args(argv))
    except (ValueError, AssertionError, RuntimeError) as e:
        raise LaunchError(f"invalid launch options: {e}") from None
    agent = _make_agent(config, entrypoint, entry_args, args.exit_barrier_timeout)  # type: ignore[arg-type]
    _StallGuard(agent).start()
    shutdown_rdzv = True
    try:
        result = agent.run()
    except SignalException as e:
        # Keep the rendezvous open (as torchrun does): the other nodes may still re-form without us.
        shutdown_rdzv = False
        code = exit_code_for(list(agent.exit_codes.values()))
        if code == EXIT_PREEMPTED:
            _say(f"stopped by {e.sigval.name}; the workers committed a checkpoint. Run the same command again to resume.")
            return EXIT_PREEMPTED
        _say(f"killed by {e.sigval.name} before the workers could stop cleanly")
        return 128 + int(e.sigval)
    except RendezvousError as e:
        if exit_code_for(list(agent.exit_codes.values())) == EXIT_PREEMPTED:
            return EXIT_PREEMPTED  # the host node left first after the same coordinated stop
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
    if code == EXIT_PREEMPTED:
        _say("preempted: the workers committed a checkpoint. Run the same command again to resume.")
    else:
        _say(f"job failed after {agent.get_worker_group().spec.max_restarts} restart(s) allowed: {_describe(result.failures)}")
    return code
