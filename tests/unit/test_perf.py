"""FLOPs per token, MFU and the peak table against hand computations; step-phase attribution."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from ddptrain.config import ModelConfig
from ddptrain.models.gpt import GPT
from ddptrain.observe import perf
from ddptrain.observe.perf import StepTimer, Throughput, matmul_dtype, mfu, peak_flops

# n_layer=2, n_head=2, n_embd=16, block_size=8, vocab 256, no biases. By hand:
#   wte (tied with lm_head)         256*16                    = 4096
#   per block: ln1 16, qkv 16*48 = 768, proj 16*16 = 256, ln2 16,
#              fc 16*64 = 1024, mlp proj 64*16 = 1024         = 3104, x2 blocks = 6208
#   ln_f                                                       = 16
#   N (without the position embedding wpe)                     = 10320
#   6N = 61920; attention 12 * L * H * Q * T = 12 * 2 * (2 * 8) * 8 = 3072
HAND_FLOPS_PER_TOKEN = 61920 + 3072


def small_gpt() -> GPT:
    return GPT(ModelConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=256, bias=False))


def test_gpt_flops_per_token_matches_hand_computation() -> None:
    model = small_gpt()
    assert model.num_params() == 10320
    assert model.flops_per_token() == HAND_FLOPS_PER_TOKEN == 64992


def test_mfu_matches_hand_computation() -> None:
    # 8 H100 SXM in bf16 at 1e6 tokens/s: 64992e6 / 8 = 8.124e9 FLOP/s per device over 989.4e12.
    peak = peak_flops("NVIDIA H100 80GB HBM3", "bf16")
    assert peak == pytest.approx(989.4e12)
    assert mfu(HAND_FLOPS_PER_TOKEN, 1e6, 8, peak) == pytest.approx(8.124e9 / 989.4e12)


def test_throughput_record_by_hand() -> None:
    # Global batch 8 samples of 8 tokens, 10 steps in 2 s on 2 ranks, a declared 1 TFLOP/s peak:
    # 40 samples/s, 320 tokens/s, 160 per rank, 64992 * 320 / 2 = 10,398,720 FLOP/s per device.
    t = Throughput(
        torch.device("cpu"),
        "fp32",
        world_size=2,
        global_batch=8,
        tokens_per_sample=8,
        flops_per_token=HAND_FLOPS_PER_TOKEN,
        peak_tflops=1.0,
    )
    r = t.record(steps=10, seconds=2.0)
    assert r["samples_per_s"] == pytest.approx(40)
    assert r["tokens_per_s"] == pytest.approx(320)
    assert r["tokens_per_s_per_rank"] == pytest.approx(160)
    assert r["flops_per_s_per_device"] == pytest.approx(10_398_720)
    assert r["mfu"] == pytest.approx(10_398_720 / 1e12)
    assert r["peak_mem_kind"] == "max_rss" and r["peak_mem_mb"] > 10


def test_cpu_reports_achieved_flops_but_no_mfu() -> None:
    t = Throughput(torch.device("cpu"), "fp32", 1, 8, 8, HAND_FLOPS_PER_TOKEN, peak_tflops=None)
    r = t.record(steps=1, seconds=1.0)
    assert "mfu" not in r
    assert r["flops_per_s_per_device"] == pytest.approx(HAND_FLOPS_PER_TOKEN * 64)
    assert "no MFU" in t.describe()


@pytest.mark.parametrize(
    ("name", "dtype", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", "tf32", 494.7),
        ("NVIDIA H100 PCIe", "bf16", 756.0),
        ("NVIDIA H100 NVL", "bf16", 835.5),
        ("NVIDIA H200", "bf16", 989.4),
        ("NVIDIA A100-SXM4-80GB", "tf32", 156.0),
        ("NVIDIA A100 80GB PCIe", "bf16", 312.0),
        ("NVIDIA L4", "bf16", 121.0),
        ("NVIDIA L40S", "bf16", 362.1),
        ("NVIDIA A10G", "bf16", 70.0),
        ("NVIDIA A10", "fp32", 31.2),
        ("Tesla V100-SXM2-16GB", "fp16", 125.0),
        ("Tesla V100-PCIE-32GB", "fp32", 14.0),
    ],
)
def test_peak_table(name: str, dtype: str, tflops: float) -> None:
    assert peak_flops(name, dtype) == pytest.approx(tflops * 1e12)


def test_unknown_device_or_dtype_has_no_peak() -> None:
    assert peak_flops("cpu", "fp32") is None
    assert peak_flops("Some Future GPU", "bf16") is None
    assert peak_flops("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 tensor cores


def test_matmul_dtype() -> None:
    cpu = torch.device("cpu")
    assert matmul_dtype("bf16", cpu) == "bf16"
    assert matmul_dtype("fp16", cpu) == "fp16"
    assert matmul_dtype("fp32", cpu) == "fp32"


class FakeClock:
    """The StepTimer's clocks, advanced by the test: perf_counter() and the thread's run-queue wait.

    With them the attribution is exact arithmetic, whatever the machine's load; the real clocks are
    read in test_step_timer_reads_the_time_its_thread_waited_for_a_cpu.
    """

    def __init__(self) -> None:
        self.now = 1000.0
        self.waited = 0.0

    def perf_counter(self) -> float:
        return self.now

    def run_queue_wait(self) -> Callable[[], float]:
        return lambda: self.waited

    def spend(self, seconds: float, cpu_wait_share: float = 0.0) -> None:
        """seconds pass, of which cpu_wait_share were spent runnable but waiting for a CPU."""
        self.now += seconds
        self.waited += seconds * cpu_wait_share


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(perf, "time", SimpleNamespace(perf_counter=fake.perf_counter))
    monkeypatch.setattr(perf, "RunQueueWait", fake.run_queue_wait)
    return fake


def _fake_step(
    timer: StepTimer, clock: FakeClock, data_s: float, fwd_s: float, bwd_s: list[float], opt_s: float
) -> None:
    """One step of len(bwd_s) micro-batches; a tenth of every phase is spent waiting for a CPU."""
    timer.start()
    for b in bwd_s:
        clock.spend(data_s, 0.1)
        timer.lap("data")
        clock.spend(fwd_s, 0.1)
        timer.lap("forward")
        clock.spend(b, 0.1)
        timer.lap("backward")
    clock.spend(opt_s, 0.1)
    timer.lap("optimizer")


def test_step_timer_attributes_phases(clock: FakeClock) -> None:
    timer = StepTimer(torch.device("cpu"), distributed=True)
    for _ in range(2):
        _fake_step(timer, clock, data_s=0.02, fwd_s=0.01, bwd_s=[0.005, 0.045], opt_s=0.015)
    s = timer.summary()
    assert s["data_wait_s"] == pytest.approx(0.04) and s["forward_s"] == pytest.approx(0.02)
    assert s["backward_s"] == pytest.approx(0.05) and s["optimizer_s"] == pytest.approx(0.015)
    # The last backward's excess over the other micro-batch is the exposed communication.
    assert s["exposed_comm_s"] == pytest.approx(0.045 - 0.005)
    # local time leaves out the last backward (where a rank would wait for the others), and so does its CPU wait.
    assert s["local_s"] == pytest.approx(0.04 + 0.02 + 0.005 + 0.015)
    assert s["local_cpu_wait_s"] == pytest.approx(0.1 * s["local_s"])
    local, comm, cpu_wait = timer.take_steps()
    assert local == pytest.approx([s["local_s"]] * 2)
    assert comm == [0.0, 0.0]  # no comm hook: no wait measured
    assert cpu_wait == pytest.approx([0.1 * s["local_s"]] * 2)
    assert timer.summary() == {}


def _timed_busy_steps(timer: StepTimer, out: dict[str, float]) -> None:
    # Runs in its own thread, pinned to CPU 0 with the spinner: only this thread shares that CPU.
    os.sched_setaffinity(0, {0})
    for _ in range(3):
        timer.start()
        end = time.perf_counter() + 0.1
        while time.perf_counter() < end:
            pass
        timer.lap("forward")
        timer.lap("backward")
        timer.lap("optimizer")
    out.update(timer.summary())


def _busy_steps_beside_a_spinner() -> dict[str, float]:
    """3 steps of 0.1 s busy work on a CPU that a busy loop of another process shares: the timer's summary."""
    spin = "import os; os.sched_setaffinity(0, {0}); print('spinning', flush=True)\nwhile True: pass"
    spinner = subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE, text=True)
    summary: dict[str, float] = {}
    try:
        assert spinner.stdout is not None and spinner.stdout.readline() == "spinning\n"  # on CPU 0 from now on
        worker = threading.Thread(target=_timed_busy_steps, args=(StepTimer(torch.device("cpu"), False), summary))
        worker.start()
        worker.join(30)
    finally:
        spinner.kill()
        spinner.wait()
    return summary


