"""DiLoCo on 2 launched gloo ranks in 2 groups of 1 (the fault toy), streaming: 2 fragments, int8 across the groups,
each sync overlapping one inner step (delay_steps=1). One job whose rank 1 fails mid-interval and is restarted by its
launcher (--max-restarts 1) resumes from a checkpoint taken while a fragment's exchange was in flight and trains bit
for bit the uninterrupted run; its metrics, checkpoints and final weights are then read by several assertions.
The same on 4 ranks in 2 groups of 2 under dist.strategy=fsdp (each group's model sharded over its 2 ranks)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import cached_run, final_model_state, read_metrics, run_ddptrain
from toys import FAULTY

from ddptrain.checkpoint import verify_checkpoint
from ddptrain.cli import main

pytestmark = pytest.mark.dist

STEPS, H = 10, 4  # fragment 1's syncs start after steps 2 and 6 and are applied a step later, fragment 0's after 4
# and 8 (applied after 5 and 9), both synced at once after 10 (the last); checkpoints at 3, 6 (fragment 1's exchange
# in flight), 9 and 10


def args(out: str, *extra: str) -> list[str]:
    return ["train", *FAULTY, f"run.dir={out}", f"train.max_steps={STEPS}", "log.every_steps=1",
            "ckpt.every_steps=3", f"train.diloco.every_steps={H}", "train.diloco.groups=2",
            "train.diloco.fragments=2", "train.diloco.outer_dtype=int8", "train.diloco.delay_steps=1", *extra]  # fmt: skip


def losses(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_metrics(run_dir)}  # a step trained again: its last record


def own_weights(ckpt: Path, rank: int) -> dict[str, torch.Tensor]:
    state: dict[str, Any] = verify_checkpoint(ckpt).load(f"diloco-rank{rank}.pt")
    return dict(state["model"])


@pytest.fixture(scope="module")
def reference(reference_cache: Path) -> Path:
    return cached_run(reference_cache, args("{out}"), nproc=2)


# 4 ranks, 2 groups of 2, each group's model sharded over its ranks: the second Linear's 1 x 16 weight and its bias
# lie on the group's first rank alone (the second holds empty shards of them).
FSDP = ["dist.strategy=fsdp", "model.shard_units=[Linear]", "data.micro_batch_size=2"]


@pytest.fixture(scope="module")
def fsdp_reference(reference_cache: Path) -> Path:
    return cached_run(reference_cache, args("{out}", *FSDP), nproc=4)


def fail_and_restart(run: Path, nproc: int, *extra: str) -> tuple[Path, str]:
    """The job on nproc ranks, its rank 1 failing in step 8 and the job restarted once by its launcher."""
    launch = ["launch", "--nproc-per-node", str(nproc), "--max-restarts", "1", "--"]
    failing = ["model.kwargs.fail_at=8", "model.kwargs.fail_rank=1"]
    done = run_ddptrain([*launch, *args(str(run), *extra, *failing)], timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return run, done.stdout + done.stderr


@pytest.fixture(scope="module")
def restarted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """Rank 1 fails in step 8 (its 8th forward), after the checkpoint of step 6 (fragment 1's sync started there,
    applied after step 7: the resumed ranks launch its exchange again), 3 steps past fragment 0's of step 4."""
    return fail_and_restart(tmp_path_factory.mktemp("diloco") / "run", 2)


@pytest.fixture(scope="module")
def fsdp_restarted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """As `restarted`, on 4 ranks under fsdp: rank 1 is group 0's second rank."""
    return fail_and_restart(tmp_path_factory.mktemp("diloco-fsdp") / "run", 4, *FSDP)


def assert_resumed_bit_exact(reference: Path, restarted: tuple[Path, str]) -> None:
    run, said = restarted
    assert "injected failure at forward 8 on rank 1" in said
    assert "resuming from" in said and "step-00000006 (step 6;" in said
    ref, got = losses(reference), losses(run)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert all(got[s] == ref[s] for s in got), [(s, got[s], ref[s]) for s in got if got[s] != ref[s]]
    a, b = final_model_state(reference), final_model_state(run)
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


@pytest.mark.timeout(300)
def test_a_group_killed_mid_interval_resumes_bit_exact(reference: Path, restarted: tuple[Path, str]) -> None:
    assert_resumed_bit_exact(reference, restarted)


