"""The run folder's layout: every name in run.dir spelled here once, and the one way to read a run's config back.

| entry | written by | read by |
|---|---|---|
| `config.yaml` | run.py (rank 0, when the run is accepted) | verify-resume (rebuilds the run), report (name, max_steps) |
| `metrics.jsonl` | observe/metrics.py (rank 0 appends) | report, the trackers' backlog at a restart |
| `certificate.jsonl` | observe/certificate.py (rank 0, logged steps) | verify-resume |
| `trackers.json` | observe/trackers/state.py (rank 0) | the trackers at the next start |
| `.lease` | checkpoint/lease.py (rank 0 holds it while training) | the next run on the folder (taken over once its owner is dead) |
| `.lease.group<N>` | checkpoint/lease.py (replica group N's rank 0, in-place mode) | the other modes' runs (refused while it is live), stale temp folders' cleanup |
| `checkpoints/` | checkpoint/ (the checkpointer) | resume, eval, export, generate, verify-resume, report, model.init_from |
| `logs/rank-<r>.log` | observe/runlog.py (every rank) | people |
| `stacks/` | the watchdog and hang triage (observe/triage.py, forensics.py), the replica check | `ddptrain triage` (review/verdict.py) |
| `report/` | `ddptrain report`, log.track_artifacts | people, the trackers |
| `export/` | log.track_artifacts=[model] | the trackers |
| `tensorboard/` | the TensorBoard sink | TensorBoard |
| `verify-resume/from-<step>/` | verify-resume (a run folder of its own) | people |
| `slurm/<submission>/` | `ddptrain slurm` (a frozen config.yaml and job.sbatch) | the SLURM job |

(W&B offline writes its own `wandb/` there.) Names inside `checkpoints/` and `stacks/` belong to their writers
(checkpoint/manifest.py, observe/forensics.py).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ddptrain.config import Config, saved_config
from ddptrain.config_io import read_yaml_mapping
from ddptrain.errors import ConfigError

LEASE = ".lease"  # a lock file's name in the folder (ddptrain.lockfile takes a folder and a name)
_GROUP_LEASE = re.compile(re.escape(LEASE) + r"\.group[0-9]{1,6}")


def group_lease(group: int) -> str:
    """The lease file's name of replica group `group` in the in-place mode (each group holds its own)."""
    return f"{LEASE}.group{group}"


def lease_files(run_dir: Path) -> tuple[Path | None, list[Path]]:
    """The run lease (None when absent) and the replica groups' leases present in run.dir (sorted)."""
    try:
        names = sorted(entry.name for entry in run_dir.iterdir())
    except OSError:
        return None, []
    groups = [run_dir / name for name in names if _GROUP_LEASE.fullmatch(name)]
    return (run_dir / LEASE if LEASE in names else None), groups


def config_file(folder: Path) -> Path:
    """run.dir/config.yaml: the run's resolved config (and the frozen copy in each SLURM submission folder)."""
    return folder / "config.yaml"


def metrics_file(run_dir: Path) -> Path:
    """run.dir/metrics.jsonl: one JSON record per line, appended by rank 0."""
    return run_dir / "metrics.jsonl"


def certificate_file(run_dir: Path) -> Path:
    """run.dir/certificate.jsonl: the resume certificate, one record per logged step."""
    return run_dir / "certificate.jsonl"


def trackers_file(run_dir: Path) -> Path:
    """run.dir/trackers.json: which tracker runs this folder feeds, and how far each got."""
    return run_dir / "trackers.json"


def checkpoints_dir(run_dir: Path) -> Path:
    """run.dir/checkpoints: the committed checkpoints (and their archive)."""
    return run_dir / "checkpoints"


def rank_log(run_dir: Path, rank: int) -> Path:
    """run.dir/logs/rank-<rank>.log: that rank's log lines."""
    return run_dir / "logs" / f"rank-{rank}.log"


def stacks_dir(run_dir: Path) -> Path:
    """run.dir/stacks: what a hang or a replica divergence left for `ddptrain triage`."""
    return run_dir / "stacks"


def report_dir(run_dir: Path) -> Path:
    """run.dir/report: `ddptrain report`'s plots and summary.txt."""
    return run_dir / "report"


def export_dir(run_dir: Path) -> Path:
    """run.dir/export: the finished run's model exported for the trackers (log.track_artifacts)."""
    return run_dir / "export"


def tensorboard_dir(run_dir: Path) -> Path:
    """run.dir/tensorboard: the TensorBoard sink's event files."""
    return run_dir / "tensorboard"


def replay_dir(run_dir: Path, step: int) -> Path:
    """run.dir/verify-resume/from-<step>: the scratch run folder of verify-resume's replay from that step."""
    return run_dir / "verify-resume" / f"from-{step}"


def slurm_dir(run_dir: Path) -> Path:
    """run.dir/slurm: one folder per SLURM submission."""
    return run_dir / "slurm"


def read_config_sections(run_dir: Path) -> dict[str, Any]:
    """run.dir/config.yaml's sections as stored, within config_io's bounds but not validated: a run written by an
    older ddptrain may hold keys this one refuses. ConfigError (exit 2, one line naming the file) when it is
    missing, not a regular file, too big, not UTF-8, not YAML or not a mapping."""
    return read_yaml_mapping(config_file(run_dir), "config file")


def read_config(run_dir: Path, overrides: list[str] | None = None) -> Config:
    """run.dir/config.yaml validated as a Config after the dotted overrides; ConfigError (exit 2, one line
    naming the file) when it cannot be read or is not a valid config."""
    sections = read_config_sections(run_dir)
    try:
        return saved_config(sections, overrides)
    except ConfigError as e:
        raise ConfigError(f"{config_file(run_dir)}: {e}") from None
