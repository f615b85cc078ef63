"""`ddptrain slurm`: an sbatch script that runs one `ddptrain launch` per node and survives preemption.

The script (see docs/clusters.md for a generated one) asks SLURM for `--signal=B:USR1@N` and
`--requeue`. SLURM sends USR1 to the batch shell N seconds before the time limit (or an operator
sends it with `scancel --signal=USR1 --batch`); the shell forwards it to the job step, every node's
launcher stops all ranks at one step, commits a checkpoint and exits 75. The shell then requeues
its own job; the requeued job (same job id, so the same rendezvous id) resumes from the newest
checkpoint in the same run.dir. Exit 2 (bad input) is final: the same input would fail again.
Any other non-zero exit is a crash: requeued at most `max_requeues` times (counted in a file in
run.dir, so preemptions do not use up the budget).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ddptrain.config import Config
from ddptrain.errors import ConfigError, LaunchError
from ddptrain.jobspec import EXIT_USAGE, check_stop_window, launch_argv, stop_budget_s, worker_stop_s
from ddptrain.preemption import EXIT_PREEMPTED

_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")


@dataclass(frozen=True)
class SlurmJob:
    """The resources and policies of one sbatch job (one launcher task per node)."""

    nodes: int = 1
    nproc_per_node: str = "auto"
    cpus_per_node: int | None = None
    gpus_per_node: int = 0
    mem: str | None = None
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    job_name: str | None = None
    signal_s: int = 180
    max_requeues: int = 3
    max_restarts: int = 3
    rdzv_port: int = 29500
    step_s: float = 30.0
    save_s: float = 60.0
    python: str = sys.executable
    extra_sbatch: tuple[str, ...] = ()

    def validate(self) -> None:
        """Refuse values SLURM would reject late, or that break preemption."""
        if self.nodes < 1:
            raise ConfigError(f"--nodes must be at least 1, got {self.nodes}")
        if self.nproc_per_node != "auto" and not (self.nproc_per_node.isdigit() and int(self.nproc_per_node) > 0):
            raise ConfigError(f"--nproc-per-node must be a positive integer or 'auto', got {self.nproc_per_node!r}")
        if self.time is not None and not _TIME.match(self.time):
            raise ConfigError(f"--time {self.time!r} is not a SLURM time (MM, HH:MM:SS or D-HH:MM:SS)")
        if self.max_requeues < 0 or self.max_restarts < 0:
            raise ConfigError("--max-requeues and --max-restarts must be >= 0")
        if not 0 < self.rdzv_port < 65536:
            raise ConfigError(f"--rdzv-port {self.rdzv_port} is not a TCP port")
        check_stop_window(self.signal_s, stop_budget_s(self.step_s, self.save_s), "--signal-seconds")


def _bash_word(arg: str) -> str:
    """Quote one argument for bash, except `$NAME` references, which are expanded (double-quoted)."""
    return f'"{arg}"' if re.fullmatch(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?", arg) else shlex.quote(arg)


def render_script(cfg: Config, job: SlurmJob, config_path: Path, workdir: Path) -> str:
    """The sbatch script text for this config and job."""
    job.validate()
    run_dir = (workdir / cfg.run_dir).resolve()
    name = job.job_name or f"ddptrain-{cfg.run.name}"
    directives = [
        f"--job-name={name}",
        f"--nodes={job.nodes}",
        "--ntasks-per-node=1",  # one `ddptrain launch` per node; it starts the ranks itself
    ]
    if job.cpus_per_node:
        directives.append(f"--cpus-per-task={job.cpus_per_node}")
    if job.gpus_per_node:
        directives.append(f"--gpus-per-node={job.gpus_per_node}")
    for flag, value in (("mem", job.mem), ("time", job.time), ("partition", job.partition), ("account", job.account)):
        if value:
            directives.append(f"--{flag}={value}")
    directives += [
        f"--chdir={workdir.resolve()}",
        f"--output={run_dir}/slurm/%x-%j.out",
        "--open-mode=append",  # a requeued job appends to the same log
        f"--signal=B:USR1@{job.signal_s}",
        "--requeue",
        *job.extra_sbatch,
    ]
    # With GPUs, say how many ranks: `auto` would be right too, but the script should show it.
    nproc = str(job.gpus_per_node) if job.nproc_per_node == "auto" and job.gpus_per_node else job.nproc_per_node
    argv = launch_argv(
        nnodes=str(job.nodes), nproc_per_node=nproc, endpoint="$RDZV_ENDPOINT",
        run_id="$SLURM_JOB_ID", node_addr="$addr", max_restarts=job.max_restarts,
        shutdown_s=worker_stop_s(job.step_s, job.save_s), config_path=str(config_path),
    )
    node_cmd = (
        'addr=$(scontrol show node "$SLURMD_NODENAME" | grep -o "NodeAddr=[^ ]*" | cut -d= -f2); '
        + "exec " + " ".join(_bash_word(a) for a in [job.python, "-m", "ddptrain", *argv])
    )
    header = "\n".join(f"#SBATCH {d}" for d in directives)
    return _TEMPLATE.format(
        header=header, run=cfg.run.name, run_dir=shlex.quote(str(run_dir)), max_requeues=job.max_requeues,
        port=job.rdzv_port, nodes=job.nodes, node_cmd=shlex.quote(node_cmd), preempted=EXIT_PREEMPTED,
        usage=EXIT_USAGE,
        # srun does not inherit --cpus-per-task from sbatch (SLURM >= 22.05): without it each
        # node's launcher and all its ranks would share one CPU.
        srun_cpus=f" --cpus-per-task={job.cpus_per_node}" if job.cpus_per_node else "",
    )


_TEMPLATE = """\
#!/bin/bash
# Generated by `ddptrain slurm` for run {run}. Submit with: sbatch THIS_FILE
{header}

