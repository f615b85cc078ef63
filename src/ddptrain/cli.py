"""The `ddptrain` command. Every subcommand is a plain function that tests can call.

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
from collections.abc import Sequence
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from ddptrain import run, streams
from ddptrain.checkpoint.store import select_checkpoint
from ddptrain.checks import creatable_file, existing_dir, number_in, output_dir, text_arg
from ddptrain.cli_options import from_args
from ddptrain.cli_parsers import OneLineParser, UsageError, WorkerCommandParser, usage_prog
from ddptrain.commands.launch import add_parser as add_launch_parser
from ddptrain.commands.launch import launch as run_launch
from ddptrain.config import MAX_SEED, MAX_TIMEOUT_S, DataConfig, config_from_mapping, describe_fields
from ddptrain.data.corpus import PrepareOptions, expand_sources, prepare_corpus, stdlib_sources
from ddptrain.endpoints import host_port
from ddptrain.errors import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_PREEMPTED,
    EXIT_USAGE,
    ConfigError,
    DdptrainError,
    LaunchError,
)
from ddptrain.launch.etcd_endpoints import parse_endpoints
from ddptrain.launch.options import LaunchOptions, node_counts, nproc_per_node
from ddptrain.train.preemption import decided_stop, hold_until_exit, settle_for_exit

DEFAULT_DATA_DIR = DataConfig.model_fields["dir"].default


# ---- subcommands ------------------------------------------------------------------------------


def train(config: str | None = None, overrides: Sequence[str] = ()) -> int:
    """Train per the config on this process's share of the job; returns the exit code."""
    hold_until_exit()  # this process ends with the run: a late signal must not replace the first one's exit code
    result = run.train(config, overrides=overrides)
    return {"preempted": EXIT_PREEMPTED, "interrupted": EXIT_INTERRUPTED}.get(result.status, 0)


def prepare(sources: Sequence[str], out: str, val_fraction: float, options: PrepareOptions | None = None) -> int:
    """Tokenize files/globs/JSON Lines into token shards (default: the Python standard library, as bytes)."""
    number_in("--val-fraction", val_fraction, 0.0, 0.5, low_open=True)
    output_dir("--out", Path(out))
    for source in sources:
        text_arg("a source", source)
    files = expand_sources(list(sources)) if sources else stdlib_sources()
    info = prepare_corpus(files, Path(out), val_fraction, options, say=_warn)  # _warn: "waiting for ..." lines
    made = "reused the corpus another prepare made from the same" if info.reused else "prepared"
    print(
        f"{made} {info.files} files ({info.documents:,} documents) into {info.out_dir}: "
        f"{info.train_tokens:,} train tokens, {info.val_tokens:,} val tokens, vocab {info.vocab_size:,}, "
        f"{info.shards} shards"
    )
    return 0


def _warn(text: str) -> None:
    print(text, file=sys.stderr)


def export(
    run_dir: str, out: str, step: int | None = None, fmt: str = "safetensors", data_dir: str | None = None
) -> int:
    """Write a checkpoint's model: plain safetensors (config beside it) or a transformers folder (--format hf)."""
    existing_dir("run folder", Path(run_dir))
    if step is not None:
        number_in("--step", step, 0, 10**15)
    if data_dir is not None and fmt != "hf":
        raise ConfigError("--data-dir gives --format hf its tokenizer; plain safetensors export writes none")
    if fmt == "hf":
        from ddptrain.checkpoint.export import refuse_links_inside, staged_output
        from ddptrain.checkpoint.export_hf import export_hf
        from ddptrain.evaluate import model_of, tokenizer_dir

        out_dir = output_dir("--out", Path(out))
        ckpt = select_checkpoint(Path(run_dir), step, _warn)
        saved = config_from_mapping(ckpt.manifest.config)
        if saved.model.live is not None and saved.model.target is None:
            raise ConfigError(
                f"model.live={saved.model.live!r}: --format hf exports the built-in GPT and model.hf models, "
                "not a live nn.Module passed to ddptrain.train(); export without --format hf writes its weights"
            )
        cfg, model = model_of(ckpt)
        refuse_links_inside(Path(run_dir), out_dir)
        with staged_output(out_dir) as work:  # complete or absent: a failed export leaves nothing behind
            what = export_hf(model, cfg.model, tokenizer_dir(cfg, data_dir), work)
        print(f"exported {ckpt.path.name} to {out}: {what}")
        return 0
    from ddptrain.checkpoint.export import export_model

    out_path = creatable_file("--out", Path(out))
    if out_path.suffix == ".json":
        raise ConfigError(f"--out {out}: the model config goes to a .json beside the weights; use .safetensors")
    path, count = export_model(Path(run_dir), out_path, step, _warn)
    print(f"exported {path.name} ({count} tensors) to {out_path} and {out_path.with_suffix('.json')}")
    return 0


