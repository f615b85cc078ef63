"""The composition root: a Config becomes a built, set-up run, in one order, on every rank.

The CLI (`ddptrain train`), the Python API (`ddptrain.train`), the benchmarks and the tests all
build runs here and nowhere else. Every collective of the set-up happens in `build_run`, in this
order, on every rank (torch matches collectives by order, so a different order on one rank
would deadlock the job):

 1. distributed context      init_distributed: rendezvous, the training group, host names
 2. run folder               rank 0 takes the folder's lease (one writer per run.dir) and
                             every rank learns the outcome (a broadcast)
 3. data                     the data source (data/source.py) prepares itself: the default corpus's local
                             rank 0 prepares it, max_over_ranks agrees; then the datasets
 3b. data identity           every rank describes its data, all compare (all_gather_object): a rank
                             with different data stops the job (exit 2) before the first step
 4. model                    seeded identically on every rank (model.peft: base weights and adapters,
                             checkpoint/adapters.py); the sync (train/sync/) creates its own groups
                             (setup: none for every-step sync), then wraps the model (train/parallel.py): DDP broadcasts
                             rank 0's weights; fsdp shards each rank's copy in place (fully_shard runs
                             no collective; its mesh is the training group); hsdp first creates the
                             mesh's replicate and shard groups (init_device_mesh: new_group calls)
 5. optimizer and schedule   inside the Trainer; the loop's observers (throughput, certificate, stragglers,
                             replica checks: `attach_observers`, none runs a collective when built);
                             trainer.setup(): the stop agreement's gloo group (a new group only next to
                             NCCL; gloo runs reuse the training group)
 6. checkpointer.setup()     the checkpoints' own gloo group
 7. observers                metrics and tracker sinks, progress (rank 0 only), triage.setup(): a broadcast,
                             an all-gather of pids
 8. resume (train/start.py)  rank 0 verifies and checks the config, everyone receives its choice
                             (a broadcast); only then, with the run accepted, rank 0 writes
                             config.yaml and every rank's held log lines reach logs/rank-<r>.log
Then `Run.fit()` trains, with the watchdog (triage) attached as one more observer. In each step the
observers' collectives come in this order on every rank: the window's loss and custom metrics all-reduced
(logged steps), the stragglers' all-gather (log.straggler_every), the evaluation's all-reduces, the replica
check's all-gathers (before every save and on check steps), then the save's own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed

from ddptrain.checkpoint import Checkpointer
from ddptrain.checkpoint.adapters import with_adapters
from ddptrain.checkpoint.compat import run_identity
from ddptrain.checkpoint.export import export_model
from ddptrain.checkpoint.formats.base import CheckpointFormat
from ddptrain.checkpoint.formats.registry import checkpoint_format
from ddptrain.checkpoint.lease import LeaseHeld, RunLease
from ddptrain.config import Config, config_from_mapping, load_config
from ddptrain.data.collate import check_collate
from ddptrain.data.identity import agree_on_data
from ddptrain.data.kinds import data_source
from ddptrain.data.source import DataSource, LiveData, Sampling
from ddptrain.dist import DistContext, close_distributed, init_distributed, read_torchrun_env
from ddptrain.errors import (
    EXIT_INTERRUPTED,
    EXIT_PREEMPTED,
    CheckpointSaveError,
    Interrupted,
    LeaseLost,
    NonFiniteError,
    Preempted,
    UserError,
)
from ddptrain.ft_env import FaultToleranceEnv, read_ft_env
from ddptrain.models import build_model, check_model_config, fit_vocab_to_data
from ddptrain.observe.certificate import Certificate, CertificateWriter
from ddptrain.observe.endings import end_record
from ddptrain.observe.forensics import enable_flight_recorder
from ddptrain.observe.metrics import MetricsWriter, Progress
from ddptrain.observe.perf import Throughput
from ddptrain.observe.recovery import RecoveryTimeline
from ddptrain.observe.runlog import run_logging, stop_rank_files
from ddptrain.observe.stragglers import StragglerMonitor
from ddptrain.observe.trackers import build_sinks, require_packages
from ddptrain.observe.triage import Triage
from ddptrain.observe.watchdog import Budgets
from ddptrain.run_folder import LEASE, checkpoints_dir, config_file, export_dir, group_lease, report_dir, stacks_dir
from ddptrain.run_sources import ModelSource, live_model, settle_sources
from ddptrain.safe_files import write_text_replace
from ddptrain.train.agent_watch import AgentWatch
from ddptrain.train.compression import check_backend
from ddptrain.train.hooks import Hooks
from ddptrain.train.in_place import reach
from ddptrain.train.preemption import StopRequest
from ddptrain.train.replicas import ReplicaCheck, ReplicaDivergence, ReplicaGuard
from ddptrain.train.rng import seed_everything
from ddptrain.train.start import resume_or_start, say
from ddptrain.train.sync import build_sync
from ddptrain.train.sync.in_place import check_in_place, check_in_place_data
from ddptrain.train.trainer import Trainer

log = logging.getLogger(__name__)

ConfigSource = Config | Mapping[str, Any] | str | Path | None


@dataclass
class RunResult:
    """What a finished (or preempted) run reached; the same on every rank."""

    status: str  # "completed", "finished_early" (train.early_stop, a hook: exit 0), "preempted" or "interrupted"
    step: int
    loss: float | None  # mean training loss of the last logged window
    val_loss: float | None  # last evaluation, None when there was none
    run_dir: Path

    @property
    def exit_code(self) -> int:
        """The exit code `ddptrain train` ends with for this result: 0, or preempted's / interrupted's (a script
        under `ddptrain launch` passes it to sys.exit, so the launcher tells a preemption from a completed run)."""
        return {"preempted": EXIT_PREEMPTED, "interrupted": EXIT_INTERRUPTED}.get(self.status, 0)


@dataclass
class Run:
    """Everything one rank needs to train, built and set up by `build_run`."""

    cfg: Config
    ctx: DistContext
    trainer: Trainer
    checkpointer: Checkpointer
    metrics: MetricsWriter
    progress: Progress
    triage: Triage
    lease: RunLease | None = None  # rank 0's lease on run.dir
    timeline: RecoveryTimeline | None = None  # marks of this (re)start, written after the first step
    certificate: CertificateWriter | None = None  # rank 0's resume certificate (None: log.certificate=false)
    status: str = "failed"  # until fit() records how the attempt ended; ends the trackers' runs in close()

    def fit(self) -> RunResult:
        """Train to train.max_steps; SIGTERM/SIGUSR1 (status "preempted") and Ctrl-C ("interrupted") become
        a coordinated stop: every rank stops at the same step after committing a checkpoint."""
        trainer, ctx = self.trainer, self.ctx
        if trainer.step >= self.cfg.train.max_steps:
            log.info("nothing to do: already at step %d (train.max_steps=%d)", trainer.step, self.cfg.train.max_steps)
        lost_to = self.lease.lost_to if self.lease is not None else None
        stop = StopRequest(announce=ctx.is_main, lease_lost=lost_to).install()
        try:
            trainer.observers.attach(self.triage)  # the hang watchdog: arms around each step, phases have budgets
            trainer.fit(stop_request=stop, timeline=self.timeline)
        except LeaseLost:
            self.abandon_folder()  # the other ranks learn it here; rank 0 already stopped writing
            raise
        except (Preempted, Interrupted) as e:
            status = "preempted" if isinstance(e, Preempted) else "interrupted"
            self.progress.close()
            log.info("%s: checkpoint committed; run the same command again to resume (exit %d)", e, e.exit_code)
            self._end(status, e.exit_code, signal=e.signal_name, world_size=ctx.world_size)
            return self._result(status)
        except (NonFiniteError, CheckpointSaveError, ReplicaDivergence) as e:
            self.progress.close()
            log.error("%s", e)
            self._end("stopped", e.exit_code, reason=str(e))
            raise
        except UserError as e:
            self._end("stopped", e.exit_code, reason=str(e))
            raise  # stops every rank agreed on: nothing to triage
        except KeyboardInterrupt:  # a Ctrl-C during a stop: quit at once, without a checkpoint
            quit_now = stop.quit_at_once(trainer.step)  # the first stop signal's ending and exit code
            self._end(quit_now.kind, quit_now.exit_code, signal=quit_now.first, checkpoint=False)
            raise quit_now from None
        except Exception as e:
            failure = self.triage.failed(e, trainer.step + 1)
            self._end("crashed", failure.exit_code, error=str(failure)[:1000])
            raise failure from e
        finally:
            self.triage.idle()
            stop.uninstall()
        self.progress.close()
        why = trainer.stopped_because  # train.early_stop or a hook: a normal end before max_steps
        done = f"finished early at step {trainer.step}: {why}" if why else f"done: {trainer.step} steps"
        log.info("%s; checkpoints in %s", done, checkpoints_dir(self.cfg.run_dir), extra=trainer.sync.console_extra())
        ending = "finished_early" if why else "completed"
        self._end(ending, 0, **({"reason": why} if why else {}))  # before the artifacts: the report tells it too
        if self.cfg.log.track_artifacts and ctx.is_main:
            self._upload_artifacts()
        return self._result(ending)

    def _end(self, kind: str, exit_code: int, **detail: Any) -> None:
        """Record how this attempt ends (observe/endings.py) in metrics.jsonl and the trackers; close() then
        ends the trackers' runs with it. Written on every way out that runs Python: only a kill leaves none."""
        self.status = kind
        self.trainer.record_end(end_record(kind, self.trainer.step, exit_code, **detail))

    def _upload_artifacts(self) -> None:
        """Rank 0: the report and/or the exported model of the finished run, queued for the trackers."""
        run_dir, wanted = self.cfg.run_dir, self.cfg.log.track_artifacts
        try:
            if "report" in wanted:
                from ddptrain.review.report import report  # matplotlib loads only here

                report(run_dir)
                self.metrics.upload(report_dir(run_dir), "report")
            if "model" in wanted:
                export_model(run_dir, export_dir(run_dir) / "model.safetensors", None, say)
                self.metrics.upload(export_dir(run_dir), "model")
        except Exception as e:  # the run has succeeded: a failed extra must not change that
            log.warning("log.track_artifacts: %s: %s; nothing more uploaded", type(e).__name__, e)

    def _result(self, status: str) -> RunResult:
        t = self.trainer
        return RunResult(status, t.step, t.last_loss, t.last_val_loss, self.cfg.run_dir)

    def abandon_folder(self, new_owner: str | None = None) -> None:
        """Another run took the folder's lease (rank 0's heartbeat thread calls this the moment it sees it):
        nothing more of this run reaches the folder: no metrics, trackers, certificate or log lines."""
        self.metrics.enabled = False
        self.metrics.sinks = []  # dropped unflushed: a tracker's files (TensorBoard's) may lie in the folder
        if self.certificate is not None:
            self.certificate.enabled = False
        stop_rank_files()

    def close(self) -> None:
        """Wait for an in-flight save, stop the watchdog, close the metrics and flush the trackers (every rank)."""
        try:
            self.triage.close()
            self.trainer.close()
            self.checkpointer.wait()
            if self.certificate is not None:
                self.certificate.close()
            self.metrics.close(self.status)
            self.progress.close()
        finally:  # even when a Ctrl-C hurried the close: the next run need not wait for the lease to go stale
            if self.lease is not None:
                self.lease.release()


