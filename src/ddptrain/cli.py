"""The `ddptrain` command. Every subcommand is a plain function that tests can call.

    ddptrain train                                   # one process (CPU or one GPU)
    ddptrain train -c cfg.yaml train.max_steps=100   # YAML plus dotted overrides
    torchrun --nproc-per-node 2 -m ddptrain train    # two ranks on this machine
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint HEAD:29500 --rdzv-id job1 -m ddptrain train -c cfg.yaml   # on each node
    ddptrain launch --nnodes 2 --rdzv-endpoint HEAD:29500 --node-addr ME -- train -c cfg.yaml  # on each node
    ddptrain prepare [FILES/GLOBS...] --out data/mine
    ddptrain export runs/default --out model.safetensors
    ddptrain report runs/default                     # plots + summary into runs/default/report/
    ddptrain doctor                                  # bring-up checks (alone, or as every rank under torchrun)
    ddptrain generate runs/default --prompt "def "   # sample from the built-in GPT
    ddptrain slurm -c cfg.yaml --nodes 4 --gpus-per-node 8 --time 24:00:00 [--submit]   # sbatch script
    ddptrain k8s -c cfg.yaml --nodes 4 --image REGISTRY/ddptrain:TAG > job.yaml         # PyTorchJob
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from ddptrain.checkpoint import Checkpointer, checkpoint_name, load_file, newest_verified, verify_checkpoint
from ddptrain.config import Config, DataConfig, describe_fields, load_config
from ddptrain.data import build_datasets
from ddptrain.data.corpus import corpus_ready, expand_sources, prepare_corpus, stdlib_sources
from ddptrain.dist import DistContext, any_rank, close_distributed, init_distributed, read_torchrun_env
from ddptrain.errors import CheckpointError, DataError, UserError
from ddptrain.launch import add_parser as add_launch_parser
from ddptrain.launch import launch
from ddptrain.metrics import MetricsWriter, Progress
from ddptrain.models import build_model
from ddptrain.preemption import EXIT_PREEMPTED, Preempted, StopRequest
from ddptrain.rng import seed_everything
from ddptrain.runlog import rank_log
from ddptrain.trainer import CheckpointSaveError, NonFiniteError, Trainer
from ddptrain.triage import Triage

DEFAULT_DATA_DIR = DataConfig.model_fields["dir"].default


# ---- subcommands ------------------------------------------------------------------------------


def train(config: str | None = None, overrides: Sequence[str] = ()) -> int:
    """Train per the config on this process's share of the job; returns the exit code."""
    cfg = load_config(config, list(overrides))
    env = read_torchrun_env()
    cfg.grad_accum_steps(env[1] if env else 1)  # fail on an indivisible batch before any rendezvous
    ctx = init_distributed(cfg.dist)
    try:
        with rank_log(cfg.run_dir, ctx.rank, ctx.world_size, ctx.hostname):
            return _train(cfg, ctx)
    finally:
        close_distributed(ctx)


def _train(cfg: Config, ctx: DistContext) -> int:
    run_dir = cfg.run_dir
    if ctx.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(cfg.to_yaml())
    _ensure_default_corpus(cfg, ctx)
    seed_everything(cfg.run.seed)
    train_set, val_set = build_datasets(cfg)
    model = build_model(cfg.model)  # same seed on every rank: identical init (DDP also broadcasts it)
    seed_everything(cfg.run.seed + ctx.rank)  # then per-rank streams (dropout, augmentation)
    metrics = MetricsWriter(run_dir, ctx.is_main, cfg.log.tensorboard)
    progress = Progress(ctx.is_main, cfg.train.max_steps, 0)
    checkpointer = Checkpointer(cfg.ckpt, run_dir, ctx, cfg.model_dump(mode="json", by_alias=True))
    trainer = Trainer(cfg, ctx, model, train_set, val_set, checkpointer, metrics, progress)
    triage = Triage(ctx, run_dir, cfg.dist.timeout_s)
    try:
        found = checkpointer.find_resume(progress.message)
        restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if found:
            path, manifest = found
            trainer.resume(path, manifest)
            progress.message(
                f"resuming from {path} (step {trainer.step}; saved at world size {manifest['world_size']}, "
                f"now {ctx.world_size}, grad accumulation {trainer.accum})"
            )
        progress.message(
            f"training {cfg.run.name}: world size {ctx.world_size} ({ctx.backend or 'single process'}, {ctx.device}), "
            f"global batch {cfg.train.global_batch_size} = {cfg.data.micro_batch_size} x {ctx.world_size} x {trainer.accum}, "
            f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, run dir {run_dir}"
        )
        progress.message(trainer.throughput.describe())
        if trainer.step >= cfg.train.max_steps:
            progress.message(f"nothing to do: already at step {trainer.step} (train.max_steps={cfg.train.max_steps})")
        metrics.write("event", event="resume" if found else "start", step=trainer.step, world_size=ctx.world_size,
                      grad_accum=trainer.accum, restart_count=restarts, host=ctx.hostname)
        _fit(trainer, triage)
        progress.close()
        progress.message(f"done: {trainer.step} steps; checkpoints in {run_dir / 'checkpoints'}")
        return 0
    except Preempted as e:
        progress.close()
        progress.message(f"{e}: checkpoint committed; run the same command again to resume (exit {EXIT_PREEMPTED})")
        metrics.write("event", event="preempted", step=trainer.step, signal=e.signal_name, world_size=ctx.world_size)
        return EXIT_PREEMPTED
    except (NonFiniteError, CheckpointSaveError) as e:
        progress.close()
        progress.message(f"error: {e}")
        metrics.write("event", event="stopped", step=trainer.step, reason=str(e))
        return 1
    finally:
        triage.close()
        checkpointer.wait()
        metrics.close()
        progress.close()


