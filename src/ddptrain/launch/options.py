"""The options of `ddptrain launch`, declared once: each field is a flag, its default and its help.

`LaunchOptions` is what `ddptrain launch` parses (cli_options derives the parser from it) and what
the Python API passes to `ddptrain.commands.launch.launch`; the SLURM and Kubernetes generators
take their restart budget's default from it. `check` refuses bad values before anything starts.
"""

from __future__ import annotations

import math
import signal
from dataclasses import dataclass

from ddptrain.cli_options import option
from ddptrain.config import MAX_TIMEOUT_S
from ddptrain.errors import EXIT_FAILURE, EXIT_PREEMPTED, EXIT_USAGE, LaunchError
from ddptrain.etcd_endpoints import ETCD_BACKENDS
from ddptrain.launch.rdzv_conf import parse_rdzv_conf
from ddptrain.launch.worker_start import WORKER_STARTS, is_script

EXIT_OK = 0
DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


@dataclass(frozen=True)
class LaunchOptions:
    """This node's share of a job: the nodes, the rendezvous, the restart and stop policies, the worker command."""

    nnodes: str = option("1", "nodes in the job, or MIN:MAX to keep training while MIN remain")
    nproc_per_node: str = option(
        "auto",
        "workers on this node: a number, or auto = one per GPU, else one (using every CPU through threads)",
    )
    rdzv_backend: str = option(
        "c10d",
        "c10d: a node hosts the rendezvous (losing it ends the job); etcd-v2 or etcd: an existing etcd "
        "cluster does, and any node may be lost (needs the etcd extra; docs/multinode.md)",
        choices=("c10d", *ETCD_BACKENDS),
    )
    rdzv_endpoint: str | None = option(
        None,
        "c10d: HOST:PORT of the rendezvous, the same on every node; the node whose --node-addr is HOST hosts "
        "it. etcd: HOST[:PORT],... of the etcd members (port 2379 when left out)",
    )
    node_addr: str | None = option(
        None,
        "address this node advertises to the others (and the one gloo uses); default: torchrun's hostname lookup",
    )
    run_id: str | None = option(
        None,
        "rendezvous id, the same on every node (default: derived from --rdzv-endpoint; "
        "required with etcd, which jobs share)",
    )
    max_restarts: int = option(3, "worker-group restarts after failures, counted per node")
    rdzv_timeout: int = option(600, "seconds for all nodes to join a rendezvous before giving up")
    rdzv_last_call: int = option(10, "with MIN:MAX nodes: seconds to wait for more nodes once MIN have joined")
    rdzv_conf: str = option(
        "",
        "more rendezvous options, KEY=VALUE,... (e.g. keep_alive_interval=5,read_timeout=60; checked per backend)",
    )
    shutdown_timeout: int = option(30, "seconds workers get to stop (and checkpoint) after a signal before SIGKILL")
    exit_barrier_timeout: float = option(60.0, "seconds a finished node waits for the others (default {default:g})")
    signals_to_handle: str = option(DEFAULT_SIGNALS, "signals forwarded to the workers")
    monitor_interval: float = option(0.1, "seconds between checks of the workers")
    preempted_exit_code: int = option(
        EXIT_PREEMPTED,
        "exit code for 'preempted, checkpoint committed' (default {default}; a Kubernetes job uses 143 "
        "so that the operator's ExitCode policy restarts it)",
    )
    worker_start: str = option(
        "preloaded",
        "preloaded: fork workers from a server that imported torch once (restarts skip seconds of imports); "
        "exec: a fresh interpreter per worker, as torchrun does",
        choices=WORKER_STARTS,
    )
    fault_tolerance: str | None = option(
        None,
        "torchft: in-place recovery (docs/multinode.md): this launch's workers are one replica group (or "
        "--replica-groups) whose loss leaves the other groups training; restarts are per group",
        choices=("torchft",),
    )
    lighthouse: str | None = option(
        None,
        "with --fault-tolerance torchft: HOST:PORT of the job's Lighthouse (`ddptrain lighthouse`); "
        "without it a one-node job starts its own on 127.0.0.1",
    )
    replica_group: int | None = option(
        None, "with --lighthouse: this launch's replica group id, distinct per launch (e.g. $SLURM_NODEID)", parse=int
    )
    replica_groups: int = option(
        1, "with --fault-tolerance torchft and no --lighthouse: replica groups to split this node's workers into"
    )
    dry_run: bool = option(False, "print the equivalent torchrun command and exit")
    worker_command: tuple[str, ...] = option(
        (),
        "after --: the ddptrain command each worker runs, e.g. train -c cfg.yaml, or a Python script and its "
        "arguments (script.py ARGS: run as torchrun runs one, e.g. a ddptrain.train() script)",
        remainder=True,
    )

    def check_exit_code(self) -> None:
        """--preempted-exit-code is one a scheduler can tell from the others; LaunchError otherwise."""
        code = self.preempted_exit_code
        if not 0 < code < 256 or code in (EXIT_OK, EXIT_FAILURE, EXIT_USAGE):
            raise LaunchError(f"--preempted-exit-code {code} must be 3-255 (0, 1 and 2 mean something else)")

    def command(self) -> list[str]:
        """The ddptrain command each worker runs (what follows `--`); LaunchError when there is none."""
        if not self.worker_command:
            raise LaunchError(
                "nothing to launch: add the worker command after --, e.g. ddptrain launch ... -- train -c cfg.yaml "
                "(or -- script.py ARGS)"
            )
        return list(self.worker_command)

    def worker_argv(self) -> list[str]:
        """What torchrun runs in each worker: `-m ddptrain COMMAND...`, or `SCRIPT ARGS...` for a Python script."""
        command = self.command()
        return command if is_script(command[0]) else ["-m", "ddptrain", *command]

    def check_numbers(self) -> None:
        """Every number within its range, every signal a signal, every --rdzv-conf item known (exit 2 naming it)."""
        checks = [
            ("--max-restarts", self.max_restarts, 0),
            ("--rdzv-timeout", self.rdzv_timeout, 1),
            ("--rdzv-last-call", self.rdzv_last_call, 0),
            ("--shutdown-timeout", self.shutdown_timeout, 0),
            ("--exit-barrier-timeout", self.exit_barrier_timeout, 0),
            ("--monitor-interval", self.monitor_interval, 0.01),
        ]
        for flag, value, least in checks:
            if not (math.isfinite(value) and least <= value <= MAX_TIMEOUT_S):
                raise LaunchError(
                    f"{flag} {value} must be a finite number between {least} and {MAX_TIMEOUT_S:g} (a week)"
                )
        for name in self.signals_to_handle.split(","):
            if name.strip() not in signal.Signals.__members__:
                raise LaunchError(f"--signals-to-handle: {name.strip()!r} is not a signal name (e.g. SIGTERM,SIGINT)")
        parse_rdzv_conf(self.rdzv_backend, self.rdzv_conf)  # every key and value, for --dry-run too

    @property
    def etcd(self) -> bool:
        """Whether the rendezvous lives in an etcd cluster (not on a node of the job)."""
        return self.rdzv_backend in ETCD_BACKENDS


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
