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

from ddptrain.config import Config, load_config
from ddptrain.errors import ConfigError, UserError

EXIT_USAGE = UserError.exit_code  # bad input: `ddptrain launch` ends with it, a retry cannot help
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
    return cfg


def worker_stop_s(step_s: float, save_s: float) -> int:
    """Seconds the workers get after a stop signal (launch --shutdown-timeout): finish a step, commit."""
    if step_s <= 0 or save_s <= 0:
        raise ConfigError(f"step ({step_s}) and checkpoint save ({save_s}) times must be positive")
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


def launch_argv(*, nnodes: str, nproc_per_node: str, endpoint: str, run_id: str, node_addr: str,
                max_restarts: int, shutdown_s: int, config_path: str) -> list[str]:
    """The `launch ... -- train -c CONFIG` arguments every node of a job runs (after `ddptrain`)."""
    return [
        "launch", "--nnodes", nnodes, "--nproc-per-node", nproc_per_node,
        "--rdzv-endpoint", endpoint, "--run-id", run_id, "--node-addr", node_addr,
        "--max-restarts", str(max_restarts), "--shutdown-timeout", str(shutdown_s),
        "--", "train", "-c", config_path,
    ]
