"""What a scheduler job definition (sbatch script, PyTorchJob manifest) needs from a run config.

Both generators start every node with the same `ddptrain launch ... -- train -c CONFIG` line and
rely on the same contract: the resolved config is frozen into a file next to the job definition,
`ckpt.resume=auto` makes a restarted job continue from the newest committed checkpoint in the same
`run.dir`, and the scheduler gives the job enough time between its stop signal and its kill to
finish the current step, commit a checkpoint and shut the launcher down.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from ddptrain.checks import script_text
from ddptrain.cli_options import option
from ddptrain.config import MAX_TIMEOUT_S, Config, load_config
from ddptrain.errors import ConfigError, UserError
from ddptrain.etcd_endpoints import format_endpoints, parse_endpoints

EXIT_USAGE = UserError.exit_code  # bad input: `ddptrain launch` ends with it, a retry cannot help
# The etcd rendezvous that generated jobs use with an existing etcd cluster: torch's current one,
# the same state machine and keep-alives as c10d.
ETCD_BACKEND = "etcd-v2"
# Slack for the workers on top of the user's step and save estimates (signal delivery, agreement).
_WORKER_MARGIN_S = 10
# Slack for what follows the workers' exit: the launcher's exit, the rendezvous close, srun or the pod.
_LAUNCHER_MARGIN_S = 20


@dataclass(frozen=True)
class JobSpec:
    """What every scheduler's job is made of (each field a `ddptrain slurm`/`k8s` option): the config it
    trains, its nodes and ranks, and the estimates its stop window is sized from.

    A subclass says in `node` what one `ddptrain launch` runs on (a node, a pod): the help texts name it.
    """

    node: ClassVar[str] = "node"

    config: str | None = option(None, "YAML config file (frozen into the job definition)", short="-c")
    overrides: tuple[str, ...] = option((), "dotted overrides, e.g. train.max_steps=100", positional=True, repeat=True)
    nodes: int = option(1, "{node}s (one `ddptrain launch` each)")
    gpus_per_node: int = option(0, "GPUs per {node} (0: CPU only)")
    nproc_per_node: int | None = option(None, "ranks per {node} (default: --gpus-per-node, else 1)", parse=int)
    fault_tolerance: str | None = option(
        None,
        "torchft: in-place recovery (docs/multinode.md): each {node} is a replica group, a lost one leaves the "
        "others training; a Lighthouse runs beside the job",
        choices=("torchft",),
    )
    step_s: float = option(30.0, "longest optimizer step, for the stop window", flag="--step-seconds")
    save_s: float = option(60.0, "time to commit one checkpoint, for the stop window", flag="--save-seconds")

    @property
    def procs(self) -> int:
        """Ranks per node: as given, else one per GPU, else one."""
        return self.nproc_per_node or self.gpus_per_node or 1

    def load_config(self) -> Config:
        """The config the job will train with (checked: a restart must resume)."""
        return load_job_config(self.config, self.overrides)

    def check_fault_tolerance(self, min_nodes: int | None, rendezvous: str | None, flag: str) -> None:
        """Refuse what the in-place mode has no use for: an elastic minimum or a rendezvous service (the groups'
        membership is torchft's; each launch meets only its own ranks)."""
        if self.fault_tolerance is None:
            return
        if min_nodes is not None:
            raise ConfigError(
                f"--min-nodes is for the restart mode: with --fault-tolerance torchft any {self.node} "
                "may be lost and the others train on"
            )
        if rendezvous is not None:
            raise ConfigError(
                f"{flag} is for the restart mode: with --fault-tolerance torchft each {self.node}'s ranks "
                f"meet on their {self.node} and the {self.node}s meet at the Lighthouse"
            )

    def worker_stop_s(self) -> int:
        """Seconds the workers get after a stop signal (launch --shutdown-timeout): finish a step, commit."""
        if not all(math.isfinite(t) and 0 < t <= MAX_TIMEOUT_S for t in (self.step_s, self.save_s)):
            raise ConfigError(
                f"--step-seconds ({self.step_s}) and --save-seconds ({self.save_s}) must be positive, finite "
                "and at most a week"
            )
        return math.ceil(self.step_s + self.save_s) + _WORKER_MARGIN_S

    def stop_budget_s(self) -> int:
        """Seconds a job needs from its stop signal to a clean exit 75, launcher included."""
        return self.worker_stop_s() + _LAUNCHER_MARGIN_S

    def check_ranks(self, cfg: Config, min_nodes: int) -> None:
        """Refuse ranks that leave GPUs idle or share one, or a global batch that does not split over every
        world size the job may run at (min_nodes to nodes)."""
        if self.nproc_per_node is not None and self.gpus_per_node and self.nproc_per_node != self.gpus_per_node:
            raise ConfigError(
                f"--nproc-per-node {self.nproc_per_node} with --gpus-per-node {self.gpus_per_node}: each rank "
                "drives one GPU, so they must be equal (leave --nproc-per-node out to use the GPU count)"
            )
        for n in range(min_nodes, self.nodes + 1):
            try:
                cfg.check_world_size(n * self.procs, self.procs)
            except ConfigError as e:
                raise ConfigError(f"at {n} node(s) x {self.procs} process(es): {e}") from None


def load_job_config(config: str | None, overrides: Sequence[str]) -> Config:
    """Load and validate the config a scheduled job will train with; a restart must resume."""
    cfg = load_config(config, list(overrides))
    if cfg.ckpt.resume != "auto":
        raise ConfigError(
            f"ckpt.resume={cfg.ckpt.resume!r}: a scheduled job is restarted after preemption and must continue "
            "from its newest checkpoint; use ckpt.resume=auto"
        )
    check_config_texts(cfg)
    return cfg


def check_config_texts(cfg: Config) -> None:
    """The config values a job definition names (in comments, paths and names): one line of printable text."""
    script_text("run.name", cfg.run.name)
    if cfg.run.dir is not None:
        script_text("run.dir", cfg.run.dir)
    script_text("data.dir", cfg.data.dir)


def check_stop_window(window_s: int, needed_s: int, what: str) -> None:
    """Refuse a stop window (signal lead time, grace period) shorter than the stop budget."""
    if window_s < needed_s:
        raise ConfigError(
            f"{what}={window_s} s is shorter than the {needed_s} s needed to finish a step, commit a "
            "checkpoint and shut down (step + save + shutdown + margin); raise it or lower the estimates"
        )


def launch_argv(
    *,
    nnodes: str,
    nproc_per_node: str,
    endpoint: str | None,
    run_id: str | None,
    node_addr: str | None,
    max_restarts: int,
    shutdown_s: int,
    config_path: str,
    preempted_exit_code: int | None = None,
    rdzv_backend: str | None = None,
    lighthouse: tuple[str, str] | None = None,
) -> list[str]:
    """The `launch ... -- train -c CONFIG` arguments every node of a job runs (after `ddptrain`).

    Without an endpoint (one node) the launcher hosts a local rendezvous on a free port; with
    rdzv_backend etcd-v2 the endpoint is the etcd cluster's members. `lighthouse`: (HOST:PORT, this
    node's replica group id) of the in-place mode.
    """
    argv = ["launch"]
    if lighthouse is not None:
        argv += ["--fault-tolerance", "torchft", "--lighthouse", lighthouse[0], "--replica-group", lighthouse[1]]
    argv += ["--nnodes", nnodes, "--nproc-per-node", nproc_per_node]
    if rdzv_backend is not None:
        argv += ["--rdzv-backend", rdzv_backend]
    for flag, value in (("--rdzv-endpoint", endpoint), ("--run-id", run_id), ("--node-addr", node_addr)):
        if value is not None:
            argv += [flag, value]
    argv += ["--max-restarts", str(max_restarts), "--shutdown-timeout", str(shutdown_s)]
    if preempted_exit_code is not None:
        argv += ["--preempted-exit-code", str(preempted_exit_code)]
    return [*argv, "--", "train", "-c", config_path]


def etcd_endpoints(flag: str, value: str | None) -> str | None:
    """The etcd members of `flag` in launch's canonical form (checked now, exit 2), or None without etcd."""
    return None if value is None else format_endpoints(parse_endpoints(flag, value))
