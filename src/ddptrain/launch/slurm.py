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
import secrets
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ddptrain.checks import script_text
from ddptrain.cli_options import option
from ddptrain.config import Config
from ddptrain.data.corpus import corpus_ready
from ddptrain.data.kinds import data_source
from ddptrain.errors import EXIT_PREEMPTED, ConfigError, LaunchError
from ddptrain.launch.jobspec import (
    ETCD_BACKEND,
    EXIT_USAGE,
    JobSpec,
    check_config_texts,
    check_stop_window,
    etcd_endpoints,
    launch_argv,
)
from ddptrain.launch.options import LaunchOptions
from ddptrain.launch.quantities import slurm_mem_mb
from ddptrain.launch.slurm_lighthouse import lighthouse_section
from ddptrain.run_folder import config_file, slurm_dir
from ddptrain.safe_files import ensure_dir, open_new_no_follow, write_text_replace

_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d{1,2}))?(?::(\d{1,2}))?$")
# Per rank unless given, as for `ddptrain k8s`: CPUs for the rank and its data loading, memory (MB).
CPUS_PER_PROC = 4
MEM_GB_PER_PROC = 16
# Without --rdzv-port the port is derived from the job id, so two jobs whose first node is the same
# machine do not collide: PORT_BASE + job id % PORT_SPAN, below Linux's ephemeral range (32768-).
PORT_BASE, PORT_SPAN = 10000, 20000


@dataclass(frozen=True)
class SlurmJob(JobSpec):
    """The resources and policies of one sbatch job (one launcher task per node); each field is an option."""

    min_nodes: int | None = option(
        None, "keep training while this many nodes remain (default --nodes: not elastic)", parse=int
    )
    etcd_endpoints: str | None = option(
        None,
        "rendezvous through an existing etcd cluster, HOST[:PORT],... of its members, instead of on the first "
        "node (losing that node then no longer ends the job; docs/multinode.md)",
    )
    cpus_per_node: int | None = option(
        None, f"CPUs for each node's launcher and its ranks (default {CPUS_PER_PROC} per rank)", parse=int
    )
    mem: str | None = option(None, f"memory per node, e.g. 64G (default {MEM_GB_PER_PROC}G per rank; 0: all of it)")
    time: str | None = option(None, "time limit, e.g. 24:00:00 (default: the partition's)")
    partition: str | None = option(None, "SLURM partition")
    account: str | None = option(None, "SLURM account")
    job_name: str | None = option(None, "job name (default ddptrain-<run.name>)")
    signal_s: int = option(180, "USR1 this long before the time limit", flag="--signal-seconds")
    max_requeues: int = option(3, "requeues after crashes (preemptions are not counted)")
    max_restarts: int = option(LaunchOptions.max_restarts, "in-job worker-group restarts per launch (torchrun)")
    rdzv_port: int | None = option(
        None,
        f"rendezvous port on the first node, the Lighthouse's with --fault-tolerance torchft (default {PORT_BASE} "
        f"+ job id mod {PORT_SPAN})",
        parse=int,
    )
    python: str = option(sys.executable, "interpreter on the nodes (default: this one)")
    extra_sbatch: tuple[str, ...] = option(
        (), "extra #SBATCH directive, e.g. --qos=high (repeatable)", flag="--sbatch-arg", repeat=True
    )

    def cpus(self) -> int:
        """CPUs per node (one task per node, so --cpus-per-task)."""
        return self.cpus_per_node or CPUS_PER_PROC * self.procs

    def min_count(self) -> int:
        """The fewest nodes the job trains with."""
        return self.nodes if self.min_nodes is None else self.min_nodes

    def memory(self) -> str:
        """Memory per node as SLURM's --mem."""
        return self.mem or f"{MEM_GB_PER_PROC * self.procs}G"

    def validate(self, cfg: Config) -> None:
        """Refuse, before anything is submitted, what SLURM would reject late or what breaks training or requeue."""
        texts = {
            "--sbatch-arg": self.extra_sbatch,
            "--mem": (self.mem,),
            "--time": (self.time,),
            "--partition": (self.partition,),
            "--account": (self.account,),
            "--job-name": (self.job_name,),
            "--python": (self.python,),
        }
        for flag, values in texts.items():
            for value in filter(None, values):
                script_text(flag, value)  # a newline would start a shell line of its own in the script
        if self.nodes < 1:
            raise ConfigError(f"--nodes must be at least 1, got {self.nodes}")
        if not 1 <= self.min_count() <= self.nodes:
            raise ConfigError(f"--min-nodes {self.min_nodes} must be between 1 and --nodes {self.nodes}")
        etcd_endpoints("--etcd-endpoints", self.etcd_endpoints)
        self.check_fault_tolerance(self.min_nodes, self.etcd_endpoints, "--etcd-endpoints")
        if self.gpus_per_node < 0:
            raise ConfigError(f"--gpus-per-node must be >= 0, got {self.gpus_per_node}")
        if self.cpus_per_node is not None and self.cpus_per_node < 1:
            raise ConfigError(f"--cpus-per-node must be >= 1, got {self.cpus_per_node}")
        if self.nproc_per_node is not None and self.nproc_per_node < 1:
            raise ConfigError(f"--nproc-per-node must be a positive integer, got {self.nproc_per_node}")
        self.check_ranks(cfg, 1 if self.fault_tolerance else self.min_count())  # in place: down to one group
        if self.cpus() < self.procs:
            raise ConfigError(f"--cpus-per-node {self.cpus()} is fewer than the {self.procs} ranks per node")
        if self.mem != "0":
            slurm_mem_mb(self.memory())
        if self.time is not None:
            m = _TIME.match(self.time)
            if not m or not any(int(g) for g in m.groups() if g):
                raise ConfigError(f"--time {self.time!r} is not a SLURM time (MM, HH:MM:SS or D-HH:MM:SS, above 0)")
        if self.max_requeues < 0 or self.max_restarts < 0:
            raise ConfigError("--max-requeues and --max-restarts must be >= 0")
        if self.rdzv_port is not None and not 0 < self.rdzv_port < 65536:
            raise ConfigError(f"--rdzv-port {self.rdzv_port} is not a TCP port")
        for arg in self.extra_sbatch:
            if not arg.startswith("-"):
                raise ConfigError(f"--sbatch-arg {arg!r} must be one option starting with '-'")
        check_stop_window(self.signal_s, self.stop_budget_s(), "--signal-seconds")


