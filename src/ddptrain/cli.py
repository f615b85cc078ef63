"""The `ddptrain` command: a table from subcommand names to their functions (commands/, one module each, a plain
typed function that tests and the Python API call); each parser is derived from the options dataclass its function
takes (cli_options.py), and `main` maps exceptions to exit codes in one place.

    ddptrain train                                   # one process (CPU or one GPU)
    ddptrain train -c cfg.yaml train.max_steps=100   # YAML plus dotted overrides
    torchrun --nproc-per-node 2 -m ddptrain train    # two ranks on this machine
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint HEAD:29500 --rdzv-id job1 -m ddptrain train -c cfg.yaml   # on each node
    ddptrain launch --nnodes 2 --rdzv-endpoint HEAD:29500 --node-addr ME -- train -c cfg.yaml  # on each node
    ddptrain prepare DOCS/ --out data/mine --tokenizer train:8192   # shards; bytes, tokenizer.json or a BPE
    ddptrain export runs/default --out model.safetensors
    ddptrain export runs/default --format hf --out exports/mine       # loads in transformers
    ddptrain eval runs/default [--step N] [data.dir=...]             # loss and perplexity of a checkpoint
    ddptrain report runs/default                     # plots + summary into runs/default/report/
    ddptrain doctor                                  # bring-up checks (alone, or as every rank under torchrun)
    ddptrain triage runs/default                     # one verdict from the stacks a hang left in run.dir/stacks
    ddptrain verify-resume runs/default --steps 10   # replay from a checkpoint, compare with what the run logged
    ddptrain generate runs/default --prompt "def "   # sample from the built-in GPT
    ddptrain slurm -c cfg.yaml --nodes 4 --gpus-per-node 8 --time 24:00:00 [--submit]   # sbatch script
    ddptrain k8s -c cfg.yaml --nodes 4 --image REGISTRY/ddptrain:TAG > job.yaml         # PyTorchJob
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from ddptrain import run, streams
from ddptrain.checks import output_file
from ddptrain.cli_options import add_options, from_args, options_type
from ddptrain.cli_parsers import OneLineParser, UsageError, WorkerCommandParser, usage_prog
from ddptrain.commands.doctor import doctor
from ddptrain.commands.evaluate import evaluate
from ddptrain.commands.export import export
from ddptrain.commands.generate import generate
from ddptrain.commands.prepare import prepare
from ddptrain.commands.report import report
from ddptrain.commands.train import train
from ddptrain.commands.triage import triage
from ddptrain.commands.verify_resume import verify_resume
from ddptrain.errors import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_USAGE, DdptrainError, LaunchError
from ddptrain.launch.launcher import add_parser as add_launch_parser
from ddptrain.launch.launcher import launch as run_launch
from ddptrain.launch.launcher import node_counts, nproc_per_node
from ddptrain.safe_files import write_text_replace
from ddptrain.train.preemption import decided_stop, settle_for_exit


class Command(NamedTuple):
    """A subcommand: its function, which takes its options dataclass (the parser is derived from it), and its help."""

    run: Callable[[Any], int]
    help: str
    # launch, slurm and k8s build their own parser and take the parsed namespace, until they take a dataclass too.
    register: Callable[[Any], None] | None = None


def _parser(parser_class: type[argparse.ArgumentParser] = OneLineParser) -> argparse.ArgumentParser:
    p = parser_class(prog="ddptrain", description="Multi-node DDP training for PyTorch.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in COMMANDS.items():
        if command.register is not None:
            command.register(sub)
        else:
            add_options(sub.add_parser(name, help=command.help), options_type(command.run))
    return p


def _dispatch(args: argparse.Namespace) -> int:
    command = COMMANDS[args.command]
    if command.register is not None:
        return command.run(args)
    return command.run(from_args(options_type(command.run), args))


# ---- launch, slurm, k8s -----------------------------------------------------------------------


def launch(args: argparse.Namespace) -> int:
    """This node's share of a job; the worker command is checked here first (with --dry-run too), so bad
    input exits 2 in one line before any worker starts."""
    check_worker_command(args.worker_command, args.nnodes, args.nproc_per_node)
    return run_launch(args)


def check_worker_command(command: Sequence[str], nnodes: str, nproc: str) -> None:
    """Parse the worker command as a worker will; for `train`, load its config and check the batch split."""
    command = list(command)[1:] if list(command)[:1] == ["--"] else list(command)
    if not command:
        return  # the launcher says what is missing
    worker = _parser(WorkerCommandParser).parse_args(command)
    if worker.command == "launch":
        raise LaunchError("the worker command cannot be launch itself; give the command each worker runs, e.g. train")
    if worker.command != "train" or worker.help_config:
        return
    cfg = run.resolve_config(worker.config, worker.overrides)
    low, high = node_counts(nnodes)
    per_node = nproc_per_node(nproc)
    if per_node is not None and low == high:
        cfg.check_world_size(low * per_node)


def slurm(args: argparse.Namespace) -> int:
    """Write the sbatch script for a config (and submit it with --submit)."""
    from ddptrain.launch.jobspec import load_job_config
    from ddptrain.launch.slurm import SlurmJob, submit, write_script

    cfg = load_job_config(args.config, args.overrides)
    out = output_file("--out", Path(args.out)) if args.out else None
    script = write_script(cfg, from_args(SlurmJob, args), out)
    print(f"wrote {script}")
    if args.submit:
        print(f"submitted job {submit(script)}")
    return 0


def k8s(args: argparse.Namespace) -> int:
    """Print (or write) the PyTorchJob manifest for a config."""
    from ddptrain.launch.jobspec import load_job_config
    from ddptrain.launch.k8s import K8sJob, render_manifest

    cfg = load_job_config(args.config, args.overrides)
    if args.out:
        output_file("--out", Path(args.out))
    text = render_manifest(cfg, from_args(K8sJob, args))
    if args.out:
        write_text_replace(Path(args.out), text)  # a link planted at --out is replaced, never written through
        print(f"wrote {args.out}")
    else:
        print(text, end="")
    return 0


def _job_config_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-c", "--config", help="YAML config file (frozen into the job definition)")
    common.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.max_steps=100")
    return common


def _add_slurm_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from ddptrain.launch.slurm import SlurmJob

    s = sub.add_parser(
        "slurm", parents=[_job_config_parser()], help="write (and --submit) an sbatch script for a config"
    )
    add_options(s, SlurmJob)
    s.add_argument("--out", help="script path (default run.dir/slurm/<submission>/job.sbatch)")
    s.add_argument("--submit", action="store_true", help="submit with sbatch after writing")


def _add_k8s_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from ddptrain.launch.k8s import K8sJob

    k = sub.add_parser("k8s", parents=[_job_config_parser()], help="write a Kubeflow PyTorchJob manifest for a config")
    add_options(k, K8sJob)
    k.add_argument("--out", help="manifest file (default: standard output)")


COMMANDS: dict[str, Command] = {
    "train": Command(train, "train (one process, or one rank under torchrun)"),
    "prepare": Command(prepare, "tokenize text files or JSON Lines into token shards"),
    "export": Command(export, "export a checkpoint's model: safetensors, or a transformers folder"),
    "eval": Command(evaluate, "mean loss and perplexity of a checkpoint on the validation split"),
    "launch": Command(launch, "", register=add_launch_parser),
    "report": Command(report, "plots and a summary of a run's metrics (works on running and crashed runs)"),
    "doctor": Command(doctor, "bring-up checks: environment, rendezvous, all-reduce bandwidth"),
    "triage": Command(triage, "one verdict from the stacks a hang left in RUN_DIR/stacks"),
    "verify-resume": Command(verify_resume, "replay steps from a checkpoint and compare with what the run logged"),
    "generate": Command(generate, "sample text from the built-in GPT of a run's newest good checkpoint"),
    "slurm": Command(slurm, "", register=_add_slurm_parser),
    "k8s": Command(k8s, "", register=_add_k8s_parser),
}


# ---- main: the one place exceptions become exit codes ---------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse, run, and turn user errors into exit code 2 with one message."""
    streams.ensure_standard_streams()
    try:
        return _main(argv)
    finally:
        settle_for_exit()  # after a stop signal the exit code is decided: a later one must not cut the exit short
        # A reader that went away (`| tee` ended by the same Ctrl-C) must not turn the exit code into 120.
        streams.flush_standard_streams()


