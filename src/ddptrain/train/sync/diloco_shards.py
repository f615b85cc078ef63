"""DiLoCo's state under FSDP (dist.strategy=fsdp): local shards for the outer sync, full tensors for a checkpoint.

Each DiLoCo group shards its model over its own ranks (FSDP2, train/parallel.py), so a rank's parameters are
DTensors holding its shard. The groups are the same size and shard alike: the rank of index i in every group holds
shard i of every parameter. So the pseudo-gradient, its exchange across the groups (between exactly those ranks) and
the outer step work on the local shards as plain tensors, as they work on whole tensors under DDP.

A checkpoint's shared state is written by a format that takes it to be the same on every rank (sharded,
rank0-torch): the global weights and the outer optimizer's momentum are gathered into full tensors over the group
(`full`: an all-gather per tensor, at saves only) and a resume cuts each rank's shard out of them again (`shard_of`:
no communication). A rank's own weights and inner optimizer are saved as its local shards (`local_tree`: plain
tensors) and put back into DTensors laid out like the live parameters at a resume (`as_dtensors`).

Every function returns tensors that are not DTensors (DDP, one process) as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from ddptrain.checkpoint.formats.common import map_tree


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's local shard (sharing its storage), any other tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_shape(param: torch.Tensor) -> torch.Size:
    """The shape of this rank's part of a parameter (its local shard's under FSDP): its own state tensors' shape."""
    return local_shard(param).shape


def full_shape(param: torch.Tensor) -> torch.Size:
    """A parameter's full shape (a DTensor's global one): its state tensors' shape in a checkpoint's shared state."""
    return param.shape


def full(shard: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The full tensor whose local shard on this rank is `shard`, laid out as parameter `like` (a collective over
    its mesh, every rank of the group in the same order); `shard` itself when `like` is not a DTensor."""
    if not isinstance(like, DTensor):
        return shard
    spread = DTensor.from_local(shard, like.device_mesh, like.placements, shape=like.shape, stride=like.stride())
    return spread.full_tensor()


def shard_of(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's shard of the full tensor `whole`, laid out as parameter `like` (cut locally, no communication);
    `whole` itself when `like` is not a DTensor."""
    if not isinstance(like, DTensor):
        return whole
    return distribute_tensor(whole.to(like.device), like.device_mesh, like.placements, src_data_rank=None).to_local()


def local_tree(obj: Any) -> Any:
    """A copy of obj's dicts, lists and tuples with every DTensor replaced by its local shard (what torch.save
    keeps of a rank's own state); dicts keep their type and attributes (a state dict's _metadata)."""
    return map_tree(obj, lambda o: o.to_local() if isinstance(o, DTensor) else o)


def as_dtensor(shard: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`shard` (a local shard as local_tree saved it) as a DTensor laid out as `like`; `shard` itself when `like` is
    not a DTensor."""
    if not isinstance(like, DTensor):
        return shard
    return DTensor.from_local(shard.to(like.device), like.device_mesh, like.placements, shape=like.shape,
                              stride=like.stride())  # fmt: skip


def as_dtensors(state: dict[str, Any], like: dict[str, torch.Tensor]) -> dict[str, Any]:
    """A model state dict saved by local_tree with each entry that is a DTensor in `like` (the live model's state
    dict) a DTensor again."""
    return {k: as_dtensor(v, like[k]) if k in like else v for k, v in state.items()}


def map_optimizer_state(
    state: dict[str, Any],
    params: Sequence[torch.Tensor],
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    shaped: Callable[[torch.Tensor], torch.Size],
) -> dict[str, Any]:
    """An optimizer's state_dict() (keyed by parameter index) with fn(tensor, parameter) in place of every state
    tensor of parameter k (params[k]) shaped as shaped(parameter) (SGD's momentum, AdamW's moments; not a step
    count); the rest as it is."""

    def each(k: int, values: dict[str, Any]) -> dict[str, Any]:
        p = params[k]
        return {
            n: fn(v, p) if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == shaped(p) else v
            for n, v in values.items()
        }

    return {**state, "state": {k: each(k, v) for k, v in state["state"].items()}}