def check_data_dir(cfg: Config, workdir: Path) -> None:
    """A job reading a prepared corpus needs it before it starts: refuse a data.dir holding none.

    The default corpus is the exception (local rank 0 of each node prepares it on first use, one
    node at a time on a shared folder); a user factory (data.target) brings its own data.
    """
    source = data_source(cfg.data)
    folder = source.folder()
    if folder is None or source.prepares_itself:
        return
    data_dir = workdir / folder
    if not corpus_ready(data_dir):
        raise ConfigError(
            f"data.dir {cfg.data.dir} ({data_dir.resolve()}) holds no prepared corpus (meta.json): run "
            f"`ddptrain prepare FILES --out {cfg.data.dir}` on a shared filesystem before submitting"
        )


def node_paths(cfg: Config, job: SlurmJob, config_path: Path, workdir: Path) -> dict[str, str]:
    """What every node must see at the same path (a shared filesystem), as the script names them."""
    paths = {
        "the working folder (--chdir)": str(workdir.resolve()),
        "the interpreter (--python)": job.python,
        "the frozen config": str(config_path),
        "run.dir": str((workdir / cfg.run_dir).resolve()),
    }
    folder = data_source(cfg.data).folder()
    if folder is not None:
        paths["data.dir"] = str((workdir / folder).resolve())
    for what, path in paths.items():
        script_text(what, path)  # each lands in a comment and a (quoted) shell word of the script
    return paths


def _node_check(cfg: Config, paths: dict[str, str]) -> str:
    """Bash run on each node before its launcher: a path the node cannot see is bad input (exit 2,
    never requeued) named in one line, not a confusing failure inside the launcher. run.dir is
    created on first use, and so is the default corpus."""
    later = {"run.dir"} | ({"data.dir"} if data_source(cfg.data).prepares_itself else set())
    checks = []
    for what, path in paths.items():
        if what in later:
            continue
        # The interpreter may be a name on PATH (--python python3); the rest are paths.
        test = (
            f"command -v {shlex.quote(path)}" if what.startswith("the interpreter") else f"[ -e {shlex.quote(path)} ]"
        )
        said = shlex.quote(f"{what} {path}: every node must see it at the same path (a shared filesystem)")
        say = f'echo "ddptrain-slurm: node $SLURMD_NODENAME cannot see "{said} >&2'
        checks.append(f"{test} >/dev/null || {{ {say}; exit {EXIT_USAGE}; }}; ")
    return "".join(checks)


