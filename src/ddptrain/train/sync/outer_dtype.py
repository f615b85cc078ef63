"""The dtype DiLoCo's pseudo-gradients cross the groups in (train.diloco.outer_dtype), and their mean over the groups.

fp32: one all-reduce (a sum), divided by the group count. bf16 and int8: each rank's pseudo-gradient is encoded
into bytes (bf16: 2 per value; int8: 1 per value and one fp32 scale per CHUNK values, absmax / 127, rounded to the
nearest), the groups all-gather the bytes (an int8 or bf16 sum would overflow or round in an order each backend
picks; gloo reduces neither and gathers only some dtypes, bytes among them), and every rank decodes them and sums
the groups' values in group order in fp32: every rank computes the identical mean, on gloo and NCCL alike.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

CHUNK = 2048  # values per int8 scale
INT8_MAX = 127


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values, fp32 scale of each CHUNK values): x / scale rounded to the nearest, scale = the chunk's absmax
    / 127 (a chunk of zeros: scale 0, values 0)."""
    n = x.numel()
    padded = torch.zeros(-(-n // CHUNK) * CHUNK, dtype=torch.float32, device=x.device)
    padded[:n] = x.flatten()
    chunks = padded.view(-1, CHUNK)
    scales = chunks.abs().amax(dim=1) / INT8_MAX
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(chunks / safe[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.flatten()[:n], scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 values int8 values `q` and their chunks' `scales` stand for."""
    return q.float() * scales.repeat_interleave(CHUNK)[: q.numel()]


def payload_bytes(numel: int, dtype: str) -> int:
    """Bytes of one rank's pseudo-gradient of `numel` values on the wire in `dtype`."""
    if dtype == "int8":
        return numel + 4 * -(-numel // CHUNK)
    return numel * (2 if dtype == "bf16" else 4)


def encode(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """x (fp32) as the bytes (uint8) that cross the groups in `dtype` (bf16 or int8: scales first, then values)."""
    if dtype == "bf16":
        return x.to(torch.bfloat16).view(torch.uint8)
    q, scales = quantize_int8(x)
    return torch.cat([scales.view(torch.uint8), q.view(torch.uint8)])


def decode(payload: torch.Tensor, dtype: str, numel: int) -> torch.Tensor:
    """The fp32 values of `numel` values that `encode` turned into `payload`."""
    if dtype == "bf16":
        return payload.view(torch.bfloat16).float()
    head = 4 * -(-numel // CHUNK)
    return dequantize_int8(payload[head:].view(torch.int8), payload[:head].view(torch.float32))


def mean_of_payloads(payloads: list[torch.Tensor], dtype: str, numel: int) -> torch.Tensor:
    """The mean of the groups' decoded values, summed in group order (the same bits wherever it is computed)."""
    total = decode(payloads[0], dtype, numel).clone()
    for payload in payloads[1:]:
        total.add_(decode(payload, dtype, numel))
    return total.div_(len(payloads))


def group_mean(delta: torch.Tensor, dtype: str, across: dist.ProcessGroup | None, groups: int) -> torch.Tensor:
    """The mean over the groups of each group's `delta` (fp32, flat), sent in `dtype` through `across` (this rank and
    its counterparts in the other groups, in group order; None or 1 group: this rank's own, through the dtype)."""
    exchange = across is not None and groups > 1
    if dtype == "fp32":
        if exchange:
            dist.all_reduce(delta, group=across)
        return delta.div_(groups)
    mine = encode(delta, dtype)
    payloads = [mine]
    if exchange:
        payloads = [torch.empty_like(mine) for _ in range(groups)]
        dist.all_gather(payloads, mine, group=across)
    return mean_of_payloads(payloads, dtype, delta.numel())