def _fit(trainer: Trainer, triage: Triage) -> None:
    """trainer.fit() with SIGTERM/SIGUSR1 turned into a coordinated stop and failed steps triaged."""
    stop = StopRequest().install()
    try:
        trainer.fit(stop_request=stop, watchdog=triage)
    except (Preempted, NonFiniteError, CheckpointSaveError, UserError):
        raise  # stops every rank agreed on: nothing to triage
    except Exception as e:
        raise triage.failed(e, trainer.step + 1) from e
    finally:
        stop.uninstall()


def _ensure_default_corpus(cfg: Config, ctx: DistContext) -> None:
    """Prepare the embedded default corpus on first use (local rank 0 of each node; the others wait)."""
    if cfg.data.target is not None or cfg.data.dir != DEFAULT_DATA_DIR:
        return
    data_dir = Path(cfg.data.dir)
    error: str | None = None
    if ctx.local_rank == 0 and not corpus_ready(data_dir):
        if ctx.is_main:
            print(f"preparing the default corpus (Python standard library sources) into {data_dir}", flush=True)
        try:
            prepare_corpus(stdlib_sources(), data_dir, cfg.data.val_fraction)
        except (DataError, OSError) as e:
            error = str(e)
    # Every rank learns whether preparation failed; nobody waits on a rank that gave up.
    if any_rank(ctx, error is not None):
        raise DataError(error or f"preparing the default corpus in {data_dir} failed on another rank")


def prepare(sources: Sequence[str], out: str, val_fraction: float) -> int:
    """Build a byte-level corpus from files/globs (default: the Python standard library)."""
    files = expand_sources(list(sources)) if sources else stdlib_sources()
    info = prepare_corpus(files, Path(out), val_fraction)
    print(f"prepared {info.files} files into {info.out_dir}: {info.train_tokens:,} train tokens, {info.val_tokens:,} val tokens")
    return 0


def export(run_dir: str, out: str, step: int | None = None) -> int:
    """Write a checkpoint's plain model weights (safetensors) and the model config beside them."""
    from safetensors.torch import save_file

    ckpt_dir = Path(run_dir) / "checkpoints"
    if step is not None:
        path = ckpt_dir / checkpoint_name(step)
        if not path.is_dir():
            raise CheckpointError(f"no checkpoint for step {step} in {ckpt_dir}")
        manifest = verify_checkpoint(path)
    else:
        path, manifest = newest_verified(ckpt_dir, lambda text: print(text, file=sys.stderr))
    state = load_file(path, "model.pt")
    # safetensors stores no aliases: tied weights (wte / lm_head) become two plain copies.
    tensors = {k: v.detach().clone().contiguous() for k, v in state.items()}
    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    model_cfg = manifest["config"]["model"]
    save_file(tensors, str(out_path), metadata={"ddptrain_step": str(manifest["step"]), "ddptrain_model": json.dumps(model_cfg)})
    out_path.with_suffix(".json").write_text(json.dumps({"model": model_cfg, "step": manifest["step"], "checkpoint": path.name}, indent=2))
    print(f"exported {path.name} ({len(tensors)} tensors) to {out_path} and {out_path.with_suffix('.json')}")
    return 0


def report(run_dir: str, out: str | None = None) -> int:
    """Plots and a text summary of a run (finished, running or crashed) into run_dir/report."""
    from ddptrain.report import report as write_report  # matplotlib loads only for this command

    summary, files = write_report(Path(run_dir), Path(out) if out else None)
    print(summary)
    print(f"wrote {', '.join(str(f) for f in files)}")
    return 0