def test_step_timer_reads_the_time_its_thread_waited_for_a_cpu() -> None:
    # The real clocks and /proc/thread-self/schedstat: a thread sharing its one CPU with a busy loop waits
    # for it some of the time, never longer than the step took (the share waited: the measure test below).
    summary = _busy_steps_beside_a_spinner()
    local, waited = summary["local_s"], summary["local_cpu_wait_s"]
    assert local >= 0.1  # each step ran 0.1 s of busy work
    assert 0.0 < waited <= local


@pytest.mark.measure
def test_step_timer_measures_the_share_of_time_its_thread_waited_for_a_cpu() -> None:
    # A busy loop sharing the one CPU it may use: about half of each 0.1 s step is spent runnable but
    # not running, which /proc/thread-self/schedstat records and local_cpu_wait_s reports. A figure that
    # other work on the machine changes: `make test-measure` runs it alone.
    summary = _busy_steps_beside_a_spinner()
    local, waited = summary["local_s"], summary["local_cpu_wait_s"]
    assert local == pytest.approx(0.1, abs=0.03)
    assert 0.2 * local < waited < 0.8 * local


def test_step_timer_no_exposed_comm_without_accumulation_or_ddp(clock: FakeClock) -> None:
    single = StepTimer(torch.device("cpu"), distributed=False)
    _fake_step(single, clock, 0.0, 0.0, [0.0, 0.01], 0.0)
    assert "exposed_comm_s" not in single.summary()
    ddp_no_accum = StepTimer(torch.device("cpu"), distributed=True)
    _fake_step(ddp_no_accum, clock, 0.0, 0.0, [0.01], 0.0)
    assert "exposed_comm_s" not in ddp_no_accum.summary()
