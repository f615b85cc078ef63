"""The first stop signal decides the exit code and the message; later signals only hurry it (issue 24, item 9).

Real signals sent to this process while a StopRequest is installed; the real commands, both orders and under
`ddptrain launch`, are tests/dist/test_interrupt.py::test_the_first_stop_signal_decides_the_exit_code.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

from ddptrain.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED
from ddptrain.train import preemption
from ddptrain.train.preemption import INTERRUPT, PREEMPT, StopRequest, decided_stop


@pytest.fixture
def stop() -> Iterator[StopRequest]:
    """An installed StopRequest; afterwards this process's handlers and decided stop are as they were."""
    before = {sig: signal.getsignal(sig) for sig in preemption.STOP_SIGNALS}
    decided, hold = list(preemption._decided), list(preemption._hold)
    request = StopRequest(announce=False).install()
    try:
        yield request
    finally:
        request.uninstall()
        for sig, handler in before.items():
            signal.signal(sig, handler)
        preemption._decided[:], preemption._hold[:] = decided, hold


def test_ctrl_c_then_sigterm_stays_an_interruption(stop: StopRequest) -> None:
    os.kill(os.getpid(), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGTERM)  # once stopping, the scheduler's signal changes nothing
    assert (stop.level, stop.signal_name, stop.hurried_by) == (INTERRUPT, "SIGINT", None)
    assert decided_stop() == ("SIGINT", EXIT_INTERRUPTED)
    error = stop.stop_error(7, stop.level)
    assert error.exit_code == EXIT_INTERRUPTED and "interrupted at step 7 (SIGINT)" in str(error)


def test_sigterm_then_ctrl_c_quits_at_once_and_keeps_75(stop: StopRequest) -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)  # hurries: quit now
    assert (stop.level, stop.signal_name, stop.hurried_by) == (PREEMPT, "SIGTERM", "SIGINT")
    quit_now = stop.quit_at_once(4)
    assert (quit_now.kind, quit_now.first, quit_now.exit_code) == ("preempted", "SIGTERM", EXIT_PREEMPTED)
    assert str(quit_now).endswith(f"(exit {EXIT_PREEMPTED})")


def test_the_agreed_level_is_what_a_late_ctrl_c_keeps(stop: StopRequest) -> None:
    """A rank whose own first signal was Ctrl-C, stopped by another rank's SIGTERM: the agreed stop decides."""
    os.kill(os.getpid(), signal.SIGINT)
    error = stop.stop_error(3, PREEMPT)
    assert error.exit_code == EXIT_PREEMPTED and decided_stop() == ("a signal on another rank", EXIT_PREEMPTED)


def test_held_handlers_outlive_the_run_and_ignore_stops_at_exit(stop: StopRequest) -> None:
    """Under the command (hold_until_exit), a stop's handlers stay after uninstall(); at the command's return
    every stop signal is ignored, so the interpreter's teardown cannot become 143 or 130."""
    preemption.hold_until_exit()
    os.kill(os.getpid(), signal.SIGTERM)
    stop.uninstall()
    assert signal.getsignal(signal.SIGTERM) == stop._handle
    os.kill(os.getpid(), signal.SIGTERM)  # absorbed
    preemption.settle_for_exit()
    assert all(signal.getsignal(sig) == signal.SIG_IGN for sig in preemption.STOP_SIGNALS)
