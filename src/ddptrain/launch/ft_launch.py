"""`ddptrain launch --fault-tolerance torchft`: in-place recovery, one torchrun agent per replica group.

    ddptrain lighthouse --bind 10.0.0.1:29510                              # once, anywhere reachable
    ddptrain launch --fault-tolerance torchft --lighthouse 10.0.0.1:29510 \\
        --replica-group 0 --node-addr 10.0.0.1 -- train -c cfg.yaml        # on each node, its own group id
    ddptrain launch --fault-tolerance torchft --replica-groups 2 --nproc-per-node 2 -- train   # one node

A replica group is one launch's workers: they do DDP among themselves over a rendezvous of their own
(nnodes 1, on this node's address or loopback), and the groups all-reduce across through torchft's
Manager, which asks the Lighthouse for a quorum every step. When a worker dies only its group's
workers are restarted (--max-restarts, counted per group); the other groups train on in the same
processes and the restarted group heals from them (the worker side: train/). Membership is
torchft's, not torchrun's, so --nnodes stays 1 and there is no shared rendezvous endpoint.

The workers learn their group through ft_env.py's three variables. Without --lighthouse, this
launch serves a Lighthouse on 127.0.0.1 (a free port, `ddptrain lighthouse`'s settings) for the
job's lifetime and starts --replica-groups launches of one group each (ids 0..K-1), passing its
stop signals on to them; the job's exit code is launcher.py's rules over theirs.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import shlex
import signal
import subprocess
import sys
from typing import Any

from ddptrain.cli_options import to_argv
from ddptrain.errors import EXIT_INTERRUPTED, EXIT_LEASE_LOST, EXIT_PREEMPTED, EXIT_USAGE, LaunchError
from ddptrain.ft_env import LIGHTHOUSE_ENV, REPLICA_GROUP_ENV
from ddptrain.launch.agent import say
from ddptrain.launch.launcher import exit_code_for, run_job
from ddptrain.launch.lighthouse_server import DEFAULTS, require_torchft, serve_lighthouse, served_port, serving_endpoint
from ddptrain.launch.options import EXIT_OK, LaunchOptions, node_counts
from ddptrain.launch.torchrun_args import LOOPBACK, beyond_torchrun, torchrun_command, workers_here

MAX_GROUP_ID = 999_999  # ft_env.py reads at most six digits
# Set on the one-group launches a local job starts: the pid they stop with (their Lighthouse lives there).
SUPERVISOR_ENV = "DDPTRAIN_FT_SUPERVISOR"
_PR_SET_PDEATHSIG = 1
_LOOPBACK_NAMES = ("localhost", "::1")


def check_ft_options(options: LaunchOptions) -> None:
    """The in-place mode's options are consistent (LaunchError, one line, otherwise); no-op without them."""
    if options.fault_tolerance is None:
        given = {
            "--lighthouse": options.lighthouse is not None,
            "--replica-group": options.replica_group is not None,
            "--replica-groups": options.replica_groups != 1,
        }
        for flag in (flag for flag, used in given.items() if used):
            raise LaunchError(f"{flag} needs --fault-tolerance torchft")
        return
    if node_counts(options.nnodes) != (1, 1):
        raise LaunchError(
            f"--fault-tolerance torchft with --nnodes {options.nnodes}: each launch is one replica group and torchft "
            "decides membership; run one launch per node with --lighthouse HOST:PORT and --replica-group N"
        )
    if options.rdzv_endpoint is not None or options.etcd:
        raise LaunchError(
            "--fault-tolerance torchft takes no --rdzv-endpoint or --rdzv-backend: each group meets on "
            "this node; the groups meet at the Lighthouse"
        )
    if options.replica_groups < 1:
        raise LaunchError(f"--replica-groups {options.replica_groups} must be at least 1")
    if options.lighthouse is None:
        if options.replica_group is not None:
            raise LaunchError("--replica-group needs --lighthouse: a local job numbers its groups 0..K-1 itself")
    else:
        _check_joining(options)
    require_torchft("--fault-tolerance torchft")


def _check_joining(options: LaunchOptions) -> None:
    host, _ = serving_endpoint("--lighthouse", options.lighthouse or "")
    if options.replica_group is None:
        raise LaunchError(
            "--lighthouse needs --replica-group N: this launch's group id, distinct per launch (e.g. $SLURM_NODEID)"
        )
    if not 0 <= options.replica_group <= MAX_GROUP_ID:
        raise LaunchError(f"--replica-group {options.replica_group} must be between 0 and {MAX_GROUP_ID}")
    if options.replica_groups != 1:
        raise LaunchError(
            "--replica-groups needs a Lighthouse of its own (no --lighthouse): with --lighthouse "
            "each launch is one group; start one launch per group"
        )
    if not _is_loopback(host) and (options.node_addr is None or _is_loopback(options.node_addr)):
        raise LaunchError(
            f"--lighthouse {options.lighthouse} is on another host: pass --node-addr, this node's address that "
            "the other groups reach this group's servers on (not loopback)"
        )


def _is_loopback(host: str) -> bool:
    return host.startswith("127.") or host in _LOOPBACK_NAMES