def resolve_config(config: ConfigSource, overrides: Sequence[str] = ()) -> Config:
    """A Config from a Config, a mapping of sections, a YAML path or None (the defaults), plus dotted overrides."""
    if isinstance(config, Config):
        if not overrides:
            return config
        config = config.model_dump(mode="json", by_alias=True)
    if isinstance(config, Mapping):
        return config_from_mapping(config, list(overrides))
    return load_config(str(config) if config is not None else None, list(overrides))


def build_run(
    cfg: Config,
    ctx: DistContext,
    model: ModelSource = None,
    datasets: LiveData = None,
    trainer_cls: Callable[..., Trainer] = Trainer,
    timeline: RecoveryTimeline | None = None,
    in_place: FaultToleranceEnv | None = None,
) -> Run:
    """Steps 2-8 of the module docstring on every rank of ctx (the process group already exists).

    trainer_cls: a subclass of Trainer with step methods of your own (the benchmarks use one).
    timeline: the marks of this (re)start so far; the run adds its own and writes them after the first step.
    in_place: this worker's replica group in the in-place fault-tolerant mode (ft_env.py): the group holds its
    own lease on the folder, and synchronizes with the in-place sync (train/sync/in_place.py).
    """
    lease_name = LEASE
    if in_place is not None:
        check_in_place(cfg)
        reach(in_place, cfg.dist.ft_timeout_s)  # a Lighthouse that does not answer: refused before anything is written
        lease_name = group_lease(in_place.replica_group)
    run_dir = cfg.run_dir
    require_packages(cfg.log)  # every rank, before any collective: all of them stop on a missing extra
    writer = checkpoint_format(cfg.ckpt.format, cfg.saved_strategy)  # so is a format that cannot save this state
    check_backend(cfg.dist, ctx.backend)  # and a gradient compression the backend cannot all-reduce
    check_collate(cfg.data)  # and a data.collate that does not import
    cfg, model, datasets = settle_sources(cfg, model, datasets)  # config.yaml says where they came from
    source = data_source(cfg.data, datasets)
    lease, tag = take_lease(run_dir, ctx, lease_name)
    try:
        return _build(cfg, ctx, (lease, tag), writer, model, source, trainer_cls, timeline, in_place)
    except BaseException:
        if lease is not None:
            lease.release()
        raise


