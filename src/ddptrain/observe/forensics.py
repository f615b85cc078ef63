"""Hang forensics: what each rank writes into run.dir/stacks/ when its watchdog fires.

Per rank: `rank-<r>-<host>.json` (step, phase, the main thread's Python frames, the kernel wait
channel of that thread, the collectives entered per process group from the flight recorder) and
`rank-<r>-<host>.txt` (every thread's Python stack, and the native stack from `py-spy dump
--native` where py-spy is installed and can read this interpreter). A rank that writes nothing
(stopped, dead, frozen with the GIL held) is looked at by a rank on the same host: its process
state and, where py-spy runs, its stack go to `rank-<r>-<host>.observed.json`. `ddptrain triage
RUN_DIR` (review/verdict.py) merges it all into one verdict.

The flight recorder (torch's ring buffer of recent collectives, per process group, with sequence
numbers) is switched on before the process group exists: `TORCH_FR_BUFFER_SIZE` for gloo and
NCCL (`TORCH_NCCL_TRACE_BUFFER_SIZE` on torch versions before that name), and for NCCL also its own
dump on timeout into the same folder (`TORCH_NCCL_DUMP_ON_TIMEOUT`, `TORCH_NCCL_DEBUG_INFO_TEMP_FILE`).
"""

from __future__ import annotations

import faulthandler
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import torch.distributed as dist

from ddptrain.safe_files import ensure_dir, open_append_no_follow, open_new_no_follow, write_text_replace

FR_ENTRIES = 2000  # collectives kept per process in the flight recorder's ring buffer
_FR_KEPT = 64  # newest entries written per rank
_PY_SPY_TIMEOUT_S = 20.0


def enable_flight_recorder(stacks_dir: Path) -> None:
    """Before the process group is created: record recent collectives (user settings win)."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(FR_ENTRIES))
    import torch._C._distributed_c10d as c10d

    if not hasattr(c10d, "_dump_fr_trace_json"):  # before the backend-neutral recorder, NCCL's own name
        os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", str(FR_ENTRIES))
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(stacks_dir.resolve() / "nccl-trace-rank-"))


def stacks_name(rank: int, host: str) -> str:
    """The file stem of a rank's forensics: rank-<r>-<host>."""
    return f"rank-{rank}-{host}"


def frames_of(frame: FrameType | None) -> list[dict[str, Any]]:
    """A thread's Python frames, outermost first: file, line, function (qualified name)."""
    out = []
    while frame is not None:
        code = frame.f_code
        out.append(
            {"file": code.co_filename, "line": frame.f_lineno, "function": getattr(code, "co_qualname", code.co_name)}
        )
        frame = frame.f_back
    return out[::-1]


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of a process (R, S, D, T, Z, ...), None when it does not exist."""
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    return stat.rsplit(")", 1)[1].split()[0]  # the command name in parentheses may contain spaces


def thread_wait_channel(pid: int, tid: int) -> str | None:
    """Where in the kernel a thread sleeps (e.g. pipe_read, futex_wait_queue), Linux only."""
    value = _read(f"/proc/{pid}/task/{tid}/wchan")
    return value if value and value != "0" else None


def py_spy(pid: int, native: bool) -> str:
    """`py-spy dump` of a process (native frames too), or why there is none."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(exe).exists():
        return "py-spy is not installed (pip install 'ddptrain[dev]' or py-spy) : no native stack"
    cmd = [exe, "dump", "--pid", str(pid)] + (["--native"] if native else ["--nonblocking"])
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=_PY_SPY_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"py-spy failed: {e}"
    if done.returncode != 0:
        first = (done.stderr or done.stdout).strip().splitlines()
        return f"py-spy could not read pid {pid}: {first[0] if first else 'exit ' + str(done.returncode)}"
    return done.stdout


