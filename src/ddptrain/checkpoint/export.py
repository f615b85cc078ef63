"""A checkpoint's plain model weights as safetensors, plus the model config beside them.

Used by `ddptrain export` and, with `log.track_artifacts: [model]`, at the end of a run.

Every export is written into a fresh temp folder beside its destination and moved into place only
when complete (staged_output): a full or read-only disk, or any other failure, leaves no partial
file or folder behind and nothing that was there before is touched. Moving is a rename, which
replaces a link planted under an output's name instead of writing through it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ddptrain.checkpoint.store import select_checkpoint
from ddptrain.errors import UserError
from ddptrain.safe_files import fsync_dir, open_new_no_follow, refuse_symlink


def _write_error(error: Exception, dest: Path) -> Exception:
    """What a failed write becomes: an OSError naming dest (the CLI's one line, exit 2 for a full or read-only
    disk), also for safetensors' own error type, which wraps the OS error's code in its message; any other
    exception stays as it is."""
    if isinstance(error, OSError):
        return OSError(error.errno, error.strerror or str(error), str(dest))
    if type(error).__name__ != "SafetensorError":
        return error
    code = re.search(r"os error (\d+)", str(error))
    if code is not None:
        return OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(dest))
    return UserError(f"cannot write {dest}: {' '.join(str(error).split())[:200]}")


def refuse_links_inside(run_dir: Path, folder: Path) -> None:
    """OSError (ELOOP) when a folder from run_dir down to folder is a symbolic link, for a folder inside run_dir
    (a planted link there must not send an export elsewhere); a path outside run_dir is the user's own."""
    try:
        rel = folder.absolute().relative_to(run_dir.absolute())
    except ValueError:
        return
    for depth in range(len(rel.parts)):
        refuse_symlink(run_dir.joinpath(*rel.parts[: depth + 1]))


@contextmanager
def staged_output(dest: Path) -> Iterator[Path]:
    """A fresh, empty folder to write dest's files into; when the block succeeds, they become dest's (dest is
    created, with its missing parents, by one rename; an existing dest gets each file by a rename of its own).

    On any failure the temp folder is removed and dest, and what was there, stay as they were; an OSError or
    safetensors error leaves as an OSError naming dest.
    """
    anchor = dest
    while not anchor.is_dir():  # the nearest existing folder: the temp folder lives there (same filesystem)
        if anchor.is_symlink() or anchor.exists() or anchor.parent == anchor:
            raise OSError(20, "not a directory", str(anchor))
        anchor = anchor.parent
    staging = anchor / f".export-{dest.name}-{uuid.uuid4().hex[:12]}.tmp"
    work = staging / dest.relative_to(anchor)
    try:
        os.mkdir(staging)
        work.mkdir(parents=True, exist_ok=True)
        yield work
        if anchor == dest:
            for item in sorted(work.iterdir()):
                os.replace(item, dest / item.name)
        else:
            top = dest.relative_to(anchor).parts[0]
            os.rename(staging / top, anchor / top)  # refused (EEXIST/ENOTEMPTY) if it appeared meanwhile
        fsync_dir(dest)
    except Exception as e:
        mapped = _write_error(e, dest)
        if mapped is e:
            raise
        raise mapped from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def export_model(run_dir: Path, out_path: Path, step: int | None, say: Callable[[str], None]) -> tuple[Path, int]:
    """Write the weights of the checkpoint at step (None: the newest verified) to out_path and out_path.json.

    Returns (the checkpoint exported, the number of tensors). say: where rejected checkpoints are named.
    """
    from safetensors.torch import save_file

    ckpt = select_checkpoint(run_dir, step, say)
    path, manifest = ckpt.path, ckpt.manifest
    state = ckpt.state("model")
    # safetensors stores no aliases: tied weights (wte / lm_head) become two plain copies.
    tensors = {k: v.detach().clone().contiguous() for k, v in state.items()}
    model_cfg = manifest.config["model"]
    about = {"model": model_cfg, "step": manifest.step, "checkpoint": path.name}
    refuse_links_inside(run_dir, out_path.parent)
    with staged_output(out_path.parent) as work:
        metadata = {"ddptrain_step": str(manifest.step), "ddptrain_model": json.dumps(model_cfg)}
        save_file(tensors, str(work / out_path.name), metadata=metadata)
        with open_new_no_follow(work / out_path.with_suffix(".json").name) as f:
            f.write(json.dumps(about, indent=2).encode())
    return path, len(tensors)
