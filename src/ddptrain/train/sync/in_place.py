"""The in-place fault-tolerant mode as a sync: survivors keep training when a replica group dies (torchft).

Through the seam (base.py), an attempt at a step is: `begin_step` (the quorum, healing this group when it is
behind; this rank's share of the global batch) -> forward/backward (the group's DDP, then the sum over the groups
that `before_backward` arms in the last backward, train/cross_group.py) -> `commit` (one small sum of the step's
loss and health, then the commit vote: commit or discard). The global batch never changes: its micro-batches are
cut over the ranks taking part in this step, so a committed step consumes exactly the samples of the same step in
a fault-free run, and a discarded step's samples are consumed again by the step that replaces it. The ranks taking
part are known before the data is read, because the quorum is synchronous.

The folder is written by the participating group of rank 0 (the lowest id in the quorum): metrics,
certificate, checkpoints (`writes`). A heal is recorded by the group that healed (`record_own`).

A stop signal that finds no quorum to be had (the launcher that served the Lighthouse was killed, and the
agents passed its death on as SIGTERM) stops every group at the step they last committed together, which no
group can pass without a quorum: the group that wrote it commits its checkpoint (`stop_at_last_commit`).

With train.diloco the replica groups are DiLoCo's groups (its outer state and checkpoint form, with one group
inside each replica group): inner steps take their share from the last outer sync's membership and have no
quorum, vote or cross-group traffic; after every H-th step and the last (`after_update`): the quorum (a group
behind heals: the training state, global weights and outer optimizer, its local weights reset to the global
ones), the groups' pseudo-gradients and the count of contributing groups summed in fp32 (a group that healed
there contributes nothing), the vote, the outer step. A lost group's share of its interval is trained by no one
(docs/slow-links.md#diloco-in-the-in-place-mode---fault-tolerance-torchft). A process's first quorum holds every
group heartbeating to the Lighthouse (view_of_every_group), so no group trains an interval apart from the job.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset

from ddptrain.config import Config
from ddptrain.config.kinds import EVERY_STEP, NO_COMPRESSION
from ddptrain.data.collate import build_collate
from ddptrain.dist import DistContext
from ddptrain.errors import ConfigError, DdptrainError
from ddptrain.ft_env import FaultToleranceEnv
from ddptrain.observe.runlog import FILE_ONLY
from ddptrain.train.agreement import (
    FROM_FOLDER,
    IN_JOB,
    NEW,
    differing_states,
    job_outsiders,
    recipe_of,
    recipe_slot,
    state_fingerprint,
)
from ddptrain.train.cross_group import CrossGroupGradients
from ddptrain.train.in_place import InPlaceSession, QuorumAbandoned, View
from ddptrain.train.peer_watch import SILENT_S
from ddptrain.train.preemption import INTERRUPT, NO_STOP, PREEMPT
from ddptrain.train.sync.base import Loop, Share
from ddptrain.train.sync.diloco import DiLoCo, outer_update, pseudo_gradient
from ddptrain.train.sync.every_step import EveryStep
from ddptrain.train.sync.fragments import fragments_due

log = logging.getLogger(__name__)

OUTSIDER_POLL_S = 0.5  # DiLoCo's first quorum, asked again while a heartbeating group is outside it
_LOSS, _OK, _CHECK, _FIXED = 0, 1, 2, 3  # the step's sum: loss, healthy ranks, groups asking for a state check,
# then each group's id + 1, in quorum order (one slot per group)


def check_in_place(cfg: Config) -> None:
    """ConfigError for what the in-place mode does not train (checked before it reaches the Lighthouse)."""
    if cfg.dist.strategy != "ddp":
        raise ConfigError(f"in-place fault tolerance trains with dist.strategy=ddp, not {cfg.dist.strategy} (yet)")
    if cfg.sync_kind != EVERY_STEP:
        check_in_place_diloco(cfg)
    if cfg.dist.grad_compression != NO_COMPRESSION:
        raise ConfigError(
            f"in-place fault tolerance sums the groups' gradients outside DDP's communication hooks: "
            f"dist.grad_compression={cfg.dist.grad_compression} would compress nothing across groups (use none)"
        )
    if cfg.train.global_batch_size % cfg.data.micro_batch_size:
        raise ConfigError(
            f"in-place fault tolerance cuts the global batch into micro-batches: train.global_batch_size="
            f"{cfg.train.global_batch_size} must be a multiple of data.micro_batch_size={cfg.data.micro_batch_size}"
        )


def check_in_place_diloco(cfg: Config) -> None:
    """ConfigError for a train.diloco the in-place mode does not train: the replica groups are the DiLoCo groups,
    synced whole, in fp32, and the job's state is saved at outer syncs."""
    d = cfg.train.diloco
    assert d is not None
    refusals = [
        (d.groups > 1, f"takes the replica groups as its groups: train.diloco.groups={d.groups} must be 0"),
        (d.fragments > 1, f"syncs the whole model at once: train.diloco.fragments={d.fragments} must be 1"),
        (d.outer_dtype != "fp32", f"sums the groups' pseudo-gradients in fp32, not {d.outer_dtype}"),
        (d.delay_steps > 0, f"applies each outer sync at its step: train.diloco.delay_steps={d.delay_steps} must be 0"),
        (
            cfg.ckpt.every_steps % d.every_steps != 0,
            f"saves at outer syncs: ckpt.every_steps={cfg.ckpt.every_steps} must be a multiple of "
            f"train.diloco.every_steps={d.every_steps}",
        ),
    ]
    for refused, why in refusals:
        if refused:
            raise ConfigError(f"in-place fault tolerance with train.diloco {why}")