def take_lease(run_dir: Path, ctx: DistContext, name: str = LEASE) -> tuple[RunLease | None, str]:
    """Step 2's lease: rank 0 takes run.dir's lease; every rank learns the outcome and a refusal exits 2 on all.

    Returns the lease on rank 0 (None elsewhere) and its token on every rank (it tags the temp folders).
    """
    lease: RunLease | None = None
    error: str | None = None
    if ctx.is_main:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)  # run.dir itself may be a link the user made
            lease = RunLease(run_dir, name).acquire()
        except LeaseHeld as e:
            error = str(e)
        except OSError as e:
            error = f"cannot take the lease on run folder {run_dir}: {e.strerror or e}"
    token = lease.owner.token if lease is not None else ""
    if ctx.is_distributed:
        box = [(error, token)]
        torch.distributed.broadcast_object_list(box, src=0)
        error, token = box[0]
    if error is not None:
        raise LeaseHeld(error)
    if lease is not None and lease.took_over is not None:
        log.warning("took over the lease of a run that is gone (%s)", lease.took_over.describe())
    return lease, token


def _build(
    cfg: Config,
    ctx: DistContext,
    leased: tuple[RunLease | None, str],
    writer: CheckpointFormat,
    model: ModelSource,
    source: DataSource,
    trainer_cls: Callable[..., Trainer],
    timeline: RecoveryTimeline | None,
    in_place: FaultToleranceEnv | None,
) -> Run:
    run_dir, (lease, tag) = cfg.run_dir, leased
    source.prepare(ctx, wait_s=cfg.dist.timeout_s / 2)
    data_vocab = source.vocab_size()
    # The built-in GPT takes the data's vocabulary: a new config, the caller's stays as it was.
    cfg = cfg.model_copy(update={"model": fit_vocab_to_data(cfg.model, data_vocab)})
    seed_everything(cfg.run.seed)
    train_set, val_set = source.datasets(Sampling.of(cfg))
    if in_place is not None:  # before anything is written: a refused group leaves the run folder as it was
        check_in_place_data(cfg, train_set, source.pad_id)
    agree_on_data(ctx, source.identity(train_set, val_set))
    # Same seed on every rank: identical init (DDP also broadcasts it).
    built = live_model(cfg, model)
    module = build_model(cfg.model, data_vocab) if built is None else built
    module, base = with_adapters(module, cfg.model, live=built is not None)  # model.peft: base digested, adapters on
    sync = build_sync(cfg, ctx, in_place)  # how the ranks agree (train/sync/): its groups, then the wrapped module
    sync.setup()
    wrapped = sync.wrap(module)
    seed_everything(cfg.run.seed + ctx.rank)  # then per-rank streams (dropout, augmentation)
    progress = Progress(ctx.is_main, cfg.train.max_steps, 0)
    metrics = MetricsWriter(run_dir, ctx.is_main, build_sinks(cfg, ctx, say))
    config = cfg.model_dump(mode="json", by_alias=True)
    lost = lease.check_lost if lease is not None else None  # read by rank 0 before each commit
    identity = run_identity(source.resume_identity(), module) | base
    checkpointer = Checkpointer(cfg.ckpt, run_dir, ctx, config, identity, writer, tag, lost)
    trainer = trainer_cls(cfg, ctx, wrapped, train_set, val_set, checkpointer, metrics, progress, sync=sync)
    certificate = attach_observers(cfg, ctx, trainer, metrics, train_set)
    trainer.setup()
    checkpointer.setup()
    triage = Triage(ctx, run_dir, cfg.dist.timeout_s, Budgets.from_config(cfg), metrics.write)
    triage.setup()
    run = Run(cfg, ctx, trainer, checkpointer, metrics, progress, triage, lease, timeline, certificate)
    if lease is not None:
        lease.when_lost(run.abandon_folder)  # on the heartbeat thread: rank 0 stops writing at once
    try:
        resume_or_start(cfg, trainer, checkpointer, metrics, timeline)
        trainer.after_resume()
        if ctx.is_main:  # only now: a refused run (exit 2) leaves the folder's config.yaml as it was
            _write_config(cfg)
    except BaseException:
        run.lease = None  # released by build_run
        run.close()
        raise
    return run