def doctor(backend: str, timeout_s: float, max_mb: float, endpoint: str | None = None) -> int:
    """Bring-up checks and an all-reduce bandwidth sweep; non-zero when a check fails."""
    from ddptrain.doctor import doctor as run_doctor

    return run_doctor(backend, timeout_s, int(max_mb * 2**20), endpoint)


def generate(run_dir: str, prompt: str, max_new_tokens: int, temperature: float, top_k: int, seed: int) -> int:
    """Print the prompt and a sampled continuation from the run's newest good checkpoint."""
    from ddptrain.generate import generate as sample

    text, path = sample(Path(run_dir), prompt, max_new_tokens, temperature, top_k or None, seed)
    print(f"(sampled from {path})", file=sys.stderr)
    print(text)
    return 0


def slurm(args: argparse.Namespace) -> int:
    """Write the sbatch script for a config (and submit it with --submit)."""
    from ddptrain.jobspec import load_job_config
    from ddptrain.slurm import SlurmJob, submit, write_script

    cfg = load_job_config(args.config, args.overrides)
    job = SlurmJob(
        nodes=args.nodes, nproc_per_node=args.nproc_per_node, cpus_per_node=args.cpus_per_node,
        gpus_per_node=args.gpus_per_node, mem=args.mem, time=args.time, partition=args.partition,
        account=args.account, job_name=args.job_name, signal_s=args.signal_seconds, max_requeues=args.max_requeues,
        max_restarts=args.max_restarts, rdzv_port=args.rdzv_port, step_s=args.step_seconds,
        save_s=args.save_seconds, python=args.python, extra_sbatch=tuple(args.sbatch_arg),
    )
    script = write_script(cfg, job, Path(args.out) if args.out else None)
    print(f"wrote {script}")
    if args.submit:
        print(f"submitted job {submit(script)}")
    return 0


def k8s(args: argparse.Namespace) -> int:
    """Print (or write) the PyTorchJob manifest for a config."""
    from ddptrain.jobspec import load_job_config
    from ddptrain.k8s import K8sJob, render_manifest

    cfg = load_job_config(args.config, args.overrides)
    job = K8sJob(
        image=args.image, name=args.name, namespace=args.namespace, nodes=args.nodes, min_nodes=args.min_nodes,
        nproc_per_node=args.nproc_per_node, cpu=args.cpu, memory=args.memory, gpus_per_node=args.gpus_per_node,
        pvc=args.pvc, shared_mount=args.shared_mount, config_mount=args.config_mount,
        max_restarts=args.max_restarts, rdzv_port=args.rdzv_port, step_s=args.step_seconds,
        save_s=args.save_seconds, grace_s=args.grace_seconds,
    )
    text = render_manifest(cfg, job)
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text, end="")
    return 0


# ---- argument parsing -------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ddptrain", description="Multi-node DDP training for PyTorch.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    t = sub.add_parser("train", help="train (one process, or one rank under torchrun)")
    t.add_argument("-c", "--config", help="YAML config file (default: the built-in defaults)")
    t.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.max_steps=100")
    t.add_argument("--help-config", action="store_true", help="list every config key with its default and meaning")

    pr = sub.add_parser("prepare", help="prepare a byte-level token corpus from text files")
    pr.add_argument("sources", nargs="*", help="files, folders or globs (default: the Python standard library's sources)")
    pr.add_argument("--out", default=DEFAULT_DATA_DIR, help=f"output folder (default {DEFAULT_DATA_DIR})")
    pr.add_argument("--val-fraction", type=float, default=DataConfig.model_fields["val_fraction"].default)

    e = sub.add_parser("export", help="export a checkpoint's model weights to safetensors")
    e.add_argument("run_dir")
    e.add_argument("--out", required=True, help="output .safetensors file (the model config goes beside it as .json)")
    e.add_argument("--step", type=int, help="checkpoint step (default: the newest good one)")

    add_launch_parser(sub)

    r = sub.add_parser("report", help="plots and a summary of a run's metrics (works on running and crashed runs)")
    r.add_argument("run_dir")
    r.add_argument("--out", help="output folder (default RUN_DIR/report)")

    d = sub.add_parser("doctor", help="bring-up checks: environment, rendezvous, all-reduce bandwidth")
    d.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto")
    d.add_argument("--timeout", type=float, default=30.0, help="seconds every rank may take to join (default 30)")
    d.add_argument("--max-mb", type=float, default=64.0, help="largest all-reduce message in MiB (default 64)")
    d.add_argument("--endpoint", help="also check that this rendezvous HOST:PORT accepts connections from here")

    g = sub.add_parser("generate", help="sample text from the built-in GPT of a run's newest good checkpoint")
    g.add_argument("run_dir")
    g.add_argument("--prompt", default="", help="text to continue")
    g.add_argument("--max-new-tokens", type=int, default=200, help="bytes to sample (default 200)")
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-k", type=int, default=40, help="sample from the k likeliest bytes; 0 for all")
    g.add_argument("--seed", type=int, default=0)
    _add_cluster_parsers(sub)
    return p


