"""The dtype DiLoCo's pseudo-gradients cross the groups in (train.diloco.outer_dtype), and their mean over the groups.

fp32: one all-reduce (a sum), divided by the group count. bf16 and int8: each rank's pseudo-gradient is encoded
into bytes (bf16: 2 per value; int8: 1 per value and one fp32 scale per INT8_CHUNK values, config/train.py's,
absmax / 127, rounded to the nearest), the groups all-gather the bytes (an int8 or bf16 sum would overflow or round in an order each backend
picks; gloo reduces neither and gathers only some dtypes, bytes among them), and every rank decodes them and sums
the groups' values in group order in fp32: every rank computes the identical mean, on gloo and NCCL alike.

The exchange is asynchronous (`Exchange`: launched, then waited for), so that train.diloco.delay_steps inner steps
can run while it travels; with no delay DiLoCo waits for it at once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddptrain.config.train import INT8_CHUNK

INT8_MAX = 127


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values, fp32 scale of each INT8_CHUNK values): x / scale rounded to the nearest, scale = the chunk's absmax
    / 127 (a chunk of zeros: scale 0, values 0)."""
    n = x.numel()
    padded = torch.zeros(-(-n // INT8_CHUNK) * INT8_CHUNK, dtype=torch.float32, device=x.device)
    padded[:n] = x.flatten()
    chunks = padded.view(-1, INT8_CHUNK)
    scales = chunks.abs().amax(dim=1) / INT8_MAX
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(chunks / safe[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.flatten()[:n], scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 values int8 values `q` and their chunks' `scales` stand for."""
    return q.float() * scales.repeat_interleave(INT8_CHUNK)[: q.numel()]


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
    head = 4 * -(-numel // INT8_CHUNK)
    return dequantize_int8(payload[head:].view(torch.int8), payload[:head].view(torch.float32))


def mean_of_payloads(payloads: list[torch.Tensor], dtype: str, numel: int) -> torch.Tensor:
    """The mean of the groups' decoded values, summed in group order (the same bits wherever it is computed)."""
    total = decode(payloads[0], dtype, numel).clone()
    for payload in payloads[1:]:
        total.add_(decode(payload, dtype, numel))
    return total.div_(len(payloads))


class Exchange:
    """One rank's pseudo-gradient on its way across the groups, launched when this is built (asynchronously: the
    inner steps go on while it travels), then wait() and mean(). `sent` is this rank's payload as launched (never
    written to: what a checkpoint keeps of an exchange in flight, to launch it again at a resume); `numel` the values
    it stands for; `across` and `groups` as `start` takes them."""

    def __init__(
        self, sent: torch.Tensor, dtype: str, numel: int, across: dist.ProcessGroup | None, groups: int
    ) -> None:
        self.sent, self.dtype, self.numel, self.groups = sent, dtype, numel, groups
        self.received: list[torch.Tensor] = [sent.clone() if dtype == "fp32" else sent]
        self.work: dist.Work | None = None
        if across is not None and groups > 1:
            if dtype == "fp32":
                self.work = dist.all_reduce(self.received[0], group=across, async_op=True)
            else:
                self.received = [torch.empty_like(sent) for _ in range(groups)]
                self.work = dist.all_gather(self.received, sent, group=across, async_op=True)

    def wait(self) -> None:
        """Block until the groups' payloads are here (at once without an exchange)."""
        if self.work is not None:
            self.work.wait()
            if self.sent.is_cuda:
                torch.cuda.synchronize(self.sent.device)  # what blocks is the transfer, not its enqueueing

    def mean(self) -> torch.Tensor:
        """The mean over the groups (after wait()): fp32's sum divided by the group count, or the gathered payloads
        decoded and summed in group order."""
        if self.dtype == "fp32":
            return self.received[0].div_(self.groups)
        return mean_of_payloads(self.received, self.dtype, self.numel)


def start(delta: torch.Tensor, dtype: str, across: dist.ProcessGroup | None, groups: int) -> Exchange:
    """Launch the exchange of this rank's `delta` (fp32, flat) in `dtype` through `across` (this rank and its
    counterparts in the other groups, in group order; None or 1 group: nothing crosses, the mean is its own)."""
    return Exchange(delta if dtype == "fp32" else encode(delta, dtype), dtype, delta.numel(), across, groups)
