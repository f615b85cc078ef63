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

from ddptrain.checks import script_text
from ddptrain.config import Config, load_config
from ddptrain.errors import ConfigError, UserError
from ddptrain.launch.etcd_endpoints import format_endpoints, parse_endpoints

EXIT_USAGE = UserError.exit_code  # bad input: `ddptrain launch` ends with it, a retry cannot help
# The etcd rendezvous that generated jobs use with an existing etcd cluster: torch's current one,
# the same state machine and keep-alives as c10d.
ETCD_BACKEND = "etcd-v2"
# Slack for the workers on top of the user's step and save estimates (signal delivery, agreement).
_WORKER_MARGIN_S = 10
# Slack for what follows the workers' exit: the launcher's exit, the rendezvous close, srun or the pod.
_LAUNCHER_MARGIN_S = 20


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


def worker_stop_s(step_s: float, save_s: float) -> int:
    """Seconds the workers get after a stop signal (launch --shutdown-timeout): finish a step, commit."""
    if not all(math.isfinite(t) and 0 < t <= 7 * 24 * 3600 for t in (step_s, save_s)):
        raise ConfigError(
            f"--step-seconds ({step_s}) and --save-seconds ({save_s}) must be positive, finite and at most a week"
        )
    return math.ceil(step_s + save_s) + _WORKER_MARGIN_S


def stop_budget_s(step_s: float, save_s: float) -> int:
    """Seconds a job needs from its stop signal to a clean exit 75, launcher included."""
    return worker_stop_s(step_s, save_s) + _LAUNCHER_MARGIN_S


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
) -> list[str]:
    """The `launch ... -- train -c CONFIG` arguments every node of a job runs (after `ddptrain`).

    Without an endpoint (one node) the launcher hosts a local rendezvous on a free port; with
    rdzv_backend etcd-v2 the endpoint is the etcd cluster's members.
    """
    argv = ["launch", "--nnodes", nnodes, "--nproc-per-node", nproc_per_node]
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


def check_batch_split(cfg: Config, nodes: range, nproc_per_node: int) -> None:
    """Refuse a job whose global batch does not split over every world size it may run at."""
    for n in nodes:
        try:
            cfg.check_world_size(n * nproc_per_node)
        except ConfigError as e:
            raise ConfigError(f"at {n} node(s) x {nproc_per_node} process(es): {e}") from None


def check_procs_vs_gpus(nproc_per_node: int, gpus_per_node: int) -> None:
    """Refuse a process count that leaves GPUs idle or shares one GPU between ranks."""
    if gpus_per_node and nproc_per_node != gpus_per_node:
        raise ConfigError(
            f"--nproc-per-node {nproc_per_node} with --gpus-per-node {gpus_per_node}: each rank drives one GPU, "
            "so they must be equal (leave --nproc-per-node out to use the GPU count)"
        )
