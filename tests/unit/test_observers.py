"""The loop's observers (train/hooks.py): a real Trainer announces each event once, in the loop's order, and
run.py attaches the run's own observers in the order that keeps their collectives where they were."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from helpers import make_trainer

from ddptrain.observe.certificate import Certificate, read_certificate
from ddptrain.observe.perf import Throughput
from ddptrain.observe.stragglers import StragglerMonitor
from ddptrain.run_folder import certificate_file
from ddptrain.train.replicas import ReplicaGuard

RUN = ["log.every_steps=2", "train.max_steps=4", "ckpt.every_steps=4", "train.eval_every=4"]


class Recorder:
    """Records every event it hears, as (event, arguments)."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def step_started(self, step: int) -> None:
        self.events.append(("started", step))

    def step_trained(self, step: int) -> None:
        self.events.append(("trained", step))

    def step_logged(self, record: dict[str, Any], steps: int, seconds: float) -> None:
        assert "samples_per_s" in record  # throughput, attached before, added its fields
        self.events.append(("logged", record["step"], steps))

    def step_ended(self, step: int) -> None:
        self.events.append(("ended", step))

    def state_settled(self, step: int, logged: bool, saving: bool) -> None:
        self.events.append(("settled", step, logged, saving))

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.events.append((name, "in"))
        yield
        self.events.append((name, "out"))


def test_the_trainer_announces_each_event_in_the_loops_order(corpus_dir: Path, tmp_path: Path) -> None:
    trainer = make_trainer(corpus_dir, tmp_path, RUN)
    kinds = [type(o) for o in trainer.observers.attached]
    assert kinds == [Throughput, Certificate, StragglerMonitor, ReplicaGuard]
    recorder = Recorder()
    trainer.observers.attach(recorder)
    trainer.fit()
    step = [("started", 1), ("trained", 1), ("ended", 1), ("settled", 1, False, False)]
    logged = [("started", 2), ("trained", 2), ("logged", 2, 2), ("ended", 2), ("settled", 2, True, False)]
    assert recorder.events[:9] == step + logged
    assert recorder.events[9:] == [
        *[("started", 3), ("trained", 3), ("ended", 3), ("settled", 3, False, False)],
        *[("started", 4), ("trained", 4), ("logged", 4, 2), ("ended", 4)],
        *[("evaluation", "in"), ("evaluation", "out"), ("settled", 4, True, True)],
        *[("checkpoint", "in"), ("checkpoint", "out"), ("checkpoint", "in"), ("checkpoint", "out")],
    ]
    assert sorted(read_certificate(certificate_file(tmp_path))) == [2, 4]  # the certificate heard steps 2 and 4


def test_log_certificate_false_attaches_no_certificate(corpus_dir: Path, tmp_path: Path) -> None:
    trainer = make_trainer(corpus_dir, tmp_path, [*RUN, "log.certificate=false"])
    assert Certificate not in [type(o) for o in trainer.observers.attached]
    trainer.fit()
    assert not certificate_file(tmp_path).exists()
