"""Property: whatever happens to a checkpoints folder, resume loads only verified bytes, falls back to an
older verified checkpoint, or refuses (exit 2); pruning never removes the newest verified checkpoint.

Hypothesis draws sequences of mutations (flip, truncate, delete, rename, strangers, symlinks, manifest
fields of the wrong type, re-checksummed or not) applied to a folder of three committed checkpoints.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddptrain.checkpoint import Checkpointer, committed_checkpoints, verify_checkpoint
from ddptrain.checkpoint.formats.rank0_torch import RankZeroTorchWriter
from ddptrain.checkpoint.manifest import manifest_checksum
from ddptrain.config import CkptConfig
from ddptrain.dist import DistContext
from ddptrain.errors import CheckpointError

STEPS = (2, 4, 6)
FILES = ("model.pt", "optimizer.pt", "trainer.pt", "rng-rank0.pt", "manifest.json")
APPLIED: Counter[str] = Counter()


def state(step: int) -> tuple[dict[str, Any], dict[str, Any]]:
    g = torch.Generator().manual_seed(step)
    return (
        {"model": {"w": torch.randn(8, 8, generator=g)}, "optimizer": {"state": {}}, "trainer": {"step": step}},
        {"rng": {"torch": torch.randn(4, generator=g)}},
    )


def checkpointer(run_dir: Path, **cfg: Any) -> Checkpointer:
    c = Checkpointer(CkptConfig(**cfg), run_dir, DistContext(), {"note": "property"}, writer=RankZeroTorchWriter())
    c.setup()
    return c


def save(c: Checkpointer, step: int) -> None:
    c.save(step, *state(step))
    (r,) = c.finished()
    assert r.ok, r.error


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)
mutation = st.one_of(
    st.tuples(
        st.just("flip"), st.sampled_from(STEPS), st.sampled_from(FILES), st.integers(0, 10_000), st.integers(1, 255)
    ),
    st.tuples(st.just("truncate"), st.sampled_from(STEPS), st.sampled_from(FILES), st.integers(0, 10_000)),
    st.tuples(st.just("delete"), st.sampled_from(STEPS), st.sampled_from(FILES)),
    st.tuples(st.just("rename_file"), st.sampled_from(STEPS), st.sampled_from(FILES), st.sampled_from(FILES)),
    st.tuples(st.just("rename_folder"), st.sampled_from(STEPS), st.integers(0, 12)),
    st.tuples(st.just("stranger_file"), st.sampled_from(STEPS), st.sampled_from(["x.pt", "model.pt.bak", ".hidden"])),
    st.tuples(st.just("stranger_folder"), st.integers(0, 99_999_999), st.booleans()),
    st.tuples(st.just("symlink_file"), st.sampled_from(STEPS), st.sampled_from(FILES)),
    st.tuples(st.just("symlink_folder"), st.integers(0, 12), st.sampled_from(STEPS)),
    st.tuples(
        st.just("manifest_field"),
        st.sampled_from(STEPS),
        st.sampled_from(
            [
                "format",
                "step",
                "world_size",
                "timeline",
                "writer",
                "created",
                "files",
                "config",
                "identity",
                "checksum",
                "extra",
            ]
        ),
        json_values,
        st.booleans(),
    ),
    st.tuples(
        st.just("manifest_name"),
        st.sampled_from(STEPS),
        st.sampled_from(["../outside.bin", "/etc/hostname", "sub/model.pt", "..", "model.pt/", "é.pt"]),
        st.booleans(),
    ),
)


def apply(run_dir: Path, m: tuple[Any, ...]) -> set[int]:
    """Apply one mutation; the original steps it may have touched."""
    ckpts = run_dir / "checkpoints"
    kind, *args = m
    folder = ckpts / f"step-{args[0]:08d}" if isinstance(args[0], int) and kind != "stranger_folder" else None
    if kind in ("rename_folder", "symlink_folder", "stranger_folder"):
        folder = None
    APPLIED[kind] += 1
    if folder is not None and (folder.is_symlink() or not folder.is_dir()):
        return set()
    if kind == "flip":
        f = folder / args[1]
        if f.is_file() and f.stat().st_size:
            data = bytearray(f.read_bytes())
            data[args[2] % len(data)] ^= args[3]
            f.write_bytes(bytes(data))
    elif kind == "truncate":
        f = folder / args[1]
        if f.is_file():
            data = f.read_bytes()
            f.write_bytes(data[: args[2] % max(len(data), 1)])
    elif kind == "delete":
        (folder / args[1]).unlink(missing_ok=True)
    elif kind == "rename_file":
        if (folder / args[1]).is_file():
            os.replace(folder / args[1], folder / args[2])
    elif kind == "rename_folder":
        src, dst = ckpts / f"step-{args[0]:08d}", ckpts / f"step-{args[1]:08d}"
        if src.is_dir() and not src.is_symlink() and not dst.exists() and not dst.is_symlink():
            os.rename(src, dst)
            return {args[0], args[1]}
        return set()
    elif kind == "stranger_file":
        (folder / args[1]).write_bytes(b"stranger")
    elif kind == "stranger_folder":
        stranger = ckpts / f"step-{args[0]:08d}"
        if not stranger.exists() and not stranger.is_symlink():
            stranger.mkdir()
            if args[1]:
                (stranger / "manifest.json").write_text("{}")
        return {args[0]}
    elif kind == "symlink_file":
        f = folder / args[1]
        outside = run_dir / f"outside-{args[1]}"
        if f.is_file() and not f.is_symlink():
            os.replace(f, outside)
            f.symlink_to(outside)
    elif kind == "symlink_folder":
        link, target = ckpts / f"step-{args[0]:08d}", ckpts / f"step-{args[1]:08d}"
        if not link.exists() and not link.is_symlink():
            link.symlink_to(target)
        return {args[0]}
    elif kind in ("manifest_field", "manifest_name"):
        path = folder / "manifest.json"
        try:
            fields = json.loads(path.read_text())
        except (OSError, ValueError):
            return {args[0]}
        if not isinstance(fields, dict):
            return {args[0]}
        if kind == "manifest_field":
            fields[args[1]] = args[2]
        elif isinstance(fields.get("files"), dict):
            fields["files"][args[1]] = {"digest": "0" * 64, "size": 10}
        if args[-1]:  # an attacker who recomputes the checksum
            try:
                fields["checksum"] = manifest_checksum(fields)
            except (TypeError, ValueError):
                pass
        path.write_text(json.dumps(fields))
    return {args[0]}


def verified_of(path: Path, timeline: str) -> bool:
    """Whether path is a fully verified checkpoint of timeline."""
    try:
        return verify_checkpoint(path).manifest.timeline == timeline
    except CheckpointError:
        return False


@settings(
    max_examples=int(os.environ.get("DDPTRAIN_PROPERTY_EXAMPLES", "25")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(st.lists(mutation, min_size=1, max_size=6))
def check_mutations(mutations: list[tuple[Any, ...]]) -> None:
    run_dir = Path(tempfile.mkdtemp(prefix="ckpt-prop-"))
    try:
        writer = checkpointer(run_dir, keep=10)
        for s in STEPS:
            save(writer, s)
        touched: set[int] = set()
        for m in mutations:
            touched |= apply(run_dir, m)
        untouched = [s for s in STEPS if s not in touched]
        resumer = checkpointer(run_dir, keep=1)
        try:
            found = resumer.find_resume(lambda _: None)
        except CheckpointError as e:
            assert "\n" not in str(e)
            assert not untouched, f"refused although {untouched} are intact: {e}"
            return
        assert found is not None, "checkpoints exist: resume=auto must never start over silently"
        ckpt = found.checkpoint
        assert ckpt.path.parent == run_dir / "checkpoints" and not ckpt.path.is_symlink()
        if untouched:
            assert ckpt.step >= max(untouched)
        shared, local = resumer.read(ckpt)  # every byte loaded, re-checked against the manifest
        expected_shared, expected_local = state(ckpt.step)
        assert torch.equal(shared["model"]["w"], expected_shared["model"]["w"])
        assert shared["trainer"] == expected_shared["trainer"] and local is not None
        assert torch.equal(local["rng"]["torch"], expected_local["rng"]["torch"])
        # Pruning after the next commit: the new newest survives, and nothing that is not ours goes away.
        before = {p.name for p in committed_checkpoints(run_dir / "checkpoints")}
        prunable = {name for name in before if verified_of(run_dir / "checkpoints" / name, resumer.timeline)}
        save(resumer, 100)
        after = {p.name for p in committed_checkpoints(run_dir / "checkpoints")}
        assert verify_checkpoint(run_dir / "checkpoints" / "step-00000100").manifest.timeline == resumer.timeline
        assert before - after <= prunable, (before - after, prunable)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def test_mutated_checkpoint_folders_resume_only_verified_state() -> None:
    APPLIED.clear()
    check_mutations()
    total = sum(APPLIED.values())
    print(f"\ncheckpoint mutations applied: {total} ({dict(sorted(APPLIED.items()))})")
    assert total >= 25 and len(APPLIED) >= 6
