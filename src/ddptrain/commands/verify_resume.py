"""`ddptrain verify-resume RUN_DIR [--from STEP] [--steps K]`: prove (or disprove) that a resume is exact.

Replays K steps from one of the run's checkpoints in a scratch folder (RUN_DIR/verify-resume/from-STEP,
a run folder of its own with its own lease: the run's folder and lease are only read) and
compares, at every step the run logged, the replay's certificate (observe/certificate.py) with
the run's first record of that step (the uninterrupted run, when the run was resumed after a crash),
and checks that those records hold every committed step's samples exactly once (`coverage`: in any
mode, the in-place one included, whichever group wrote each record):

* the same world size as the logged run: everything must be bit-identical (sample ids, every
  parameter and optimizer-state digest, exact as the replica check's (observe/digest.py), the loss); the first step and tensor that differ is named.
* another world size: the same samples (ids and order), and losses within LOSS_RTOL (gradients are
  summed in another order, so the bits differ; the parameters drift by rounding only).

Run it like training: alone, or under torchrun with the world size you want to check. A run trained with
log.certificate=false wrote no certificate: refused (exit 2, one line saying so).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddptrain import run
from ddptrain.checkpoint.manifest import step_of
from ddptrain.checkpoint.store import committed_checkpoints, search, select_checkpoint
from ddptrain.checkpoint.verify import VerifiedCheckpoint
from ddptrain.cli_options import REQUIRED, option
from ddptrain.data.sampler import DataPosition
from ddptrain.dist import all_reduce_mean
from ddptrain.errors import CheckpointError, UserError
from ddptrain.observe.certificate import certificate_record, coverage_gap, read_certificate
from ddptrain.observe.runlog import run_logging
from ddptrain.run_folder import (
    certificate_file,
    checkpoints_dir,
    config_file,
    read_config,
    read_config_sections,
    replay_dir,
)
from ddptrain.train.schedules import PlannedSchedule, config_plan

LOSS_RTOL = 1e-3  # relative loss tolerance after a world-size change (see docs/observability.md)


class VerifyError(UserError):
    """verify-resume cannot run on this folder (no certificate, no such checkpoint, nothing to compare)."""


@dataclass
class Outcome:
    """What the comparison found."""

    identical: bool
    text: str


def _warn(message: str) -> None:
    print(message, file=sys.stderr, flush=True)  # a rejected checkpoint is a warning: stderr, as for train


def choose_start(run_dir: Path, logged: dict[int, list[dict[str, Any]]], start: int | None) -> VerifiedCheckpoint:
    """The verified checkpoint to replay from: --from, else the newest good one that has logged steps after it."""
    ckpts = checkpoints_dir(run_dir)
    committed = committed_checkpoints(ckpts)  # newest first
    if start is not None:
        if not any(step_of(p.name) == start for p in committed):
            have = ", ".join(str(step_of(p.name)) for p in committed) or "none"
            raise VerifyError(f"no checkpoint for step {start} in {ckpts} (committed: {have})")
        return select_checkpoint(run_dir, start, _warn)
    candidates = [p for p in committed if any(s > (step_of(p.name) or 0) for s in logged)]
    found = search(candidates, _warn)
    if found is None:
        raise VerifyError(f"no verified checkpoint in {ckpts} has logged steps after it to compare with")
    return found


def compare(logged: dict[str, Any], replay: dict[str, Any]) -> str | None:
    """None when bit-identical, else what differs first (samples, then tensors in order, then the loss)."""
    if logged["samples"] != replay["samples"] or logged["ids_crc32"] != replay["ids_crc32"]:
        return (
            f"sample ids: logged {logged['samples']} (crc {logged['ids_crc32']}), replay {replay['samples']} "
            f"(crc {replay['ids_crc32']})"
        )
    for name, values in logged["digest"].items():
        mine = replay["digest"].get(name)
        if mine != values:
            return f"tensor {name}: logged [sum, digest] {values}, replay {mine}"
    if logged["loss"] != replay["loss"]:
        return f"loss: logged {logged['loss']!r}, replay {replay['loss']!r}"
    return None


def _max_rel(logged: dict[str, Any], replay: dict[str, Any]) -> float:
    worst = 0.0
    for name, values in logged["digest"].items():
        # The float64 sums only: the exact digests (index 1) say "same or not", not how far apart.
        a, b = values[0], replay["digest"].get(name, values)[0]
        worst = max(worst, abs(a - b) / max(abs(a), 1e-12))
    return worst


def judge(logged: dict[int, list[dict[str, Any]]], replayed: list[dict[str, Any]], world_size: int) -> Outcome:
    """Compare the replay's records with the run's first record of each step."""
    pairs = [(logged[r["step"]][0], r) for r in replayed if r["step"] in logged]
    if not pairs:
        raise VerifyError("the replay logged no step that the run logged too (is log.every_steps larger than --steps?)")
    steps = ", ".join(str(r["step"]) for _, r in pairs)
    same_world = all(a["world_size"] == world_size for a, _ in pairs)
    if same_world:
        for a, b in pairs:
            diff = compare(a, b)
            if diff is not None:
                return Outcome(False, f"differs: first at step {b['step']}: {diff}")
        n_params = sum(1 for k in pairs[0][0]["digest"] if k.startswith("param:"))
        n_optim = len(pairs[0][0]["digest"]) - n_params
        return Outcome(
            True,
            f"identical: logged steps {steps}: sample ids, {n_params} parameter and {n_optim} optimizer-"
            f"state digests and losses are bit-identical",
        )
    for a, b in pairs:
        if a["samples"] != b["samples"] or a["ids_crc32"] != b["ids_crc32"]:
            return Outcome(False, f"differs: first at step {b['step']}: {compare(a, b)}")
        rel = abs(a["loss"] - b["loss"]) / max(abs(a["loss"]), 1e-12)
        if not math.isfinite(b["loss"]) or rel > LOSS_RTOL:
            return Outcome(
                False,
                f"differs: first at step {b['step']}: loss logged {a['loss']!r}, replay {b['loss']!r} "
                f"(relative {rel:.2e} > {LOSS_RTOL:g})",
            )
    worst_loss = max(abs(a["loss"] - b["loss"]) / max(abs(a["loss"]), 1e-12) for a, b in pairs)
    worst_digest = max(_max_rel(a, b) for a, b in pairs)
    return Outcome(
        True,
        f"consistent (world size {pairs[0][0]['world_size']} -> {world_size}): logged steps {steps}: "
        f"same sample ids; losses within {worst_loss:.1e} relative (tolerance {LOSS_RTOL:g}); "
        f"state digests within {worst_digest:.1e} relative (not bit-exact at another world size)",
    )


@dataclass(frozen=True)
class VerifyResumeOptions:
    """What `ddptrain verify-resume` reads from its command line."""

    run_dir: str = option(REQUIRED, None, positional=True)
    start: int | None = option(
        None, "checkpoint step (default: the newest with logged steps after it)", flag="--from", metavar="START"
    )
    steps: int = option(10, "steps to replay")


def verify_resume(options: VerifyResumeOptions) -> int:
    """Replay `steps` steps from a checkpoint of run_dir and print the verdict; 0 when it matches, 1 when not."""
    run_dir, start, steps = Path(options.run_dir), options.start, options.steps
    if steps < 1:
        raise VerifyError(f"--steps must be at least 1, got {steps}")
    cert = certificate_file(run_dir)
    if not cert.is_file():
        raise VerifyError(_no_certificate(run_dir))
    logged = read_certificate(cert)
    ckpt = choose_start(run_dir, logged, start)
    first = ckpt.step
    cfg_file = config_file(run_dir)
    if not cfg_file.is_file():
        raise VerifyError(f"{cfg_file} not found: cannot rebuild the run")
    scratch = replay_dir(run_dir, first)
    # The replay resumes from the run's checkpoint by path (it is verified again there, by rank 0) into the
    # scratch folder, which build_run leases like any run folder: two replays of one step cannot mix their files,
    # and a run still training in run_dir keeps its own lease. Nothing is sent to the experiment trackers.
    cfg = read_config(
        run_dir,
        [
            f"run.dir={scratch}",
            f"ckpt.resume={ckpt.path.resolve()}",
            "train.eval_every=0",
            "log.tensorboard=false",
            "log.trackers=[]",
            "log.track_artifacts=[]",
            "log.straggler_every=0",
            "log.certificate=false",  # the replay digests its steps itself (_replay)
        ],  # model.init_from stays: a model.peft run's base comes from it (otherwise the resume wins over it)
    )
    with run.distributed(cfg) as ctx:
        scratch.mkdir(parents=True, exist_ok=True)
        with run_logging(scratch, ctx.rank, ctx.world_size, ctx.hostname):
            the_run = run.build_run(cfg, ctx)
            try:
                replayed = _replay(the_run, first + steps, cfg.log.every_steps)
            finally:
                the_run.close()
        if not ctx.is_main:
            return 0
        outcome = judge(logged, replayed, ctx.world_size)
        covered = coverage(logged, the_run.trainer.sampler)
        print(
            f"verify-resume: replayed steps {first + 1}..{the_run.trainer.step} from {ckpt.path} (saved at world size "
            f"{ckpt.manifest.world_size}) at world size {ctx.world_size}, in {scratch}"
        )
        print(outcome.text)
        print(covered.text)
        return 0 if outcome.identical and covered.identical else 1


def coverage(logged: dict[int, list[dict[str, Any]]], sampler: DataPosition) -> Outcome:
    """Whether the run's records hold every committed step's samples exactly once (certificate.coverage_gap)."""
    batch = sampler.global_batch_size
    gap = coverage_gap(logged, batch, sampler.steps_per_epoch * batch)
    last = max(logged)
    if gap is not None:
        return Outcome(False, f"samples lost or repeated: {gap}")
    return Outcome(
        True,
        f"samples: the run's {len(logged)} logged steps hold the samples of steps 1..{last} exactly once each "
        f"({last * batch} samples: none lost, none repeated)",
    )


def _no_certificate(run_dir: Path) -> str:
    """Why run_dir has no certificate: trained with log.certificate=false (its config.yaml says so), or no logged step."""
    cert = certificate_file(run_dir)
    if config_file(run_dir).is_file():
        log_section = read_config_sections(run_dir).get("log")
        if isinstance(log_section, dict) and log_section.get("certificate") is False:
            return (
                f"{run_dir} was trained with log.certificate=false: it wrote no resume certificate ({cert.name}) to "
                "compare a replay with; train with log.certificate=true to verify its resumes"
            )
    return f"{cert} not found: the run logged no resume certificate (logged steps write it)"


def _replay(the_run: run.Run, until: int, log_every: int) -> list[dict[str, Any]]:
    """The training steps of Trainer.fit up to `until` (without saves, evaluation or checks, which leave the state alone)."""
    t, ctx = the_run.trainer, the_run.ctx
    if t.step >= until:
        raise CheckpointError(f"the checkpoint is at step {t.step}, nothing to replay before step {until}")
    until = min(until, t.cfg.train.max_steps)
    if isinstance(t.scheduler, PlannedSchedule):
        t.scheduler.follow(config_plan(t.cfg))  # as Trainer.fit does
    window = t.window  # what the checkpoint carried of its log window: the replay logs the run's windows
    records = []
    while t.step < until:
        result = t.train_step()
        window.add(result.loss, result.seconds)
        if t.step % log_every == 0 or t.step == t.cfg.train.max_steps:
            loss = float(all_reduce_mean(ctx, window.loss / window.steps))
            records.append(
                certificate_record(t.step, loss, ctx.world_size, t.model, t.optimizer, t.sampler, window.steps)
            )
            window.reset()
    return records
