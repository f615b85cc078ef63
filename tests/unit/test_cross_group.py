"""The in-place mode's cross-group gradient buckets (train/cross_group.py): layout, order, overlap, failure.

The sum itself is torchft's (tests/dist/test_in_place.py, tests/cluster/test_in_place_recovery.py); here the
reduction is one that triples a tensor in place and records what it was given, as a second and third
group holding the same gradients would sum it.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ddptrain.train.cross_group import FIRST_BUCKET_BYTES, CrossGroupGradients, bucket_layout


class Tripling:
    """A reduction over three groups that hold the same gradients; remembers each tensor's size and when it came."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.during_backward: list[bool] = []
        self.in_backward = False

    def __call__(self, flat: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        self.sizes.append(flat.numel())
        self.during_backward.append(self.in_backward)
        flat.mul_(3)
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(flat)
        return done


def model() -> nn.Sequential:
    torch.manual_seed(0)
    # 3 layers of 512 x 512 floats (1 MiB each, + biases): 4 buckets at a cap of 1 MiB + 4 KiB.
    return nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512))


def test_layout_is_reverse_order_split_by_dtype_and_size() -> None:
    params = [
        nn.Parameter(torch.zeros(n, dtype=d))
        for n, d in [(10, torch.float32), (20, torch.float16), (30, torch.float16), (40, torch.float32)]
    ]
    layout = bucket_layout(params, cap_bytes=1 << 30)
    assert [[p.numel() for p in b] for b in layout] == [[40], [30, 20], [10]]
    big = [nn.Parameter(torch.zeros(FIRST_BUCKET_BYTES // 4)) for _ in range(4)]
    layout = bucket_layout(big, cap_bytes=3 * FIRST_BUCKET_BYTES)
    assert [len(b) for b in layout] == [1, 3]  # the first bucket holds 1 MiB, the others up to the cap


def backward(net: nn.Sequential, reducer: Tripling, sums: CrossGroupGradients, micro_batches: int) -> None:
    x = torch.randn(micro_batches, 8, 512, generator=torch.Generator().manual_seed(1))
    for i in range(micro_batches):
        if i == micro_batches - 1:
            sums.arm()
        reducer.in_backward = True
        net(x[i]).square().mean().backward()
        reducer.in_backward = False


def test_buckets_are_summed_while_backward_runs_in_layout_order_and_written_back() -> None:
    net, reference = model(), model()
    reducer = Tripling()
    sums = CrossGroupGradients(list(net.parameters()), FIRST_BUCKET_BYTES + 4096, reducer, overlap=True)
    backward(net, reducer, sums, micro_batches=2)
    sums.launch_rest()
    sums.finish(lambda: False)
    # Only the last micro-batch's backward starts sums; the first layer's bucket is final at its very end.
    assert [[p.numel() for p in b] for b in sums.buckets] == [[512], [512 * 512, 512], [512 * 512, 512], [512 * 512]]
    assert reducer.sizes == [512, 512 * 513, 512 * 513, 512 * 512] and all(reducer.during_backward)
    backward(reference, Tripling(), CrossGroupGradients([], 1, Tripling(), overlap=False), micro_batches=2)
    for p, q in zip(net.parameters(), reference.parameters()):
        assert p.grad is not None and q.grad is not None
        assert torch.equal(p.grad, 3 * q.grad)


def test_without_overlap_every_bucket_is_summed_after_backward() -> None:
    net = model()
    reducer = Tripling()
    sums = CrossGroupGradients(list(net.parameters()), FIRST_BUCKET_BYTES + 4096, reducer, overlap=False)
    backward(net, reducer, sums, micro_batches=1)
    assert reducer.sizes == []
    sums.launch_rest()
    assert len(reducer.sizes) == 4 and not any(reducer.during_backward)


def test_a_failed_sum_leaves_the_gradients_as_backward_made_them() -> None:
    net = model()
    sums = CrossGroupGradients(list(net.parameters()), 1 << 30, Tripling(), overlap=True)
    backward(net, Tripling(), sums, micro_batches=1)
    before = [p.grad.clone() for p in net.parameters() if p.grad is not None]
    sums.launch_rest()
    sums.finish(lambda: True)
    assert all(torch.equal(p.grad, b) for p, b in zip(net.parameters(), before))  # type: ignore[arg-type]