def one_group(cfg: Config) -> Config:
    """cfg with train.diloco.groups=1: inside a replica group DiLoCo has one group (the replica groups are its
    groups, summed through the in-place session)."""
    assert cfg.train.diloco is not None
    diloco = cfg.train.diloco.model_copy(update={"groups": 1})
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={"diloco": diloco})})


def check_in_place_data(cfg: Config, train_set: Dataset[Any], pad_id: Callable[[], int]) -> None:
    """ConfigError for data the in-place mode does not train, told by its first sample as the run's collate batches
    it: called once the datasets are built and before anything is written into the run folder."""
    if not hasattr(train_set, "__getitem__"):
        raise ConfigError("in-place fault tolerance reads samples by id: a streamed (iterable) dataset cannot")
    batch = build_collate(cfg.data, pad_id)([train_set[0]])
    if isinstance(batch, Mapping) and "labels" in batch:
        raise ConfigError("in-place fault tolerance does not weight a loss by answer tokens (SFT data) yet")


def share(micro_batches: int, ranks: int, index: int) -> tuple[int, int]:
    """Micro-batches [lo, hi) of the global batch taken by rank `index` of `ranks` (as even as it gets)."""
    return index * micro_batches // ranks, (index + 1) * micro_batches // ranks


class InPlace(EveryStep):
    """Steps that survive the loss of other replica groups (torchft); see the module docstring."""

    def __init__(self, cfg: Config, ctx: DistContext, ft: FaultToleranceEnv | None = None) -> None:
        super().__init__(cfg, ctx, ft)
        assert ft is not None  # build_sync picks this kind only for a replica group of the in-place mode
        self.session = InPlaceSession(ft, ctx, cfg.dist.ft_timeout_s, cfg.dist.timeout_s)
        self.group_id = ft.replica_group
        self.micro_batches = cfg.train.global_batch_size // cfg.data.micro_batch_size
        self.cross_group: CrossGroupGradients | None = None  # attach() lays out its buckets (every-step only)
        # train.diloco: the outer step's state (global weights, outer optimizer) and checkpoint form are DiLoCo's
        # with one group; the replica groups are summed here, at outer syncs only (in_place_diloco below)
        self.outer = DiLoCo(one_group(cfg), ctx) if cfg.sync_kind != EVERY_STEP else None
        self.trained = False  # DiLoCo: inner steps trained since this group's weights were the global ones
        self.recipe = ""  # this group's (attach: the run's config and identity)
        self.in_job = False  # whether this process committed a step or healed from the job (train/agreement.py)
        self.writer = ctx.is_main  # until the first quorum says which group writes
        self.members: list[int] = []  # the group ids of the last committed step
        self.discarded = 0  # steps discarded since the last commit
        self.evicted: set[int] = set()  # groups evicted from those steps for not answering (train/peer_watch.py)
        self.commits = 0  # steps committed by this process
        self.saved_step: int | None = None  # the last step this group saved
        self.pending: View | None = None  # the first quorum, taken (and admitted) before the run was accepted
        self.view: View | None = None  # the quorum of the attempt in flight
        self.taken = 0  # this rank's micro-batches in it

    def attach(self, loop: Loop) -> None:
        """The cross-group buckets (in one fixed layout) and this group's recipe; the loop's metrics are held until
        this group is admitted (a group of another recipe leaves metrics.jsonl as it was)."""
        super().attach(loop)
        if self.outer is not None:
            self.outer.attach(loop)
        else:
            self.cross_group = CrossGroupGradients(
                list(loop.model.parameters()),
                int(self.cfg.dist.bucket_cap_mb * 2**20),
                self.session.cross_sum,
                # Under DDP the group's own sum is in the gradients only after backward.
                overlap=not isinstance(getattr(loop.ddp, "_orig_mod", loop.ddp), DDP),
            )
        self.recipe = recipe_of(loop.checkpointer.config, loop.checkpointer.identity)
        loop.metrics.hold()

    def begin(self) -> None:
        """Join the quorums at the step this group resumed at (a collective in the group: its store and Manager),
        and take the first one: a group of another recipe than the job's stops there (exit 2) before it heals,
        trains or writes anything (run.py writes config.yaml and the held logs once this returns)."""
        loop = self.loop
        if self.outer is not None:
            self.outer.begin()
        self.session.start(loop.step, self.live_state, self.load_live_state, self.recipe)
        if loop.step < self.cfg.train.max_steps:
            self.pending = self.admitted_view() if self.outer is None else self.view_of_every_group()
        loop.metrics.accept()
        if self.outer is not None and self.pending is not None:  # the others are in an outer sync: join it
            self.outer_sync(self.pending)

    def view_of_every_group(self) -> View:
        """DiLoCo: this process's first quorum, once it holds every group that heartbeats to the Lighthouse.

        Groups ask for quorums at outer syncs only, so a group that began an interval in a quorum without the others
        would train it as a job of its own: at a job's start, the first group trains alone while the later ones,
        a majority of the heartbeating groups, form a quorum without it after the Lighthouse's join timeout; both
        write the folder and take the same samples. A group outside this quorum is mid-interval (or starting):
        ask again until it is in, at its next outer sync at the latest; after dist.timeout_s go on without it. A
        quorum that healed this group is taken as it is: its donor is ahead, at an outer sync.
        """
        give_up = time.monotonic() + self.cfg.dist.timeout_s
        said = False
        while True:
            view = self.admitted_view()
            outside = self.session.outsiders() if view.heal is None else []
            if not outside:
                return view
            if time.monotonic() > give_up:
                log.warning("replica group(s) %s never joined in dist.timeout_s: training without them", outside)
                return view
            if not said:
                log.info("replica group(s) %s heartbeat outside this quorum: waiting for them to join", outside)
                said = True
            self.session.at_step(self.loop.step)
            time.sleep(OUTSIDER_POLL_S)

    def close(self) -> None:
        """Leave the quorum: stop the Manager's server and threads."""
        self.session.close()

    def live_state(self) -> dict[str, Any]:
        """What a donor sends a joining group: the whole training state, data position included, and who took part
        in the last step (so that a joiner that comes to write the folder reports the next change right)."""
        state = {"training": self.loop.state_dict(), "groups": list(self.members)}
        if self.outer is not None:
            o = self.outer
            assert o.outer is not None
            state["outer"] = {"global": list(o.global_params), "optimizer": o.outer.state_dict(), "syncs": o.syncs}
        return state

    def load_live_state(self, state: dict[str, Any]) -> None:
        """Load a peer's verified live state (the joiner's side of a heal)."""
        self.loop.load_state_dict(state["training"])
        self.members = list(state["groups"])
        if self.outer is not None:  # the global weights and outer optimizer; the local weights reset to them
            o, outer, self.trained = self.outer, state["outer"], False
            assert o.outer is not None
            o.outer.load_state_dict(outer["optimizer"])
            o.syncs = int(outer["syncs"])
            with torch.no_grad():
                for g, p, sent in zip(o.global_params, o.local_params, outer["global"]):
                    g.copy_(sent)
                    p.copy_(sent)

    # ---- the step ------------------------------------------------------------------------------

    def begin_step(self) -> Share:
        """An attempt at the next step: its quorum (admitted, this group healed when behind), then this rank's
        micro-batches of the global batch, cut over every rank of the quorum's groups. DDP averages over the
        group's ranks and the groups then sum: each micro-batch weighs group size / micro-batches."""
        if self.outer is None:  # DiLoCo's inner steps: the membership of the last outer sync
            self.session.mark_step()
            self.view, self.pending = self.pending or self.admitted_view(), None
        assert self.view is not None
        share = self.share_of(self.view)
        if self.outer is not None:
            self.take_part(self.view)
            self.trained = True  # this group's pseudo-gradient counts at the next outer sync
        return share

    def share_of(self, view: View) -> Share:
        """This rank's micro-batches of a global batch cut over every rank of the view's groups."""
        ws = self.ctx.world_size
        if view.groups * ws > self.micro_batches:
            raise ConfigError(
                f"{view.groups} replica groups x {ws} ranks take part, more than the "
                f"{self.micro_batches} micro-batches of a global batch: raise train.global_batch_size"
            )
        lo, hi = share(self.micro_batches, view.groups * ws, view.rank * ws + self.ctx.rank)
        self.taken = hi - lo
        return Share((lo, hi), ws / self.micro_batches)

    def before_backward(self, last: bool) -> None:
        """The last backward also starts the cross-group sums of finished buckets."""
        if last and self.cross_group is not None:
            self.cross_group.arm()

    def commit(self, loss: torch.Tensor) -> torch.Tensor | None:
        """The rest of the cross-group sum, the step's sum (loss, health, membership), then the group's vote: the
        step's loss (the mean over every rank of the step) when it is committed; None when it is discarded (a stop
        requested meanwhile raises here: at the last commit when no quorum can be had). DiLoCo's inner steps: this
        rank's loss, kept (the groups meet at outer syncs only: after_update)."""
        if self.outer is not None:
            return loss
        assert self.cross_group is not None and self.view is not None
        self.cross_group.launch_rest()
        summed = self.step_sum(self.view, loss / self.ctx.world_size)  # queued behind the gradient buckets
        self.cross_group.finish(self.session.errored)
        if (frozen := self.session.frozen_s()) >= SILENT_S:  # the others evicted this group meanwhile
            self.session.report(f"this group was stopped for {frozen:.1f} s: the other groups went on without it")
        if not self.session.should_commit():  # every rank of the group: the same verdict
            self.discard(f"step {self.loop.step + 1}")
            return None
        assert summed is not None
        self.after_commit(self.view, summed)
        return summed[_LOSS].to(self.ctx.device, torch.float32)

    def discard(self, what: str) -> None:
        """A discarded attempt at `what`: say why, count it, and leave when a stop was requested meanwhile."""
        eviction = self.session.take_eviction()
        self.session.abandon_collectives()
        why = self.session.error_line() or "another rank of the group voted no"
        if eviction is not None:  # named in the next quorum event
            why = f"replica group(s) {eviction.groups} stopped answering for {eviction.silent_s:g} s: evicted"
            self.evicted.update(eviction.groups)
        log.warning("%s discarded (%s); retrying with the next quorum", what, why)
        self.discarded += 1
        level = self.stop_level()
        if level in (INTERRUPT, PREEMPT):  # a stop signal while steps fail: leave now, at the last commit
            raise self.stop_at_last_commit()
        if level != NO_STOP:
            raise self.loop.stop_request.stop_error(self.loop.step, level)  # type: ignore[union-attr]

    def admitted_view(self) -> View:
        """The next quorum whose groups all train the job's recipe (a new membership is admitted first: admit),
        healing this group there when it is behind (from a donor of its own recipe only: in_place_transport.py)."""
        while True:
            try:
                view = self.session.quorum(self.loop.step, self.waiting_for_quorum, self.leaving)
            except QuorumAbandoned:
                raise self.stop_at_last_commit() from None
            if view.heal is not None:
                self.in_job = self.in_job or view.heal.verified  # a donor of its recipe's state: the job's
                self.record_heal(view)
            elif self.session.errored():  # e.g. the donor of a heal died mid-transfer: the step is discarded
                self.record_event("quorum_failed", error=self.session.error_line())
            if not view.new or self.admit(view):
                return view
            self.session.should_commit()  # discarded by this group: the next quorum is asked without the outsiders
            self.session.abandon_collectives()
            self.discarded += 1

    def admit(self, view: View) -> bool:
        """A new membership, before its first step: every group shows its id, recipe and standing in one sum
        (train/agreement.py). A group whose recipe is not the job's raises ConfigError (exit 2); the others
        discard this quorum (False) and ask for the next one. False too when the sum failed (a group left)."""
        n = view.groups
        slots = torch.zeros(3 * n, dtype=torch.float64)
        if self.ctx.rank == 0:
            slots[view.rank] = self.group_id + 1
            slots[n + view.rank] = recipe_slot(self.recipe)
            slots[2 * n + view.rank] = self.standing()
        summed = self.session.sum_over_all_ranks(slots)
        if summed is None:
            return False
        values = summed.tolist()
        groups = [int(g) - 1 for g in values[:n]]
        odd = job_outsiders(values[n : 2 * n], values[2 * n :], groups, self.group_id, recipe_slot(self.recipe))
        if odd:
            log.warning("replica group(s) %s train another recipe than the job's: they leave", odd)
            self.session.report(f"replica group(s) {odd} train another recipe than the job's")
            return False
        return True

    def standing(self) -> float:
        """How this group's recipe weighs when the job's is chosen (train/agreement.py): in the job, resumed from a
        checkpoint of its own recipe, or new."""
        if self.in_job:
            return IN_JOB
        resumed = self.loop.resumed_from
        if resumed is not None and recipe_of(resumed.manifest.config, resumed.manifest.identity) == self.recipe:
            return FROM_FOLDER
        return NEW

    def stop_level(self) -> int:
        """This rank's own stop request (train/preemption.py's levels); NO_STOP without one."""
        request = self.loop.stop_request
        return request.level if request is not None else NO_STOP

    def leaving(self) -> bool:
        """Asked while a quorum is pending: leave it when a stop was requested and the Lighthouse is gone (no
        group can commit another step then, so every group stops at the same last committed step)."""
        return self.stop_level() in (INTERRUPT, PREEMPT) and not self.session.lighthouse_answers()

    def stop_at_last_commit(self) -> DdptrainError:
        """Stop without another step: the group that wrote the last committed step commits its checkpoint (unless
        it has already), as at any agreed stop; returns the stop (75 or 130) for every rank to raise."""
        loop = self.loop
        assert loop.stop_request is not None
        level = self.stop_level()
        log.warning("stop requested with no step to be had: stopping at step %d, the last committed", loop.step)
        loop.agreement.wait()  # every rank of the group started the same agreement after that step
        if self.writer and self.commits:
            if self.saved_step != loop.step:
                loop.observers.state_settled(loop.step, False, True)  # the replica check before a save
                with loop.observers.phase("checkpoint"):
                    loop.save_checkpoint()
                    loop.report_saves()
            with loop.observers.phase("checkpoint"):
                loop.finish_saves()
        else:
            loop.checkpointer.wait()
        return loop.stop_request.stop_error(loop.step, level)

    def waiting_for_quorum(self, why: str) -> None:
        """A quorum failed (the Lighthouse away?): say so, and give the next attempt a step budget of its own (the
        observers hear the step start again)."""
        log.warning("no quorum for step %d (%s); asking the Lighthouse again", self.loop.step + 1, why)
        self.loop.observers.step_started(self.loop.step + 1)

    def step_sum(self, view: View, loss: torch.Tensor) -> torch.Tensor | None:
        """Sum over every rank of the step: the loss, who is healthy, who healed or saw the membership change, and the
        group ids in quorum order (their recipes were compared when the membership was new: admit). None: discard
        the step.

        A group whose heal was refused says so here, so every group discards the step (and it heals again). After
        a heal or a change of membership every group also shows its state's fingerprint: the groups that differ
        from the lowest-ranked one's heal again from it.
        """
        n = view.groups
        values = torch.zeros(_FIXED + n, dtype=torch.float64)
        values[_LOSS] = loss.detach().to("cpu", torch.float64)
        values[_OK] = 0.0 if view.heal is not None and not view.heal.verified else 1.0
        if self.ctx.rank == 0:
            values[_CHECK] = 1.0 if view.heal is not None or self.membership_moved(view) else 0.0
            values[_FIXED + view.rank] = self.group_id + 1
        summed = self.session.sum_over_all_ranks(values)
        if summed is None:
            return None
        groups = [int(g) - 1 for g in summed[_FIXED : _FIXED + n].tolist()]
        ranks = n * self.ctx.world_size
        if int(summed[_OK]) != ranks:
            self.session.report(f"{ranks - int(summed[_OK])} rank(s) refused the state they healed from")
            return None
        if summed[_CHECK] > 0 and not self.states_agree(view, groups):
            return None
        return summed

    def membership_moved(self, view: View) -> bool:
        """Whether this group's place in the quorum is not the one it had at its last commit (it joined, others
        left or came): then the groups compare their states."""
        return len(self.members) != view.groups or self.members[view.rank] != self.group_id

    def states_agree(self, view: View, groups: list[int]) -> bool:
        """Every group shows its state's fingerprint; those that differ from the lowest-ranked group's heal again."""
        slots = torch.zeros(view.groups, dtype=torch.float64)
        if self.ctx.rank == 0:
            slots[view.rank] = state_fingerprint(self.loop.model, self.loop.optimizer, self.ctx.device)
        summed = self.session.sum_over_all_ranks(slots)
        if summed is None:
            return False
        odd = differing_states(summed.tolist(), groups)
        if not odd:
            return True
        self.session.report(f"replica group(s) {odd} hold another state than group {groups[0]}")
        if self.group_id in odd:
            log.warning("this group's state differs from group %d's: it heals from it", groups[0])
            self.record_event("state_differs", from_group=groups[0])
            self.session.heal_again()
        return False

    def take_part(self, view: View) -> None:
        """The membership of `view` in what the loop writes: the writer of the folder, the world size, the
        micro-batches taken (share_of)."""
        self.writer = view.rank == 0 and not self.ended_without_this_group()
        # One group writes the folder for the job (each group's rank 0 still shows its own progress); only its
        # rank 0 logs the steps (log_train), so only it writes the certificate.
        self.loop.metrics.enabled = self.ctx.is_main and self.writer
        self.loop.world_size, self.loop.accum = view.groups * self.ctx.world_size, self.taken

    def ended_without_this_group(self) -> bool:
        """DiLoCo: whether the job's last step is already saved by the other groups, this group at that step. Its
        quorum came late to the last outer sync (after the Lighthouse's join timeout) and formed without them once
        they had finished: its last interval is in no outer step, and it must not write the last step again."""
        loop, last = self.loop, self.cfg.train.max_steps
        if self.outer is None or loop.step != last or not loop.checkpointer.holds(last):
            return False
        log.warning(
            "the other groups ended the job at step %d without this group's last interval: it writes nothing", last
        )
        return True

    def after_commit(self, view: View, summed: torch.Tensor) -> None:
        """Record who took part: the writer of the folder, world size, and any change of membership (a quorum
        event, written by the group that writes from now on). DiLoCo: the step of an outer sync is the last
        interval's, written (and saved) by its writer while it is still in the job; the new membership then takes
        part from the next step (begin_step)."""
        loop = self.loop
        self.in_job = True
        ranks = view.groups * self.ctx.world_size
        members = [int(g) - 1 for g in summed[_FIXED : _FIXED + view.groups].tolist()]
        later = self.outer is not None and bool(self.members) and self.members[0] in members
        if not later:
            self.take_part(view)
        was, loop.metrics.enabled = loop.metrics.enabled, self.ctx.is_main and view.rank == 0 and (later or self.writer)
        if members != self.members or self.discarded:  # who changed, or the same groups after a failed attempt
            old = set(self.members)
            loop.metrics.write(
                "event",
                event="quorum",
                step=loop.step + 1,
                groups=members,
                joined=sorted(set(members) - old) if self.members else [],
                left=sorted(old - set(members)),
                world_size=ranks,
                discarded_steps=self.discarded,
                evicted=sorted(self.evicted),
            )
            if loop.metrics.enabled:
                log.info("step %d: replica groups %s (%d ranks)", loop.step + 1, members, ranks)
            self.members = members
        loop.metrics.enabled = was if later else self.ctx.is_main and self.writer
        self.discarded, self.evicted = 0, set()
        self.commits += 1

    # ---- DiLoCo across the replica groups ---------------------------------------------------------

    def after_update(self, step: int) -> None:
        """train.diloco: after every H-th step and the last, the outer sync over the live replica groups."""
        if self.outer is not None and fragments_due(step, self.outer.diloco.every_steps, 1, self.cfg.train.max_steps):
            self.session.mark_step()
            self.session.at_step(step)  # a group behind this step (a replacement) heals in this quorum
            self.outer_sync(self.admitted_view())

    def outer_sync(self, view: View) -> None:
        """Outer rounds until one is committed (a round whose collective failed is discarded: the next quorum's
        groups sum again; the pseudo-gradients are unchanged). A group that trained no inner step since its weights
        were the global ones (it healed, or the groups start or resume together) contributes nothing."""
        o = self.outer
        assert o is not None
        t0 = time.perf_counter()
        while not self.outer_round(view, contributes=self.trained):
            self.discard(f"outer sync at step {self.loop.step}")
            self.session.mark_step()
            view = self.admitted_view()
        o.blocked_s += time.perf_counter() - t0

    def outer_round(self, view: View, contributes: bool) -> bool:
        """One outer round: the groups' pseudo-gradients and their count summed over the groups (fp32), the vote,
        then (committed, with a group contributing) the outer step on their mean and local := global. Whether it was
        committed."""
        o = self.outer
        assert o is not None and o.outer is not None
        n, weight = view.groups, 1.0 if contributes else 0.0
        head = torch.zeros(_FIXED + n, dtype=torch.float64)  # _LOSS: the groups that contribute
        head[_LOSS] = weight
        head[_OK] = 0.0 if view.heal is not None and not view.heal.verified else 1.0
        head[_FIXED + view.rank] = self.group_id + 1  # every rank: summed over the groups only, rank by rank
        delta = pseudo_gradient(o.global_params, o.local_params).mul_(weight)
        heads = self.session.cross_sum(head)
        if contributes and self.session.drill("die_in_outer_sync"):  # the drill: every group of the round is in it
            heads.wait()
            log.warning("fault drill: this group dies in an outer sync, before its pseudo-gradient is summed")
            os.kill(os.getpid(), signal.SIGKILL)
        for sent in (heads, self.session.cross_sum(delta)):
            sent.wait()
        o.sent_bytes += delta.numel() * delta.element_size()  # outer_sent_bytes: this rank's payload
        if not self.session.errored() and int(head[_OK]) != n:
            self.session.report(f"{n - int(head[_OK])} group(s) refused the state they healed from")
        if not self.session.should_commit():
            return False
        if head[_LOSS] > 0:  # none: the first quorum of groups that start or resume together (their weights stay)
            outer_update(o.outer, o.global_params, delta / float(head[_LOSS]))
            o.syncs += 1
            with torch.no_grad():
                for g, p in zip(o.global_params, o.local_params):
                    p.copy_(g)
        self.trained = False
        self.view = view  # the membership of the next interval's steps (begin_step)
        self.after_commit(view, head)
        return True

    # ---- what the loop writes and shows -----------------------------------------------------------

    def record_heal(self, view: View) -> None:
        """The group that healed writes the heal into metrics.jsonl itself (whoever writes the rest)."""
        heal = view.heal
        assert heal is not None
        record: dict[str, Any] = {
            "seconds": round(heal.seconds, 4),
            "bytes": heal.bytes,
            "bytes_per_s": round(heal.bytes / heal.seconds) if heal.seconds > 0 else None,
            "verified": heal.verified,
            **({"error": heal.error} if heal.error else {}),
        }
        (log.info if heal.verified else log.warning)("heal of group %d: %s", self.group_id, record)
        self.record_event("heal", **record)

    def record_event(self, event: str, **fields: Any) -> None:
        """An event of this group's own at the current step (a heal, a failed quorum)."""
        self.record_own({"event": event, "step": self.loop.step, **fields})

    def record_own(self, record: dict[str, Any]) -> None:
        """An event of this group's own (a heal, a failed quorum, how it ends), naming the group: written whichever
        group writes the rest (`ddptrain report` tells each group's story)."""
        metrics = self.loop.metrics
        was, metrics.enabled = metrics.enabled, self.ctx.is_main
        try:
            metrics.write("event", **record, **self.event_fields())
        finally:
            metrics.enabled = was

    def event_fields(self) -> dict[str, Any]:
        """This group's start, resume and end records name it."""
        return {"replica_group": self.group_id}

    def writes(self) -> bool:
        """The writing group logs the steps and saves (every group holds the same state after a commit); the
        others keep the loss only."""
        return self.writer

    def checkpoint(self, shared: dict[str, Any], local: dict[str, Any]) -> None:
        """EveryStep's (DiLoCo's with train.diloco); notes the step this group saved (stop_at_last_commit saves it
        only once)."""
        if self.outer is not None:
            self.outer.checkpoint(shared, local)
        else:
            super().checkpoint(shared, local)
        self.saved_step = self.loop.step

    def restore(self, shared: dict[str, Any], local: dict[str, Any] | None) -> dict[str, Any]:
        """EveryStep's (DiLoCo's with train.diloco: the global weights and outer optimizer)."""
        return self.outer.restore(shared, local) if self.outer is not None else super().restore(shared, local)

    def logged(self) -> dict[str, Any]:
        """DiLoCo's fields with train.diloco (outer syncs, bytes, seconds blocked in them); none otherwise."""
        return self.outer.logged() if self.outer is not None else {}

    def console_extra(self) -> dict[str, bool] | None:
        """The writing group shows the job's once-only lines (start, val_loss, done); before the first quorum,
        group 0. The others keep them in their ranks' log files."""
        shown = self.writer if self.members else self.group_id == 0
        return None if shown else FILE_ONLY

    def mean_over_ranks(self, value: torch.Tensor) -> float:
        """The logged loss is already the mean over every rank of the step (step_sum); DiLoCo's inner steps:
        the mean over this group's ranks."""
        return float(value) if self.outer is None else super().mean_over_ranks(value)

    def per_rank(self, value: torch.Tensor) -> list[float]:
        """The window's loss is the job's, the same on every rank (step_sum): no collective (a donor's live state is
        read on torchft's quorum thread)."""
        return [float(value)]