def evaluate(run_dir: str, step: int | None, split: str, batches: int, overrides: Sequence[str]) -> int:
    """Mean loss and perplexity of a checkpoint on a split of the data (alone or as every rank under torchrun)."""
    from ddptrain.evaluate import evaluate_checkpoint

    existing_dir("run folder", Path(run_dir))
    if step is not None:
        number_in("--step", step, 0, 10**15)
    number_in("--batches", batches, 0, 10**12)
    line = evaluate_checkpoint(select_checkpoint(Path(run_dir), step, _warn), split, batches, overrides)
    if line is not None:
        print(line)
    return 0


def report(run_dir: str, out: str | None = None) -> int:
    """Plots and a text summary of a run (finished, running or crashed) into run_dir/report."""
    from ddptrain.observe.report import report as write_report  # matplotlib loads only for this command

    existing_dir("run folder", Path(run_dir))
    summary, files = write_report(Path(run_dir), output_dir("--out", Path(out)) if out else None)
    print(summary)
    print(f"wrote {', '.join(str(f) for f in files)}")
    return 0


def triage(run_dir: str) -> int:
    """Print the verdict of the hang recorded in run_dir/stacks."""
    from ddptrain.observe.verdict import verdict

    print(verdict(Path(run_dir) / "stacks"))
    return 0


def verify_resume(run_dir: str, start: int | None, steps: int) -> int:
    """Replay steps from a checkpoint and compare with the run's resume certificate; 1 when they differ."""
    from ddptrain.verify_resume import verify_resume as replay_and_compare

    return replay_and_compare(Path(run_dir), start, steps)


def launch(args: argparse.Namespace) -> int:
    """This node's share of a job; the worker command is checked here first (with --dry-run too), so bad
    input exits 2 in one line before any worker starts."""
    options = from_args(LaunchOptions, args)
    check_worker_command(options.worker_command, options.nnodes, options.nproc_per_node)
    return run_launch(options)


def check_worker_command(command: Sequence[str], nnodes: str, nproc: str) -> None:
    """Parse the worker command as a worker will; for `train`, load its config and check the batch split."""
    if not command:
        return  # the launcher says what is missing
    worker = _parser(WorkerCommandParser).parse_args(list(command))
    if worker.command == "launch":
        raise LaunchError("the worker command cannot be launch itself; give the command each worker runs, e.g. train")
    if worker.command != "train" or worker.help_config:
        return
    cfg = run.resolve_config(worker.config, worker.overrides)
    low, high = node_counts(nnodes)
    per_node = nproc_per_node(nproc)
    if per_node is not None and low == high:
        cfg.check_world_size(low * per_node)


def doctor(backend: str, timeout_s: float, max_mb: float, endpoint: str | None = None, etcd: str | None = None) -> int:
    """Bring-up checks and an all-reduce bandwidth sweep; non-zero when a check fails."""
    from ddptrain.observe.doctor import doctor as run_doctor

    number_in("--timeout", timeout_s, 0, MAX_TIMEOUT_S, low_open=True)
    number_in("--max-mb", max_mb, 0, 2**16, low_open=True)
    if endpoint is not None:
        host_port("--endpoint", endpoint)
    if etcd is not None:
        parse_endpoints("--etcd", etcd)
    return run_doctor(backend, timeout_s, int(max_mb * 2**20), endpoint, etcd)