def _bash_word(arg: str) -> str:
    """Quote one argument for bash, except `$NAME` references, which are expanded (double-quoted)."""
    return f'"{arg}"' if re.fullmatch(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?", arg) else shlex.quote(arg)


# What sbatch's own parser of #SBATCH lines (src/sbatch/opt.c, _get_argument) does not take as
# written: whitespace ends a value, quotes and a backslash are consumed, an unquoted '#' starts a
# comment. Quoting by its rules is not portable across SLURM versions, so such values are refused.
_SBATCH_SPECIAL = frozenset("\"'\\#")


def sbatch_value(what: str, value: str) -> str:
    """value, when it survives an #SBATCH line as written (exit 2 naming `what` otherwise)."""
    script_text(what, value)
    if any(c.isspace() or c in _SBATCH_SPECIAL for c in value):
        raise ConfigError(
            f"{what} {value!r} cannot be written into an #SBATCH line: sbatch splits directive values at "
            "whitespace and reads quotes, '\\' and '#' itself; use a value without them"
        )
    if "packjob" in value.lower():  # sbatch blanks this word anywhere in a directive line
        raise ConfigError(f"{what} {value!r} cannot be written into an #SBATCH line: sbatch erases 'packjob' from it")
    return value


def _job_name(cfg: Config, job: SlurmJob) -> str:
    """--job-name as given (checked), else ddptrain-<run.name> with what an #SBATCH line cannot hold as '-'."""
    if job.job_name:
        return sbatch_value("--job-name", job.job_name)
    name = "ddptrain-" + re.sub(r"[^A-Za-z0-9._+-]", "-", cfg.run.name)
    return sbatch_value("the job name from run.name (pass --job-name)", name)


def _directives(cfg: Config, job: SlurmJob, workdir: Path) -> list[str]:
    """The #SBATCH options of the job, in the order they are written; each value checked for sbatch's parser."""
    run_dir = sbatch_value("run.dir", str((workdir / cfg.run_dir).resolve()))
    directives = [
        f"--job-name={_job_name(cfg, job)}",
        f"--nodes={job.nodes}",
        "--ntasks-per-node=1",  # one `ddptrain launch` per node; it starts the ranks itself
        f"--cpus-per-task={job.cpus()}",
        f"--mem={sbatch_value('--mem', job.memory())}",
    ]
    if job.gpus_per_node:
        directives.append(f"--gpus-per-node={job.gpus_per_node}")
    for flag, value in (("time", job.time), ("partition", job.partition), ("account", job.account)):
        if value:
            directives.append(f"--{flag}={sbatch_value('--' + flag, value)}")
    directives += [
        f"--chdir={sbatch_value('the working folder (--chdir)', str(workdir.resolve()))}",
        # %% is a literal % in sbatch's file name patterns; %x and %j are the job's name and id.
        f"--output={run_dir.replace('%', '%%')}/slurm/%x-%j.out",
        "--open-mode=append",  # a requeued job appends to the same log
        f"--signal=B:USR1@{job.signal_s}",
        "--requeue",
    ]
    if job.min_count() < job.nodes or job.fault_tolerance:
        directives.append("--no-kill")  # a failed node leaves the others running (the launchers go on without it)
    directives += [sbatch_value("--sbatch-arg", arg) for arg in job.extra_sbatch]
    return directives


def render_script(cfg: Config, job: SlurmJob, config_path: Path, workdir: Path) -> str:
    """The sbatch script text for this config and job (every value in it checked: exit 2 naming the bad one)."""
    job.validate(cfg)
    check_config_texts(cfg)
    directives = _directives(cfg, job, workdir)
    etcd = etcd_endpoints("--etcd-endpoints", job.etcd_endpoints)
    in_place = job.fault_tolerance is not None
    argv = launch_argv(
        nnodes="1" if in_place else f"{job.min_count()}:{job.nodes}" if job.min_count() < job.nodes else str(job.nodes),
        nproc_per_node=str(job.procs),
        endpoint=None if in_place else "$RDZV_ENDPOINT",
        run_id=None if in_place else "$RDZV_ID",
        node_addr="$addr",
        max_restarts=job.max_restarts,
        shutdown_s=job.worker_stop_s(),
        config_path=str(config_path),
        rdzv_backend=ETCD_BACKEND if etcd else None,
        lighthouse=("$LIGHTHOUSE", "$SLURM_NODEID") if in_place else None,
    )
    paths = node_paths(cfg, job, config_path, workdir)
    node_cmd = (
        _node_check(cfg, paths)
        + 'addr=$(scontrol show node "$SLURMD_NODENAME" | grep -o "NodeAddr=[^ ]*" | cut -d= -f2); '
        + "exec "
        + " ".join(_bash_word(a) for a in [job.python, "-m", "ddptrain", *argv])
    )
    header = "\n".join(f"#SBATCH {d}" for d in directives)
    port = str(job.rdzv_port) if job.rdzv_port else f"$(( {PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN} ))"
    rendezvous = _ETCD.format(endpoints=shlex.quote(etcd)) if etcd else _FIRST_NODE.format(port=port)
    if in_place:
        rendezvous = lighthouse_section(job.python, port)
    return _TEMPLATE.format(
        header=header,
        shared="\n".join(f"#   {what}: {path}" for what, path in paths.items()),
        rendezvous=rendezvous,
        run=cfg.run.name,
        run_dir=shlex.quote(str((workdir / cfg.run_dir).resolve())),
        max_requeues=job.max_requeues,
        nodes=job.nodes,
        node_cmd=shlex.quote(node_cmd),
        preempted=EXIT_PREEMPTED,
        usage=EXIT_USAGE,
        # srun does not inherit --cpus-per-task from sbatch (SLURM >= 22.05): without it each
        # node's launcher and all its ranks would share one CPU.
        srun_cpus=f" --cpus-per-task={job.cpus()}",
    )


_FIRST_NODE = """\
# The first node of the allocation hosts the rendezvous; use its SLURM NodeAddr so that no
# hostname has to resolve. The rendezvous id is the job id, which a requeued job keeps; so is the
# port (derived from it unless fixed), so two jobs whose first node is the same machine do not collide.
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
HEAD_ADDR=$(scontrol show node "$HEAD_NODE" | grep -o "NodeAddr=[^ ]*" | cut -d= -f2)
RDZV_PORT={port}
export RDZV_ENDPOINT="$HEAD_ADDR:$RDZV_PORT"
export RDZV_ID="$SLURM_JOB_ID"
"""

_ETCD = """\
# The rendezvous lives in an existing etcd cluster (its members below), so no node of the job is
# special: any may be lost while --min-nodes remain. Other jobs share that cluster: the id names
# this SLURM cluster and job (a requeued job keeps it and finds its own state again).
export RDZV_ENDPOINT={endpoints}
export RDZV_ID="slurm-${{SLURM_CLUSTER_NAME:-cluster}}-$SLURM_JOB_ID"
"""

_TEMPLATE = """\
#!/bin/bash
# Generated by `ddptrain slurm` for run {run}. Submit with: sbatch THIS_FILE
{header}

# Every node must see these at the same paths (a shared filesystem); each node checks before it
# starts (a missing one exits {usage}, not requeued):
{shared}

# Preemption (USR1, forwarded below) makes every node commit a checkpoint and exit {preempted};
# this script then requeues the job, which resumes from the newest checkpoint (ckpt.resume=auto).
# Bad input (exit {usage}) is never requeued; crashes (any other non-zero exit) at most MAX_REQUEUES times.
set -u
RUN_DIR={run_dir}
MAX_REQUEUES={max_requeues}
CRASHES_FILE="$RUN_DIR/slurm/crashes-$SLURM_JOB_ID"

{rendezvous}echo "ddptrain-slurm: job $SLURM_JOB_ID restart ${{SLURM_RESTART_COUNT:-0}} on $SLURM_JOB_NODELIST, rendezvous $RDZV_ENDPOINT, $(date -u +%FT%T.%3N%:z)"

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


def submission_dir(run_dir: Path) -> Path:
    """A new folder run.dir/slurm/<UTC time>-<random> for one submission's frozen config and script."""
    submissions = slurm_dir(run_dir)
    ensure_dir(submissions)  # a link planted as run.dir/slurm is refused, not followed
    for _ in range(10):
        folder = submissions / f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{secrets.token_hex(3)}"
        try:
            folder.mkdir()  # never an existing one: a queued job's config is never rewritten
            return folder
        except FileExistsError:
            continue
    raise LaunchError(f"could not create a new submission folder in {submissions}")


def write_script(cfg: Config, job: SlurmJob, out: Path | None = None) -> Path:
    """Freeze the config into a new run.dir/slurm/<submission>/config.yaml and write the sbatch script.

    Each generation gets its own folder, so a job that is queued or requeued keeps the config it was
    submitted with, whatever is generated for the same run later. Nothing is written if the job is
    invalid: the script is rendered once (every value checked) before the folder is made. No write
    follows a link: the new folder's files are created afresh, and a link at `out` is replaced.
    """
    workdir = Path.cwd()
    job.validate(cfg)
    check_data_dir(cfg, workdir)
    run_dir = (workdir / cfg.run_dir).resolve()
    render_script(cfg, job, config_file(slurm_dir(run_dir) / "NEW"), workdir)  # the folder's name is ours
    folder = submission_dir(run_dir)
    config_path = config_file(folder)
    with open_new_no_follow(config_path, 0o444) as f:
        f.write(cfg.to_yaml().encode())
    text = render_script(cfg, job, config_path, workdir)
    if out is not None:
        write_text_replace(out, text, 0o755)
        return out
    script = folder / "job.sbatch"
    with open_new_no_follow(script, 0o755) as f:
        f.write(text.encode())
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
