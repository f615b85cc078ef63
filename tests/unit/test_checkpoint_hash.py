"""The checksum a checkpoint names (ckpt.hash): each algorithm saves and resumes bit-exact, catches a
flipped byte, old manifests (format 2: `sha256` per file, no algorithm named) still verify, and a
manifest naming an algorithm this ddptrain does not know is refused in one line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from ddptrain.checkpoint import Checkpointer, verify_checkpoint
from ddptrain.checkpoint.digests import DEFAULT_HASH, HASHES, SHOWN, is_digest, new_hasher
from ddptrain.checkpoint.manifest import manifest_checksum
from ddptrain.cli import main
from ddptrain.config import CkptConfig
from ddptrain.dist import DistContext
from ddptrain.errors import CheckpointError


def state(step: int) -> tuple[dict[str, Any], dict[str, Any]]:
    g = torch.Generator().manual_seed(step)
    shared = {
        "model": {"w": torch.randn(32, 16, generator=g), "b": torch.randn(7, generator=g).to(torch.bfloat16)},
        "optimizer": {"state": {0: {"exp_avg": torch.randn(5, generator=g)}}, "param_groups": [{"lr": 0.1}]},
        "trainer": {"step": step},
    }
    return shared, {"rng": {"torch": torch.randn(4, generator=g)}}


def checkpointer(run_dir: Path, **cfg: Any) -> Checkpointer:
    c = Checkpointer(CkptConfig(**cfg), run_dir, DistContext(), {"note": "hash"})  # the default (sharded) writer
    c.setup()
    return c


def saved(run_dir: Path, algorithm: str, step: int = 3) -> Path:
    c = checkpointer(run_dir, hash=algorithm)
    c.save(step, *state(step))
    (result,) = c.finished()
    assert result.ok and result.path is not None, result.error
    return result.path


def edit_manifest(folder: Path, change: Any) -> None:
    """Rewrite manifest.json as its writer would have (checksum recomputed, indent=1)."""
    path = folder / "manifest.json"
    fields = json.loads(path.read_bytes())
    change(fields)
    fields["checksum"] = manifest_checksum(fields)
    path.write_bytes(json.dumps(fields, indent=1, ensure_ascii=True, allow_nan=False).encode())


def to_format_2(fields: dict[str, Any]) -> None:
    """The manifest in the shape ddptrain wrote before it named the algorithm: format 2, `sha256` per file."""
    del fields["hash"]
    fields["format"] = 2
    fields["files"] = {n: {"sha256": e["digest"], "size": e["size"]} for n, e in fields["files"].items()}


def assert_resumes_exactly(run_dir: Path, step: int) -> None:
    found = checkpointer(run_dir).find_resume(lambda _: None)  # resumed under the default: either algorithm reads
    assert found is not None and found.checkpoint.step == step
    shared, local = checkpointer(run_dir).read(found.checkpoint)
    want_shared, want_local = state(step)
    for key in ("w", "b"):
        got, want = shared["model"][key], want_shared["model"][key]
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert torch.equal(shared["optimizer"]["state"][0]["exp_avg"], want_shared["optimizer"]["state"][0]["exp_avg"])
    assert shared["trainer"] == want_shared["trainer"] and local is not None
    assert torch.equal(local["rng"]["torch"], want_local["rng"]["torch"])


def test_every_registered_algorithm_hashes_and_blake3_is_the_default() -> None:
    assert set(HASHES) == set(SHOWN) and CkptConfig().hash == DEFAULT_HASH == "blake3"
    for name in HASHES:
        hasher = new_hasher(name)
        hasher.update(b"ddptrain")
        assert is_digest(name, hasher.hexdigest())


@pytest.mark.parametrize("algorithm", HASHES)
def test_each_algorithm_is_named_records_the_files_digests_and_resumes_bit_exact(
    tmp_path: Path, algorithm: str
) -> None:
    folder = saved(tmp_path, algorithm)
    fields = json.loads((folder / "manifest.json").read_bytes())
    assert fields["format"] == 3 and fields["hash"] == algorithm
    for name, entry in fields["files"].items():
        hasher = new_hasher(algorithm)
        hasher.update((folder / name).read_bytes())
        assert entry == {"digest": hasher.hexdigest(), "size": (folder / name).stat().st_size}, name
    assert verify_checkpoint(folder).manifest.hash == algorithm
    assert_resumes_exactly(tmp_path, 3)


@pytest.mark.parametrize("algorithm", HASHES)
def test_a_flipped_byte_is_caught_under_each_algorithm(tmp_path: Path, algorithm: str) -> None:
    folder = saved(tmp_path, algorithm)
    part = next(p for p in sorted(folder.iterdir()) if p.name.startswith("tensors-"))
    data = bytearray(part.read_bytes())
    data[len(data) - 3] ^= 0x10  # tensor bytes: the header still decodes, only the digest can tell
    part.write_bytes(bytes(data))
    with pytest.raises(
        CheckpointError, match=f"file {part.name} does not match its {SHOWN[algorithm]} in the manifest"
    ):
        verify_checkpoint(folder)


def test_an_old_format_manifest_verifies_and_resumes_bit_exact(tmp_path: Path) -> None:
    folder = saved(tmp_path, "sha256")
    edit_manifest(folder, to_format_2)
    fields = json.loads((folder / "manifest.json").read_bytes())
    assert fields["format"] == 2 and "hash" not in fields
    assert all(set(e) == {"sha256", "size"} for e in fields["files"].values())
    assert verify_checkpoint(folder).manifest.hash == "sha256"
    assert_resumes_exactly(tmp_path, 3)


def test_an_old_format_manifest_means_sha256_whatever_its_digests_are(tmp_path: Path) -> None:
    folder = saved(tmp_path, "blake3")
    edit_manifest(folder, to_format_2)  # BLAKE3 digests relabelled as format 2, which is SHA-256: refused
    with pytest.raises(CheckpointError, match="does not match its SHA-256 in the manifest"):
        verify_checkpoint(folder)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda f: f.update(hash="md5"), " names an unknown hash algorithm 'md5' (this ddptrain knows blake3, sha256)"),
        (lambda f: f.pop("hash"), " has no 'hash'"),
        (lambda f: f.update(hash=["blake3"]), ": 'hash' is a list, not a str"),
        (lambda f: f.update(format=4), " has format 4; this ddptrain reads formats 2 and 3 (checksummed manifests)"),
    ],
)
def test_an_unknown_or_missing_algorithm_is_refused_in_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], change: Any, message: str
) -> None:
    folder = saved(tmp_path / "run", "blake3", step=1)
    edit_manifest(folder, change)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    rc = main(["export", str(tmp_path / "run"), "--step", "1", "--out", str(tmp_path / "model.safetensors")])
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in out + err, (rc, out, err)
    assert lines[0] == f"ddptrain export: error: step-00000001: manifest.json{message}", lines[0]
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # a refused command changes nothing