def generate(
    run_dir: str, prompt: str, max_new_tokens: int, temperature: float, top_k: int, seed: int, data_dir: str | None
) -> int:
    """Print the prompt and a sampled continuation from the run's newest good checkpoint."""
    from ddptrain.generate import generate as sample

    text_arg("--prompt", prompt, single_line=False)
    number_in("--temperature", temperature, 0, 100, low_open=True)
    number_in("--top-k", top_k, 0, 2**31)  # above the vocabulary means all tokens
    number_in("--max-new-tokens", max_new_tokens, 0, 10**6)
    number_in("--seed", seed, 0, MAX_SEED)
    existing_dir("run folder", Path(run_dir))
    corpus = existing_dir("--data-dir", Path(data_dir)) if data_dir is not None else None
    text, path = sample(Path(run_dir), prompt, max_new_tokens, temperature, top_k or None, seed, corpus)
    print(f"(sampled from {path})", file=sys.stderr)
    print(text)
    return 0


def slurm(args: argparse.Namespace) -> int:
    """Write the sbatch script for a config (and submit it with --submit)."""
    from ddptrain.commands.slurm import SlurmOptions
    from ddptrain.commands.slurm import slurm as run_slurm

    return run_slurm(from_args(SlurmOptions, args))


def k8s(args: argparse.Namespace) -> int:
    """Print (or write) the PyTorchJob manifest for a config."""
    from ddptrain.commands.k8s import K8sOptions
    from ddptrain.commands.k8s import k8s as run_k8s

    return run_k8s(from_args(K8sOptions, args))


# ---- argument parsing -------------------------------------------------------------------------


def _parser(parser_class: type[argparse.ArgumentParser] = OneLineParser) -> argparse.ArgumentParser:
    p = parser_class(prog="ddptrain", description="Multi-node DDP training for PyTorch.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    t = sub.add_parser("train", help="train (one process, or one rank under torchrun)")
    t.add_argument("-c", "--config", help="YAML config file (default: the built-in defaults)")
    t.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.max_steps=100")
    t.add_argument("--help-config", action="store_true", help="list every config key with its default and meaning")

    pr = sub.add_parser("prepare", help="tokenize text files or JSON Lines into token shards")
    pr.add_argument(
        "sources", nargs="*", help="files, folders or globs (default: the Python standard library's sources)"
    )
    pr.add_argument("--out", default=DEFAULT_DATA_DIR, help=f"output folder (default {DEFAULT_DATA_DIR})")
    pr.add_argument("--val-fraction", type=float, default=DataConfig.model_fields["val_fraction"].default)
    pr.add_argument(
        "--tokenizer",
        default="bytes",
        help="bytes (default), a tokenizer.json (or its folder), or train:VOCAB to train a byte-level BPE",
    )
    pr.add_argument("--jsonl-field", default="text", help="field holding the text in .jsonl files (default text)")
    pr.add_argument("--workers", type=int, default=0, help="tokenizing processes (default: one per core)")
    wait_help = f"seconds to wait for another prepare of --out (default {PrepareOptions.wait_s:g})"
    pr.add_argument("--wait", type=float, default=PrepareOptions.wait_s, help=wait_help)
    pr.add_argument(
        "--force",
        action="store_true",
        help="prepare even when --out holds files no prepare wrote (without it: exit 2 naming them); files "
        "named like prepare's output (meta.json, tokenizer.json, shards) are then replaced, others left alone",
    )
    pr.add_argument(
        "--shard-tokens",
        type=int,
        default=PrepareOptions.shard_tokens,
        help=f"tokens per shard file (default {PrepareOptions.shard_tokens:,})",
    )

    e = sub.add_parser("export", help="export a checkpoint's model: safetensors, or a transformers folder")
    e.add_argument("run_dir")
    e.add_argument(
        "--out",
        required=True,
        help="output .safetensors file (config beside it as .json), or a folder with --format hf",
    )
    e.add_argument("--step", type=int, help="checkpoint step (default: the newest good one)")
    e.add_argument(
        "--format",
        choices=("safetensors", "hf"),
        default="safetensors",
        help="hf: a folder transformers.AutoModelForCausalLM.from_pretrained loads, with the tokenizer",
    )
    e.add_argument(
        "--data-dir", help="--format hf: the prepared corpus whose tokenizer to include (default: the run's data.dir)"
    )

    ev = sub.add_parser("eval", help="mean loss and perplexity of a checkpoint on the validation split")
    ev.add_argument("run_dir")
    ev.add_argument("overrides", nargs="*", help="dotted overrides of the saved config, e.g. data.dir=data/other")
    ev.add_argument("--step", type=int, help="checkpoint step (default: the newest good one)")
    ev.add_argument("--split", default="val", help="split of the prepared corpus (default val)")
    ev.add_argument(
        "--batches",
        type=int,
        default=0,
        help="global batches of train.global_batch_size samples, at any world size (default 0: the whole split); "
        "the run's train.eval_batches gives the trainer's val_loss",
    )

    add_launch_parser(sub)

    r = sub.add_parser("report", help="plots and a summary of a run's metrics (works on running and crashed runs)")
    r.add_argument("run_dir")
    r.add_argument("--out", help="output folder (default RUN_DIR/report)")

    d = sub.add_parser("doctor", help="bring-up checks: environment, rendezvous, all-reduce bandwidth")
    d.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto")
    d.add_argument("--timeout", type=float, default=30.0, help="seconds every rank may take to join (default 30)")
    d.add_argument("--max-mb", type=float, default=64.0, help="largest all-reduce message in MiB (default 64)")
    d.add_argument("--endpoint", help="also check that this rendezvous HOST:PORT accepts connections from here")
    d.add_argument(
        "--etcd",
        help="also check these etcd members HOST[:PORT],... (healthy, v2 API on); under `ddptrain launch "
        "--rdzv-backend etcd-v2` its endpoints are checked without this",
    )

    tr = sub.add_parser("triage", help="one verdict from the stacks a hang left in RUN_DIR/stacks")
    tr.add_argument("run_dir")

    v = sub.add_parser("verify-resume", help="replay steps from a checkpoint and compare with what the run logged")
    v.add_argument("run_dir")
    v.add_argument(
        "--from", dest="start", type=int, help="checkpoint step (default: the newest with logged steps after it)"
    )
    v.add_argument("--steps", type=int, default=10, help="steps to replay (default 10)")

    g = sub.add_parser("generate", help="sample text from the built-in GPT of a run's newest good checkpoint")
    g.add_argument("run_dir")
    g.add_argument("--prompt", default="", help="text to continue")
    g.add_argument("--max-new-tokens", type=int, default=200, help="tokens to sample (default 200)")
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-k", type=int, default=40, help="sample from the k likeliest tokens; 0 for all")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--data-dir", help="the prepared corpus whose tokenizer to use (default: the run's data.dir)")
    _add_cluster_parsers(sub)
    return p