def attach_observers(
    cfg: Config, ctx: DistContext, trainer: Trainer, metrics: MetricsWriter, train_set: Any
) -> CertificateWriter | None:
    """Step 5's observers of the loop, attached in the order they hear each event (train/hooks.py): throughput
    (adds its fields to a logged step's record), the resume certificate (log.certificate, rank 0), the straggler
    check, the replica check. None runs a collective when built. Returns the certificate's writer."""
    flops = getattr(trainer.model, "flops_per_token", None)
    throughput = Throughput(
        ctx.device,
        cfg.train.precision,
        ctx.world_size,
        cfg.train.global_batch_size,
        getattr(train_set, "tokens_per_sample", None),
        flops() if callable(flops) else None,
        cfg.log.peak_tflops,
    )
    log.info(throughput.describe())
    trainer.observers.attach(throughput)
    writer = None
    if cfg.log.certificate:  # for `ddptrain verify-resume`
        writer = CertificateWriter(cfg.run_dir, ctx.is_main)
        trainer.observers.attach(Certificate(writer, trainer.model, trainer.optimizer, trainer.sampler))
    log_cfg = cfg.log
    trainer.observers.attach(
        StragglerMonitor(
            ctx,
            trainer.timer,
            metrics.write,
            log_cfg.straggler_every,
            log_cfg.straggler_factor,
            log_cfg.straggler_window,
        )
    )
    check = ReplicaCheck(ctx, log_cfg.replica_check_every, trainer.sync.replica_groups())
    trainer.observers.attach(
        ReplicaGuard(check, trainer.model, trainer.optimizer, metrics.write, stacks_dir(cfg.run_dir))
    )
    return writer


