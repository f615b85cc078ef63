"""Record what would make the host wait for the device: reads of tensor values and copies to the host.

On a GPU, `Tensor.item()`, `float(t)`, `bool(t)`, `int(t)`, `t.tolist()`, `t.numpy()` and copies to
the CPU block the Python thread until the device queue has drained. On a CPU run they are free, so
timing cannot find them: `HostSyncRecorder`, a TorchFunctionMode, records every such call instead.

Reads made by the input pipeline (torch.utils.data and ddptrain.data: the sampler's permutation,
the loader's seed) are recorded with `host_side=True`: those tensors live on the host by design,
also on a GPU machine, where the batch reaches the device only afterwards.

Copies: `.cpu()` is recorded wherever it is called. `.to(<cpu>)` and `copy_` into a CPU tensor are
recorded when ddptrain's own code calls them: inside torch, moves go to the parameters' device
(the accelerator on a GPU machine, where they are no copy to the host), and on a CPU machine
every device is the host, so the call site is what tells them apart.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

import ddptrain

PACKAGE_DIR = str(Path(ddptrain.__file__).resolve().parent)
INPUT_PIPELINE = (str(Path(torch.__file__).resolve().parent / "utils" / "data"), str(Path(PACKAGE_DIR) / "data"))
HOST_READS = {
    torch.Tensor.item: "item",
    torch.Tensor.__float__: "__float__",
    torch.Tensor.__bool__: "__bool__",
    torch.Tensor.__int__: "__int__",
    torch.Tensor.__index__: "__index__",
    torch.Tensor.tolist: "tolist",
    torch.Tensor.numpy: "numpy",
    torch.Tensor.cpu: "cpu",
}
MOVES = {torch.Tensor.to: "to", torch.Tensor.copy_: "copy_"}


@dataclass
class HostSync:
    """One recorded call: what, at which step tag, from where (file:line of the nearest ddptrain frame)."""

    kind: str
    tag: Any
    where: str
    host_side: bool  # made by the input pipeline, on tensors that live on the host by design


def _targets_cpu(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if func is torch.Tensor.copy_:
        return isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu"
    for a in (*args[1:], kwargs.get("device")):
        if isinstance(a, (str, torch.device)):
            return torch.device(a).type == "cpu"
        if isinstance(a, torch.Tensor):  # .to(other): other's device
            return a.device.type == "cpu"
    return False  # .to(dtype) only


def _caller() -> tuple[str, bool, bool]:
    """file:line of the innermost ddptrain frame (else the innermost frame), whether the direct
    caller is ddptrain, and whether the call comes from the input pipeline."""
    frames = traceback.extract_stack()[:-2]  # drop this function and __torch_function__
    direct = frames[-1].filename.startswith(PACKAGE_DIR) if frames else False
    host_side = any(f.filename.startswith(INPUT_PIPELINE) for f in frames)
    where = next((f for f in reversed(frames) if f.filename.startswith(PACKAGE_DIR)), frames[-1] if frames else None)
    return (f"{Path(where.filename).name}:{where.lineno}" if where else "?"), direct, host_side


class HostSyncRecorder(TorchFunctionMode):
    """Records host syncs (see the module docstring) under the current `tag` while active."""

    def __init__(self) -> None:
        super().__init__()
        self.tag: Any = None
        self.calls: list[HostSync] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        kind = HOST_READS.get(func)
        if kind is None and func in MOVES and _targets_cpu(func, args, kwargs):
            where, direct, host_side = _caller()
            if direct:
                self.calls.append(HostSync(MOVES[func], self.tag, where, host_side))
        elif kind is not None:
            where, _, host_side = _caller()
            self.calls.append(HostSync(kind, self.tag, where, host_side))
        return func(*args, **kwargs)

    def device_syncs(self) -> list[HostSync]:
        """The calls that would wait for the accelerator on a GPU machine (all but the input pipeline's)."""
        return [c for c in self.calls if not c.host_side]


def describe(calls: list[HostSync]) -> str:
    """One line per call, for assertion messages."""
    return "; ".join(f"{c.kind} at {c.where} (step {c.tag})" for c in calls) or "none"