def _add_cluster_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from ddptrain.commands import k8s, slurm

    slurm.add_parser(sub)
    k8s.add_parser(sub)


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "train":
        if args.help_config:
            print(describe_fields())
            return 0
        return train(args.config, args.overrides)
    if args.command == "prepare":
        if args.shard_tokens < 1 or args.workers < 0:
            raise ConfigError("--shard-tokens must be >= 1 and --workers >= 0")
        number_in("--wait", args.wait, 0.0, MAX_TIMEOUT_S)
        options = PrepareOptions(
            args.tokenizer, args.jsonl_field, args.workers, args.shard_tokens, wait_s=args.wait, force=args.force
        )
        return prepare(args.sources, args.out, args.val_fraction, options)
    if args.command == "export":
        return export(args.run_dir, args.out, args.step, args.format, args.data_dir)
    if args.command == "eval":
        return evaluate(args.run_dir, args.step, args.split, args.batches, args.overrides)
    if args.command == "launch":
        return launch(args)
    if args.command == "report":
        return report(args.run_dir, args.out)
    if args.command == "doctor":
        return doctor(args.backend, args.timeout, args.max_mb, args.endpoint, args.etcd)
    if args.command == "triage":
        return triage(args.run_dir)
    if args.command == "verify-resume":
        return verify_resume(args.run_dir, args.start, args.steps)
    if args.command == "generate":
        return generate(
            args.run_dir, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed, args.data_dir
        )
    if args.command == "slurm":
        return slurm(args)
    if args.command == "k8s":
        return k8s(args)
    raise AssertionError(args.command)


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