def group_plan(options: LaunchOptions) -> list[LaunchOptions]:
    """Each replica group this launch runs, as the options of a one-group launch (lighthouse and id set)."""
    workers, _ = workers_here(options.nproc_per_node)
    if options.lighthouse is not None:
        return [dataclasses.replace(options, nproc_per_node=str(workers))]
    count = options.replica_groups
    if workers % count:
        raise LaunchError(f"--replica-groups {count} does not divide the {workers} workers of --nproc-per-node")
    each = str(workers // count)
    return [
        dataclasses.replace(options, nproc_per_node=each, replica_groups=1, replica_group=group, lighthouse="")
        for group in range(count)
    ]


def group_command(group: LaunchOptions, lighthouse: str) -> tuple[dict[str, str], list[str]]:
    """(environment additions, torchrun arguments) of one group's agent: a local rendezvous and ft_env's variables
    (its store's address, the node's or loopback, is also the one the group's torchft servers bind)."""
    env, argv = torchrun_command(dataclasses.replace(group, fault_tolerance=None, lighthouse=None))
    env[LIGHTHOUSE_ENV] = f"http://{lighthouse}"
    env[REPLICA_GROUP_ENV] = str(group.replica_group)
    return env, argv


def launch_in_place(options: LaunchOptions) -> int:
    """Run this launch's replica group(s) until they end (or print their torchrun lines); the job's exit code."""
    groups = group_plan(options)
    note = workers_here(options.nproc_per_node)[1]
    if options.dry_run:
        if note:
            say(note)
        _print_dry_run(options, groups)
        return EXIT_OK
    if options.lighthouse is None:
        return _run_local_job(options, groups)
    _stop_with_supervisor()
    env, argv = group_command(groups[0], options.lighthouse)
    return run_job(groups[0], env, argv, note)


def _print_dry_run(options: LaunchOptions, groups: list[LaunchOptions]) -> None:
    lighthouse = options.lighthouse or f"{LOOPBACK}:PORT"
    if options.lighthouse is None:
        print(
            f"# a Lighthouse on {LOOPBACK}, a free port (PORT), min replicas {DEFAULTS.min_replicas}, heartbeat "
            f"timeout {DEFAULTS.heartbeat_timeout_ms} ms, for the job's lifetime; one launch per group:"
        )
    for group in groups:
        env, argv = group_command(group, lighthouse)
        print(f"# replica group {group.replica_group}")
        print(shlex.join([*(f"{k}={v}" for k, v in env.items()), "torchrun", *argv]))
    env, _ = group_command(groups[0], lighthouse)
    print(beyond_torchrun(groups[0], env) + ", restarts are per replica group")


def _run_local_job(options: LaunchOptions, groups: list[LaunchOptions]) -> int:
    """Serve a Lighthouse on loopback and run one launch per group under it until all have ended."""
    stops = [signal.Signals[name.strip()] for name in options.signals_to_handle.split(",")]
    server = serve_lighthouse((LOOPBACK, 0), DEFAULTS, stops)
    lighthouse = f"{LOOPBACK}:{served_port(server)}"
    say(f"Lighthouse serving on http://{lighthouse}; {len(groups)} replica group(s)")
    env = {**os.environ, SUPERVISOR_ENV: str(os.getpid())}
    procs: list[subprocess.Popen[bytes]] = []
    first: list[signal.Signals] = []

    def forward(signum: int, frame: Any) -> None:
        first.append(signal.Signals(signum))
        for proc in procs:  # each leads a session of its own: the terminal's signals reach this launch only
            if proc.poll() is None:
                proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in stops}
    try:
        for group in groups:
            argv = to_argv(dataclasses.replace(group, lighthouse=lighthouse))
            proc = subprocess.Popen(
                [sys.executable, "-m", "ddptrain", "launch", *argv], env=env, start_new_session=True
            )
            procs.append(proc)
            if first:  # a stop signal came while the groups were being started: this one stops too
                proc.send_signal(first[0])
        codes = [_wait_group(proc, group) for proc, group in zip(procs, groups, strict=True)]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        server.shutdown()
    return groups_exit_code(codes, first[0] if first else None, options.preempted_exit_code)


def _wait_group(proc: subprocess.Popen[bytes], group: LaunchOptions) -> int:
    code = proc.wait()
    if code != EXIT_OK:
        say(f"replica group {group.replica_group} ended with exit code {code}")
    return code


def groups_exit_code(codes: list[int], stopped_by: signal.Signals | None, preempted_exit_code: int) -> int:
    """The job's exit code from its groups' launches: launcher.py's rules, a preemption exiting
    --preempted-exit-code, and 128+N after stop signal N unless the groups stopped cleanly."""
    code = exit_code_for([EXIT_PREEMPTED if c == preempted_exit_code else c for c in codes])
    if stopped_by is not None and code not in (EXIT_PREEMPTED, EXIT_INTERRUPTED, EXIT_USAGE, EXIT_LEASE_LOST):
        return 128 + int(stopped_by)
    return preempted_exit_code if code == EXIT_PREEMPTED else code


def _stop_with_supervisor() -> None:
    """A one-group launch started by a local job stops (SIGTERM, a coordinated stop) when that job's launcher,
    which serves the Lighthouse, dies: without it the group could only stall."""
    supervisor = os.environ.pop(SUPERVISOR_ENV, None)
    if supervisor is None:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(supervisor):  # it died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)