# Preemption (USR1, forwarded below) makes every node commit a checkpoint and exit {preempted};
# this script then requeues the job, which resumes from the newest checkpoint (ckpt.resume=auto).
# Bad input (exit {usage}) is never requeued; crashes (any other non-zero exit) at most MAX_REQUEUES times.
set -u
RUN_DIR={run_dir}
MAX_REQUEUES={max_requeues}
CRASHES_FILE="$RUN_DIR/slurm/crashes-$SLURM_JOB_ID"

# The first node of the allocation hosts the rendezvous; use its SLURM NodeAddr so that no
# hostname has to resolve. The rendezvous id is the job id, which a requeued job keeps.
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
HEAD_ADDR=$(scontrol show node "$HEAD_NODE" | grep -o "NodeAddr=[^ ]*" | cut -d= -f2)
export RDZV_ENDPOINT="$HEAD_ADDR:{port}"
echo "ddptrain-slurm: job $SLURM_JOB_ID restart ${{SLURM_RESTART_COUNT:-0}} on $SLURM_JOB_NODELIST, rendezvous $RDZV_ENDPOINT, $(date -u +%FT%T.%3N%:z)"

# The step runs in the background so that bash can run the USR1 trap while it waits.
step_pid=""
interrupted=0
forward_usr1() {{
    interrupted=1
    echo "ddptrain-slurm: USR1 received at $(date -u +%FT%T.%3N%:z), forwarding to the job step"
    [ -n "$step_pid" ] && kill -USR1 "$step_pid"
}}
trap forward_usr1 USR1

srun --nodes={nodes} --ntasks-per-node=1{srun_cpus} --kill-on-bad-exit=0 bash -c {node_cmd} &
step_pid=$!
while :; do
    interrupted=0
    wait "$step_pid"
    rc=$?
    [ "$interrupted" = 1 ] || break  # a trap interrupted wait: the step is still running
done

if [ "$rc" = 0 ]; then
    echo "ddptrain-slurm: training finished"
    exit 0
fi
if [ "$rc" = {preempted} ]; then
    echo "ddptrain-slurm: preempted, checkpoint committed; requeueing job $SLURM_JOB_ID at $(date -u +%FT%T.%3N%:z)"
    scontrol requeue "$SLURM_JOB_ID" && exit {preempted}
    echo "ddptrain-slurm: scontrol requeue failed; resubmit this script to resume" >&2
    exit {preempted}
fi
if [ "$rc" = {usage} ]; then
    echo "ddptrain-slurm: bad input (exit code {usage}, the error is above); not requeued" >&2
    exit "$rc"
fi
crashes=$(( $(cat "$CRASHES_FILE" 2>/dev/null || echo 0) + 1 ))
echo "$crashes" > "$CRASHES_FILE"
if [ "$crashes" -le "$MAX_REQUEUES" ]; then
    echo "ddptrain-slurm: step failed with exit code $rc; requeueing (requeue $crashes of at most $MAX_REQUEUES after crashes)"
    scontrol requeue "$SLURM_JOB_ID" && exit "$rc"
fi
echo "ddptrain-slurm: step failed with exit code $rc after $((crashes - 1)) requeues; giving up" >&2
exit "$rc"
"""


def write_script(cfg: Config, job: SlurmJob, out: Path | None = None) -> Path:
    """Freeze the config into run.dir/slurm/config.yaml and write the sbatch script beside it."""
    workdir = Path.cwd()
    slurm_dir = (workdir / cfg.run_dir).resolve() / "slurm"
    slurm_dir.mkdir(parents=True, exist_ok=True)
    config_path = slurm_dir / "config.yaml"
    config_path.write_text(cfg.to_yaml())
    script = out or slurm_dir / "job.sbatch"
    script.write_text(render_script(cfg, job, config_path, workdir))
    script.chmod(0o755)
    return script


def submit(script: Path) -> str:
    """`sbatch --parsable SCRIPT`; returns the job id."""
    try:
        proc = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise LaunchError("sbatch not found: run `ddptrain slurm --submit` on a SLURM login node") from None
    if proc.returncode != 0:
        raise LaunchError(f"sbatch rejected {script}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout.strip().split(";")[0]

