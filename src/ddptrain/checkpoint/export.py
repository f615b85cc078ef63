"""A checkpoint's plain model weights as safetensors, plus the model config beside them.

Used by `ddptrain export` and, with `log.track_artifacts: [model]`, at the end of a run.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from ddptrain.checkpoint.store import select_checkpoint


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
    out_path.parent.mkdir(parents=True, exist_ok=True)
    model_cfg = manifest.config["model"]
    save_file(
        tensors, str(out_path), metadata={"ddptrain_step": str(manifest.step), "ddptrain_model": json.dumps(model_cfg)}
    )
    about = {"model": model_cfg, "step": manifest.step, "checkpoint": path.name}
    out_path.with_suffix(".json").write_text(json.dumps(about, indent=2))
    return path, len(tensors)