def _write_config(cfg: Config) -> None:
    """Rank 0: run.dir/config.yaml, the config this run was accepted with (eval, export, report read it)."""
    try:
        write_text_replace(config_file(cfg.run_dir), cfg.to_yaml())
    except OSError as e:
        raise UserError(f"cannot write the run folder {cfg.run_dir}: {e.strerror or e}") from None


@contextmanager
def distributed(cfg: Config) -> Iterator[DistContext]:
    """Step 1 and its undoing: the process group for this process's share of the job."""
    env = read_torchrun_env()
    world_size, local_world_size = (env[1], env[3]) if env else (1, 1)
    cfg.check_world_size(world_size, local_world_size)  # an indivisible batch or group: before any rendezvous
    enable_flight_recorder(stacks_dir(cfg.run_dir))  # torch reads it when the process group is created
    ctx = init_distributed(cfg.dist)
    try:
        yield ctx
    finally:
        close_distributed(ctx)


def train(
    config: ConfigSource = None,
    *,
    model: ModelSource = None,
    datasets: LiveData = None,
    overrides: Sequence[str] = (),
    hooks: Sequence[object] = (),
) -> RunResult:
    """Train per the config on this process's share of the job (one process, or one rank under torchrun).

    config: a Config, a mapping of config fields, a YAML path, or None for the defaults; overrides are
    dotted `key=value` strings applied on top. model: an nn.Module, or a factory building one (called
    with model.kwargs), instead of `model.target`/the built-in GPT (build it the same way on every rank).
    datasets: (train, val or None), or a factory returning them (called with data.kwargs), instead of
    `data.*`. An importable factory is recorded in config.yaml as model.target/data.target, so `ddptrain
    eval` rebuilds it; live objects are recorded as model.live/data.live (run_sources.py). hooks: objects
    with any of on_log, on_eval, on_checkpoint (train/hooks.py). Returns a RunResult; raises a
    ddptrain.errors.DdptrainError subclass on failure.
    """
    timeline = RecoveryTimeline.from_environment()
    timeline.mark("imports_done")
    cfg = resolve_config(config, overrides)
    cfg, model, datasets = settle_sources(cfg, model, datasets)  # a refusal writes nothing, not even the rank logs
    check_model_config(cfg.model)  # nor does a model.hf model_type or config key transformers does not know
    checked_hooks = Hooks(hooks)
    watch = AgentWatch.under_agent()  # a worker of torchrun's agent stops when the agent dies
    try:
        with (
            distributed(cfg) as ctx,
            run_logging(cfg.run_dir, ctx.rank, ctx.world_size, ctx.hostname, hold=True) as logs,
        ):
            timeline.mark("process_group_ready")
            run = build_run(cfg, ctx, model, datasets, timeline=timeline, in_place=read_ft_env())
            run.trainer.hooks = checked_hooks
            logs.accept()  # the run is accepted: its set-up lines reach the rank's log file
            if watch is not None and run.lease is not None:
                watch.before_hard_exit(run.lease.release)
            try:
                return run.fit()
            finally:
                run.close()
    finally:
        if watch is not None:
            watch.close()