def flight_recorder(backend: str | None) -> list[dict[str, Any]]:
    """The newest collectives this process entered (all groups), from torch's flight recorder."""
    try:
        import torch._C._distributed_c10d as c10d

        dump = getattr(c10d, "_dump_nccl_trace_json", None) if backend == "nccl" else None
        dump = dump or getattr(c10d, "_dump_fr_trace_json", None)
        if dump is None:
            return []
        entries = json.loads(dump(True, False)).get("entries", [])
    except (RuntimeError, ValueError, TypeError, ImportError):
        return []
    keys = ("pg_id", "process_group", "collective_seq_id", "profiling_name", "state", "retired", "time_created_ns")
    return [{k: e.get(k) for k in keys} for e in entries[-_FR_KEPT:]]


def group_names(train_group: dist.ProcessGroup | None) -> dict[str, str]:
    """Flight-recorder process-group names -> what ddptrain uses them for."""
    names: dict[str, str] = {}
    try:
        from torch.distributed.distributed_c10d import _get_process_group_name

        if dist.is_initialized() and dist.group.WORLD is not None:
            names[_get_process_group_name(dist.group.WORLD)] = "default"
        if train_group is not None:
            names[_get_process_group_name(train_group)] = "train"
    except (ImportError, RuntimeError, AttributeError):
        pass
    return names


def write_own(
    stacks_dir: Path,
    rank: int,
    host: str,
    backend: str | None,
    train_group: dist.ProcessGroup | None,
    facts: dict[str, Any],
    native: bool = True,
) -> Path:
    """This rank's forensics (called from the watchdog thread while the main thread is stuck).

    Never through a planted link: the folder must be a real one directly in run.dir, the .txt is appended
    no-follow (a link or FIFO refused), the .json replaced (a link under its name removed, not followed).
    """
    ensure_dir(stacks_dir, stacks_dir.parent)
    stem = stacks_dir / stacks_name(rank, host)
    main = threading.main_thread()
    frame = sys._current_frames().get(main.ident or -1)
    report = {
        "rank": rank,
        "host": host,
        "pid": os.getpid(),
        "time": time.time(),
        **facts,
        "main_thread": frames_of(frame),
        "wchan": thread_wait_channel(os.getpid(), main.native_id or 0),
        "groups": group_names(train_group),
        "flight_recorder": flight_recorder(backend),
    }
    with open_append_no_follow(stem.with_suffix(".txt")) as f:
        f.write(
            f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}: hang in {facts.get('phase')} of step "
            f"{facts.get('step')}, no progress for {facts.get('waited_s', 0):.1f} s\n--- Python, all threads:\n"
        )
        f.flush()
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.write("--- native (py-spy dump --native):\n")
        f.write(py_spy(os.getpid(), native) + "\n")
    write_text_replace(stem.with_suffix(".json"), json.dumps(report, indent=1))  # never half a report
    return stem.with_suffix(".json")


def observe_silent(stacks_dir: Path, me: int, hosts: list[str], pids: list[int], grace_s: float) -> list[int]:
    """Wait up to grace_s for every rank's report; describe the silent ones on this host. Returns the silent ranks."""
    deadline = time.monotonic() + grace_s
    silent = list(range(len(hosts)))
    while True:
        silent = [r for r in range(len(hosts)) if not (stacks_dir / f"{stacks_name(r, hosts[r])}.json").exists()]
        if not silent or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    for r in silent:
        if r == me or hosts[r] != hosts[me] or not pids:
            continue
        path = stacks_dir / f"{stacks_name(r, hosts[r])}.observed.json"
        try:
            f = open_new_no_follow(path)  # one observer per silent rank
        except FileExistsError:
            continue
        except OSError:
            continue  # a planted link under a deeper name: nothing is written through it
        state = process_state(pids[r])
        observed = {
            "rank": r,
            "host": hosts[r],
            "pid": pids[r],
            "observed_by": me,
            "time": time.time(),
            "state": state,
            "wchan": thread_wait_channel(pids[r], pids[r]) if state else None,
            "py_spy": py_spy(pids[r], native=False) if state not in (None, "Z") else None,
        }
        with f:
            f.write(json.dumps(observed, indent=1).encode())
    return silent