def _main(argv: Sequence[str] | None) -> int:
    try:
        args = _parser().parse_args(argv)
    except UsageError as e:
        prog = usage_prog(e.prog, str(e), sys.argv[1:] if argv is None else list(argv))
        _say_error(prog, f"{e} (see {prog} --help)")
        return EXIT_USAGE
    try:
        return _dispatch(args)
    except DdptrainError as e:
        if not e.announced:
            _error_line(args.command, str(e))
        if e.exit_code == EXIT_FAILURE and os.environ.get("TORCHELASTIC_ERROR_FILE"):
            # What torch's record() would write for an uncaught exception: the launcher names the cause.
            ErrorHandler().record_exception(e)
        return e.exit_code
    except OSError as e:
        if e.errno not in USER_ERRNOS:
            raise
        # A path the user gave or the disk they run on: unreadable, read-only, full, missing.
        _error_line(args.command, f"{e.strerror or e}" + (f": {e.filename}" if e.filename else ""))
        return EXIT_USAGE
    except KeyboardInterrupt:
        decided = decided_stop()  # a Ctrl-C while a stop closes the run: the first signal's code stays
        if decided is None:
            _error_line(args.command, "interrupted (Ctrl-C)")
            return EXIT_INTERRUPTED
        _error_line(args.command, f"quit at once on Ctrl-C while stopping for {decided[0]} (exit {decided[1]})")
        return decided[1]


# OS errors caused by the user's paths, permissions or disk, not by ddptrain: exit 2 in one line.
USER_ERRNOS = frozenset(
    {
        errno.ENOSPC,
        errno.EDQUOT,
        errno.EROFS,
        errno.EACCES,
        errno.EPERM,
        errno.ENOENT,
        errno.ENOTDIR,
        errno.EISDIR,
        errno.EEXIST,
        errno.EFBIG,
        errno.ENAMETOOLONG,
        errno.ELOOP,
        errno.ENOTEMPTY,
    }
)


def _error_line(command: str, text: str) -> None:
    _say_error(f"ddptrain {command}", text)


def _say_error(prog: str, text: str) -> None:
    rank = os.environ.get("RANK")
    prefix = f"[rank {rank}] " if rank not in (None, "0") else ""
    # stderr itself may be gone (a closed pipe): the exit code still tells.
    streams.say(f"{prefix}{prog}: error: {' '.join(text.split())}")
