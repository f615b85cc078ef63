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
import atexit
import errno
import functools
import os
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple, NoReturn

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from ddptrain import run, streams
from ddptrain.cli_options import add_options, from_args, options_type
from ddptrain.cli_parsers import OneLineParser, UsageError, WorkerCommandParser, usage_prog
from ddptrain.commands.doctor import doctor
from ddptrain.commands.evaluate import evaluate
from ddptrain.commands.export import export
from ddptrain.commands.generate import generate
from ddptrain.commands.k8s import k8s
from ddptrain.commands.launch import launch
from ddptrain.commands.lighthouse import lighthouse
from ddptrain.commands.prepare import prepare
from ddptrain.commands.report import report
from ddptrain.commands.slurm import slurm
from ddptrain.commands.train import train
from ddptrain.commands.triage import triage
from ddptrain.commands.verify_resume import verify_resume
from ddptrain.errors import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_USAGE, DdptrainError, LaunchError
from ddptrain.launch.options import LaunchOptions, node_counts, nproc_per_node
from ddptrain.launch.worker_start import is_forked_worker, is_script
from ddptrain.train.preemption import decided_stop, leaves_without_teardown, settle_for_exit


class Command(NamedTuple):
    """A subcommand: its function, which takes its options dataclass (the parser is derived from it), and its help."""

    run: Callable[[Any], int]
    help: str
    description: str | None = None  # the text atop `ddptrain NAME --help`, when it says more than the help


# Built once per process and parser class: parse_args never changes a parser, and a build (13 subcommands'
# options) costs ~9 CPU-ms, which the tests' ~900 in-process main() calls a session paid every time.
@functools.cache
def _parser(parser_class: type[argparse.ArgumentParser] = OneLineParser) -> argparse.ArgumentParser:
    p = parser_class(prog="ddptrain", description="Multi-node DDP training for PyTorch.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in COMMANDS.items():
        parser = sub.add_parser(name, help=command.help, description=command.description)
        add_options(parser, options_type(command.run))
    return p


def _dispatch(args: argparse.Namespace) -> int:
    command = COMMANDS[args.command]
    return command.run(from_args(options_type(command.run), args))


def launch_checked(options: LaunchOptions) -> int:
    """`ddptrain launch` from the command line: the worker command is parsed first, as a worker will (with
    --dry-run too), so bad input exits 2 in one line before any worker starts."""
    check_worker_command(options.worker_command, options.nnodes, options.nproc_per_node)
    return launch(options)


def check_worker_command(command: Sequence[str], nnodes: str, nproc: str) -> None:
    """Parse the worker command as a worker will; for `train`, load its config and check the batch split."""
    if not command:
        return  # the launcher says what is missing
    if is_script(command[0]):
        if not Path(command[0]).is_file():
            raise LaunchError(f"worker command: no Python script {command[0]!r} (a script runs as torchrun runs one)")
        return  # the script's own arguments are its own business
    worker = _parser(WorkerCommandParser).parse_args(list(command))
    if worker.command == "launch":
        raise LaunchError("the worker command cannot be launch itself; give the command each worker runs, e.g. train")
    if worker.command != "train" or worker.help_config:
        return
    cfg = run.resolve_config(worker.config, worker.overrides)
    low, high = node_counts(nnodes)
    per_node = nproc_per_node(nproc)
    if per_node is not None and low == high:
        cfg.check_world_size(low * per_node, per_node)


COMMANDS: dict[str, Command] = {
    "train": Command(train, "train (one process, or one rank under torchrun)"),
    "prepare": Command(prepare, "tokenize text files or JSON Lines into token shards"),
    "export": Command(export, "export a checkpoint's model: safetensors, or a transformers folder"),
    "eval": Command(evaluate, "mean loss and perplexity of a checkpoint on the validation split"),
    "launch": Command(
        launch_checked,
        "run a job on this node (one command per node; torchrun underneath)",
        "Start this node's share of a (multi-node) job: `ddptrain launch [options] -- train -c cfg.yaml ...`",
    ),
    "report": Command(report, "plots and a summary of a run's metrics (works on running and crashed runs)"),
    "doctor": Command(doctor, "bring-up checks: environment, rendezvous, all-reduce bandwidth"),
    "triage": Command(triage, "one verdict from the stacks a hang left in RUN_DIR/stacks"),
    "verify-resume": Command(verify_resume, "replay steps from a checkpoint and compare with what the run logged"),
    "generate": Command(generate, "sample text from a run's newest good checkpoint (built-in GPT, model.hf, LoRA)"),
    "slurm": Command(slurm, "write (and --submit) an sbatch script for a config"),
    "k8s": Command(k8s, "write a Kubeflow PyTorchJob manifest for a config"),
    "lighthouse": Command(lighthouse, "serve torchft's Lighthouse, the quorum service of in-place recovery"),
}


# ---- main: the one place exceptions become exit codes ---------------------------------------


def command() -> NoReturn:
    """The `ddptrain` console command: main() and exit with its code."""
    exit_with(main())


def exit_with(code: int) -> NoReturn:
    """Leave the process with `code`: what the interpreter's exit closes is closed, but its teardown is skipped.

    The teardown frees every object of torch and the libraries one by one: about a CPU-second per process on 2
    cores, more in a forked one (it copies every page), paid by every command, launcher and exec'd worker. Before
    leaving, as the interpreter would: non-daemon threads are waited for, then the atexit handlers run (trackers
    end their runs, logging flushes), then the streams are flushed. When the command said nothing is left to close
    (preemption.leave_without_teardown), only the streams. A worker forked by `ddptrain launch` unwinds instead:
    torch's agent reads its return value on the way, and multiprocessing's exit skips the teardown already.
    """
    if is_forked_worker() and not leaves_without_teardown():
        raise SystemExit(code)
    if not leaves_without_teardown():
        # Private, but exactly what the interpreter's exit runs before the teardown: threading's shutdown (its exit
        # hooks, e.g. concurrent.futures stopping idle pools, then the joins), then the atexit handlers.
        shutdown_threads = getattr(threading, "_shutdown", None)
        if shutdown_threads is not None:
            shutdown_threads()
        atexit._run_exitfuncs()
    streams.flush_standard_streams()
    os._exit(code)


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