def _add_cluster_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-c", "--config", help="YAML config file (frozen into the job definition)")
    common.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.max_steps=100")
    common.add_argument("--nodes", type=int, default=1, help="nodes (one `ddptrain launch` each)")
    common.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node (0: CPU only)")
    common.add_argument("--max-restarts", type=int, default=3, help="worker-group restarts per launch (torchrun)")
    common.add_argument("--step-seconds", type=float, default=30.0, help="longest optimizer step, for the stop window")
    common.add_argument("--save-seconds", type=float, default=60.0, help="time to commit one checkpoint, for the stop window")

    s = sub.add_parser("slurm", parents=[common], help="write (and --submit) an sbatch script for a config")
    s.add_argument("--nproc-per-node", default="auto", help="ranks per node (default: --gpus-per-node, else launch's auto)")
    s.add_argument("--cpus-per-node", type=int, help="CPUs for each node's launcher and its ranks")
    s.add_argument("--mem", help="memory per node, e.g. 64G")
    s.add_argument("--time", help="time limit, e.g. 24:00:00")
    s.add_argument("--partition", help="SLURM partition")
    s.add_argument("--account", help="SLURM account")
    s.add_argument("--job-name", help="job name (default ddptrain-<run.name>)")
    s.add_argument("--signal-seconds", type=int, default=180, help="USR1 this long before the time limit")
    s.add_argument("--max-requeues", type=int, default=3, help="requeues after crashes (preemptions are not counted)")
    s.add_argument("--rdzv-port", type=int, default=29500, help="rendezvous port on the first node")
    s.add_argument("--python", default=sys.executable, help="interpreter on the nodes (default: this one)")
    s.add_argument("--sbatch-arg", action="append", default=[], help="extra #SBATCH directive, e.g. --qos=high")
    s.add_argument("--out", help="script path (default run.dir/slurm/job.sbatch)")
    s.add_argument("--submit", action="store_true", help="submit with sbatch after writing")

    k = sub.add_parser("k8s", parents=[common], help="write a Kubeflow PyTorchJob manifest for a config")
    k.add_argument("--image", required=True, help="container image with ddptrain installed")
    k.add_argument("--name", help="job name (default ddptrain-<run.name>)")
    k.add_argument("--namespace", help="Kubernetes namespace")
    k.add_argument("--min-nodes", type=int, help="elastic minimum (default --nodes: not elastic)")
    k.add_argument("--nproc-per-node", type=int, default=1, help="ranks per pod")
    k.add_argument("--cpu", default="4", help="CPU request and limit per pod")
    k.add_argument("--memory", default="16Gi", help="memory request and limit per pod")
    k.add_argument("--pvc", help="ReadWriteMany PVC holding run.dir (default <name>-runs)")
    k.add_argument("--shared-mount", default="/shared", help="mount path of the PVC; the working directory")
    k.add_argument("--config-mount", default="/etc/ddptrain", help="mount path of the config ConfigMap")
    k.add_argument("--rdzv-port", type=int, default=29400, help="rendezvous port on the master pod")
    k.add_argument("--grace-seconds", type=int, help="terminationGracePeriodSeconds (default: the stop budget)")
    k.add_argument("--out", help="manifest file (default: standard output)")


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "train":
        if args.help_config:
            print(describe_fields())
            return 0
        return train(args.config, args.overrides)
    if args.command == "prepare":
        return prepare(args.sources, args.out, args.val_fraction)
    if args.command == "export":
        return export(args.run_dir, args.out, args.step)
    if args.command == "launch":
        return launch(args)
    if args.command == "report":
        return report(args.run_dir, args.out)
    if args.command == "doctor":
        return doctor(args.backend, args.timeout, args.max_mb, args.endpoint)
    if args.command == "generate":
        return generate(args.run_dir, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed)
    if args.command == "slurm":
        return slurm(args)
    if args.command == "k8s":
        return k8s(args)
    raise AssertionError(args.command)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse, run, and turn user errors into exit code 2 with one message."""
    args = _parser().parse_args(argv)
    try:
        return _dispatch(args)
    except UserError as e:
        rank = os.environ.get("RANK")
        prefix = f"[rank {rank}] " if rank not in (None, "0") else ""
        print(f"{prefix}ddptrain {args.command}: error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