def same(a: Any, b: Any) -> bool:
    """Whether two loaded states are equal, tensors bit for bit (dtype and shape too)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(a == b)


@pytest.mark.timeout(300)
def test_fsdp_groups_resume_bit_exact_and_save_shards_beside_full_global_weights(
    reference: Path, fsdp_reference: Path, fsdp_restarted: tuple[Path, str]
) -> None:
    assert_resumed_bit_exact(fsdp_reference, fsdp_restarted)
    # Each group takes the samples a rank of the 2-rank DDP run takes: the same training but for the int8 rounding
    # (each rank's shards are quantized apart from the others') and the order of the sums (measured: 6e-5 apart).
    ref, got = losses(reference), losses(fsdp_reference)
    assert got == pytest.approx(ref, rel=1e-4)
    ddp, fsdp = final_model_state(reference), final_model_state(fsdp_reference)
    assert ddp.keys() == fsdp.keys()
    for name in ddp:
        torch.testing.assert_close(fsdp[name], ddp[name], rtol=0, atol=5e-4, msg=name)
    run = fsdp_restarted[0]
    # The first checkpoint the resumed job saved (step 9) is the uninterrupted job's, file by file: the global
    # weights and the outer optimizer (full tensors), and every rank's own weights, inner optimizer and loss scale.
    ref, got = (verify_checkpoint(r / "checkpoints" / "step-00000009") for r in (fsdp_reference, run))
    for key in ("model", "optimizer"):
        assert same(ref.state(key), got.state(key)), key
    for rank in range(4):
        mine = got.load(f"diloco-rank{rank}.pt")
        assert same(ref.load(f"diloco-rank{rank}.pt"), mine), rank
        shards = {name: tuple(t.shape) for name, t in mine["model"].items()}  # group 0 or 1's shard 0 or 1
        first = rank % 2 == 0
        assert shards == {"net.0.weight": (8, 8), "net.0.bias": (8,), "net.2.weight": (1, 16) if first else (0, 16),
                          "net.2.bias": (1,) if first else (0,)}  # fmt: skip
    momentum = {k: tuple(v["momentum_buffer"].shape) for k, v in got.state("optimizer")["state"].items()}
    assert sorted(momentum.values()) == [(1,), (1, 16), (16,), (16, 8)]  # full, as the global weights are
    assert got.state("trainer")["sync"]["strategy"] == "fsdp"
    # Fragment 1 (net.0.bias and net.2) in flight at step 6, each rank's shards of it in int8 and one fp32 scale:
    # rank 0 holds 8 + 16 + 1 of its values, rank 1 the other 8 (its shards of net.2 are empty).
    saved = verify_checkpoint(run / "checkpoints" / "step-00000006")
    in_flight = [saved.load(f"diloco-rank{rank}.pt")["in_flight"] for rank in (0, 1)]
    assert [f["fragments"] for f in in_flight] == [[1], [1]]
    assert [f["sent"].numel() for f in in_flight] == [25 + 4, 8 + 4]


@pytest.mark.timeout(60)
def test_outer_syncs_are_seen_and_every_rank_ends_on_the_global_weights(
    restarted: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    run, said = restarted
    records = {m["step"]: m for m in read_metrics(run)}
    # a fragment every H / 2 steps, applied a step after it started; both at the last step
    assert all(m["outer_syncs"] == ((s - 1) // 2 if s < STEPS else 5) for s, m in records.items()), records
    assert {m["diloco_groups"] for m in records.values()} == {2}
    assert all(m["outer_sync_s"] >= 0 for m in records.values())
    assert "outer_syncs 5" in said  # the progress line
    assert "2 fragment(s) in int8: 0.000132 MB per outer sync (the largest fragment) instead of 0.000644 MB" in said
    assert main(["report", str(run)]) == 0  # in this process
    shown = capsys.readouterr().out
    assert "DiLoCo: 2 groups, 5 outer syncs by step 10 (0.000132 MB sent each)" in shown, shown
    ckpts = run / "checkpoints"
    final = ckpts / f"step-{STEPS:08d}"
    manifest = json.loads((final / "manifest.json").read_text())
    assert sorted(n for n in manifest["files"] if n.startswith("diloco-")) == ["diloco-rank0.pt", "diloco-rank1.pt"]
    global_weights = final_model_state(run)
    # The larger fragment's int8 pseudo-gradient and its one scale: the first Linear's 8 x 16 weight (128 of the 161
    # values: the closest cut to half); the other fragment holds the rest.
    sizes = [t.numel() for t in global_weights.values()]
    assert sizes == [128, 16, 16, 1]
    sent = 128 + 4
    assert {m["outer_sync_bytes"] for m in records.values()} == {sent}
    # Launched at 2 and 6 (fragment 1: 33 values and a scale), 4 and 8 (fragment 0), 10 (all 161 values, one scale).
    launched = {2: 33 + 4, 4: sent, 6: 33 + 4, 8: sent, 10: 161 + 4}
    assert {s: m["outer_sent_bytes"] for s, m in records.items()} == {s: launched.get(s, 0) for s in records}
    in_flight = verify_checkpoint(ckpts / "step-00000006").load("diloco-rank1.pt")["in_flight"]
    assert in_flight["fragments"] == [1] and in_flight["sent"].numel() == 33 + 4
    # After the last sync both groups hold the global weights; a step after a sync they differ again.
    for rank in (0, 1):
        own = own_weights(final, rank)
        assert all(torch.equal(own[name], global_weights[name]) for name in global_weights)
    mid = ckpts / "step-00000009"
    apart = own_weights(mid, 0), own_weights(mid, 1)
    assert any(not torch.equal(apart[0][name], apart[1][name]) for name in apart[0])
