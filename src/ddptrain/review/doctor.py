"""`ddptrain doctor`: bring-up checks, run alone or as every rank of a launch.

Alone it checks this machine (versions, devices, backend, interface). Under torchrun (or
`ddptrain launch ... -- doctor`) every rank also checks that it reaches the rendezvous within a
short timeout, that an all-reduce gives the right answer, and measures all-reduce bus bandwidth
per message size as nccl-tests defines it:

    algbw = bytes / time          busbw = algbw * 2 (n - 1) / n

busbw is comparable to the link's hardware bandwidth whatever the number of ranks. Every check
gets a verdict; the exit code is 1 when one failed.
"""

from __future__ import annotations

import fcntl
import os
import platform
import re
import socket
import struct
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ddptrain.dist import probe_store, read_torchrun_env, resolve_backend
from ddptrain.endpoints import Endpoint, format_endpoint, split_host_port
from ddptrain.errors import LaunchError
from ddptrain.etcd_endpoints import ETCD_ENV, health, parse_endpoints
from ddptrain.observe.perf import device_name, peak_flops
from ddptrain.review.link_advice import format_advice

_ENV_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_USE_AGENT_STORE",
    "GLOO_SOCKET_IFNAME",
    "NCCL_SOCKET_IFNAME",
    "NCCL_IB_DISABLE",
    "OMP_NUM_THREADS",
)
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address
ETCD_PROBE_S = 5.0  # per etcd request: a healthy member answers in milliseconds
BACKENDS = ("auto", "nccl", "gloo")
TIMEOUT_S = 30.0  # for every rank to join
MAX_MB = 64.0  # the largest all-reduce of the sweep


@dataclass
class Check:
    """One check's verdict: PASS, WARN, FAIL or SKIP, and what was found."""

    name: str
    verdict: str
    detail: str


# ---- environment ------------------------------------------------------------------------------


def interface_address(name: str) -> str | None:
    """The IPv4 address of a network interface, or None when it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def route_to(host: str) -> tuple[str, str | None]:
    """(local address, interface name) this machine uses to reach host; raises OSError when it cannot."""
    ip = socket.gethostbyname(host)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((ip, 9))  # UDP connect sends nothing: it only asks the kernel for the route
        local = s.getsockname()[0]
    names = [n for _, n in socket.if_nameindex()]
    return local, next((n for n in names if interface_address(n) == local), None)


def environment() -> dict[str, str]:
    """Versions, devices and launch variables of this process."""
    info = {
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda) if torch.version.cuda else "none (CPU build)",
        "cuda devices": str(torch.cuda.device_count()) if torch.cuda.is_available() else "0",
        "backends available": ", ".join(
            b for b, ok in (("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available())) if ok
        )
        or "none",
        "cpus": str(os.cpu_count()),
    }
    if torch.cuda.is_available():
        version = torch.cuda.nccl.version()  # a tuple in recent torch, an int (e.g. 2708) in older ones
        info["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        for i in range(torch.cuda.device_count()):
            info[f"cuda:{i}"] = torch.cuda.get_device_name(i)
    for var in _ENV_VARS:
        if var in os.environ:
            info[var] = os.environ[var]
    return info


# ---- single-machine checks --------------------------------------------------------------------


def check_launch_env() -> tuple[Check, tuple[int, int, int, int] | None]:
    """Whether the torchrun variables are absent (alone) or complete and consistent."""
    try:
        env = read_torchrun_env()
    except LaunchError as e:
        return Check("launch env", "FAIL", str(e)), None
    if env is None:
        return Check("launch env", "PASS", "no torchrun variables: single-machine checks only"), None
    rank, world, local_rank, local_world = env
    return Check("launch env", "PASS", f"rank {rank} of {world}, local rank {local_rank} of {local_world}"), env


def check_backend(requested: str) -> tuple[Check, str | None]:
    """The backend `dist.backend` resolves to here, and that it is built into this torch."""
    try:
        backend = resolve_backend(requested)
    except LaunchError as e:
        return Check("backend", "FAIL", str(e)), None
    available = dist.is_nccl_available() if backend == "nccl" else dist.is_gloo_available()
    if not available:
        return Check("backend", "FAIL", f"{backend} is not built into this torch"), None
    return Check("backend", "PASS", f"{backend} (requested {requested})"), backend


def check_device(local_rank: int) -> tuple[Check, torch.device]:
    """A timed matmul on this rank's device: it works, and how fast against the peak table."""
    cuda = torch.cuda.is_available()
    if cuda and local_rank >= torch.cuda.device_count():
        return Check(
            "device", "FAIL", f"local rank {local_rank} but only {torch.cuda.device_count()} GPU(s) visible"
        ), torch.device("cpu")
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    dtype, n, label = (torch.bfloat16, 4096, "bf16") if cuda else (torch.float32, 512, "fp32")
    try:
        if cuda:
            torch.cuda.set_device(device)
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        a @ b  # warm-up (kernel selection)
        _sync(device)
        reps = 10
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        _sync(device)
        seconds = (time.perf_counter() - t0) / reps
    except RuntimeError as e:
        return Check("device", "FAIL", f"{device}: {e}"), device
    flops = 2 * n**3 / seconds
    name = device_name(device)
    peak = peak_flops(name, label) if cuda else None
    share = f", {flops / peak:.0%} of its {label} peak" if peak else ""
    return Check(
        "device", "PASS", f"{device} ({name}): {n}x{n} {label} matmul at {flops / 1e12:.3f} TFLOP/s{share}"
    ), device


def check_interface(endpoint: str | None = None) -> Check:
    """The interface that routes to MASTER_ADDR (or the endpoint's host), and that a forced *_SOCKET_IFNAME exists."""
    names = {n for _, n in socket.if_nameindex()}
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        wanted = os.environ.get(var)
        # NCCL also accepts lists and exclusions ("eth0,eth1", "^docker"); only a plain name or prefix is checked.
        if wanted and re.fullmatch(r"[\w.-]+", wanted) and not any(n.startswith(wanted) for n in names):
            return Check(
                "interface",
                "FAIL",
                f"{var}={wanted} but this host has no such interface (has {', '.join(sorted(names))})",
            )
    given = split_host_port(endpoint) if endpoint else None
    addr = os.environ.get("MASTER_ADDR") or (given[0] if given else None)
    if not addr:
        return Check("interface", "SKIP", f"no MASTER_ADDR or --endpoint; interfaces: {', '.join(sorted(names))}")
    what = "MASTER_ADDR" if os.environ.get("MASTER_ADDR") else "the endpoint host"
    try:
        local, name = route_to(addr)
    except socket.gaierror as e:
        return Check("interface", "FAIL", f"{what} {addr} does not resolve: {e.strerror}")
    except OSError as e:
        return Check("interface", "FAIL", f"no route from this host to {what} {addr}: {e.strerror or e}")
    forced = [f"{v}={os.environ[v]}" for v in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if os.environ.get(v)]
    how = f"; forced by {', '.join(forced)}" if forced else ""
    return Check("interface", "PASS", f"{what} {addr} is reached via {name or '?'} ({local}){how}")


# ---- rendezvous and collectives ---------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_endpoint(endpoint: str, timeout_s: float) -> Check:
    """A rendezvous endpoint HOST:PORT given by hand accepts TCP connections within timeout_s."""
    given = split_host_port(endpoint)
    if given is None:
        return Check("endpoint", "FAIL", f"--endpoint {endpoint!r} must look like HOST:PORT")
    t0 = time.monotonic()
    why = probe_store(*given, t0 + timeout_s)
    if why is not None:
        return Check("endpoint", "FAIL", f"cannot connect to {endpoint} within {timeout_s:g}s ({why})")
    return Check("endpoint", "PASS", f"{endpoint} accepts connections ({time.monotonic() - t0:.2f}s)")


def check_etcd(endpoints: Sequence[Endpoint], timeout_s: float) -> Check:
    """Every etcd member of the rendezvous, asked at once: healthy (leader seen, v2 API on) within timeout_s.

    PASS when all are; WARN when some are (the job can rendezvous, but the cluster is one loss
    closer to losing its quorum); FAIL when none is.
    """
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=len(endpoints)) as pool:
        whys = list(pool.map(lambda e: health(e, timeout_s), endpoints))
    bad = [f"{format_endpoint(e)}: {why}" for e, why in zip(endpoints, whys) if why is not None]
    took = f"{time.monotonic() - t0:.2f}s"
    if not bad:
        return Check("etcd", "PASS", f"all {len(endpoints)} member(s) healthy, v2 API on ({took})")
    verdict = "FAIL" if len(bad) == len(endpoints) else "WARN"
    return Check(
        "etcd", verdict, f"{len(endpoints) - len(bad)} of {len(endpoints)} healthy ({took}); " + "; ".join(bad)
    )


def check_rendezvous(env: tuple[int, int, int, int], backend: str, device: torch.device, timeout_s: float) -> Check:
    """Every rank joins the process group within timeout_s (the store is probed first for a clear reason)."""
    rank, world = env[0], env[1]
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    # Under torchrun the agent hosts the store; with plain RANK/WORLD_SIZE rank 0 hosts it itself.
    hosts_store = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    if not hosts_store:
        why = probe_store(host, port, deadline)
        if why is not None:
            return Check(
                "rendezvous",
                "FAIL",
                f"rank {rank} cannot reach the rendezvous store at {host}:{port} "
                f"within {timeout_s:g}s ({why}). Is rank 0 (or the launcher on that host) running, "
                "and is the port open from this host?",
            )
    kwargs: dict[str, Any] = {"device_id": device} if backend == "nccl" else {}
    try:
        dist.init_process_group(backend, timeout=timedelta(seconds=max(1.0, deadline - time.monotonic())), **kwargs)
        dist.barrier()
    except Exception as e:  # noqa: BLE001 - c10d raises several types; each becomes a verdict
        first = str(e).strip().splitlines()[0].rstrip(".") if str(e).strip() else type(e).__name__
        role = f"rank 0 hosts the store on port {port}" if hosts_store else f"store at {host}:{port}"
        return Check(
            "rendezvous",
            "FAIL",
            f"the {world} ranks did not all join within {timeout_s:g}s ({role}): "
            f"{first}. Are all nodes started with the same MASTER_ADDR/MASTER_PORT and WORLD_SIZE?",
        )
    return Check("rendezvous", "PASS", f"all {world} ranks joined in {time.monotonic() - t0:.2f}s via {host}:{port}")


def check_allreduce(device: torch.device) -> Check:
    """An all-reduce sums correctly on every rank."""
    n = dist.get_world_size()
    t = torch.full((1024,), float(dist.get_rank() + 1), device=device)
    dist.all_reduce(t)
    want = n * (n + 1) / 2
    # Every rank learns whether any rank got a wrong sum, so rank 0's verdict covers them all.
    good = torch.tensor([float(torch.all(t == want))], device=device)
    dist.all_reduce(good, op=dist.ReduceOp.MIN)
    if good.item() < 1:
        return Check("all-reduce", "FAIL", f"a rank got a wrong sum of (rank + 1) over {n} ranks (expected {want:g})")
    return Check("all-reduce", "PASS", f"correct sum on all {n} ranks")


def bandwidth_sweep(device: torch.device, max_bytes: int, budget_s: float = 0.4) -> list[dict[str, float]]:
    """all_reduce of float32 buffers from 1 KiB to max_bytes (x4 steps): time, algbw, busbw per size.

    Every rank runs the same number of iterations (agreed from the slowest warm-up); the time
    of a size is the slowest rank's mean, as the collective finishes when the last rank does.
    """
    n = dist.get_world_size()
    warm_up = torch.ones(256, device=device)
    for _ in range(10):  # first collectives set up connections and buffers: keep them out of the table
        dist.all_reduce(warm_up)
    rows = []
    size = 1024
    while size <= max_bytes:
        buf = torch.ones(size // 4, dtype=torch.float32, device=device)
        t0 = time.perf_counter()
        for _ in range(2):
            dist.all_reduce(buf)
        _sync(device)
        warm = torch.tensor([(time.perf_counter() - t0) / 2], device=device, dtype=torch.float64)
        dist.all_reduce(warm, op=dist.ReduceOp.MAX)
        iters = int(max(3, min(100, budget_s / max(warm.item(), 1e-6))))
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(buf)
        _sync(device)
        elapsed = torch.tensor([(time.perf_counter() - t0) / iters], device=device, dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        seconds = elapsed.item()
        algbw = size / seconds
        rows.append(
            {
                "bytes": size,
                "iters": iters,
                "time_us": seconds * 1e6,
                "algbw_gbs": algbw / 1e9,
                "busbw_gbs": algbw * 2 * (n - 1) / n / 1e9,
            }
        )
        size *= 4
    return rows


def gather_environments(info: dict[str, str]) -> list[dict[str, str]]:
    """Every rank's environment(), in rank order."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, info)
    return out


def check_consistency(envs: list[dict[str, str]]) -> Check:
    """All ranks run the same torch, CUDA and NCCL versions."""
    for key in ("torch", "cuda", "nccl"):
        values = {e.get(key, "-") for e in envs}
        if len(values) > 1:
            per_rank = ", ".join(f"rank {r}: {e.get(key, '-')}" for r, e in enumerate(envs))
            return Check("versions", "FAIL", f"ranks disagree on {key}: {per_rank}")
    return Check("versions", "PASS", f"torch {envs[0]['torch']}, cuda {envs[0]['cuda']} on all {len(envs)} ranks")


# ---- the command ------------------------------------------------------------------------------


def format_bandwidth(rows: list[dict[str, float]], world: int, backend: str) -> str:
    """The sweep as a table in the style of nccl-tests."""
    lines = [
        f"all_reduce bandwidth ({backend}, {world} ranks, float32, sum; busbw = algbw x 2(n-1)/n)",
        f"{'size':>10} {'iters':>6} {'time (us)':>11} {'algbw GB/s':>11} {'busbw GB/s':>11}",
    ]
    for r in rows:
        lines.append(
            f"{_size(r['bytes']):>10} {r['iters']:>6} {r['time_us']:>11.1f} "
            f"{r['algbw_gbs']:>11.3f} {r['busbw_gbs']:>11.3f}"
        )
    return "\n".join(lines)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:g} {unit}"
        n /= 1024
    return f"{n:g} TiB"


def _report(title: str, info: dict[str, str], checks: list[Check], extra: str = "") -> str:
    width = max(len(k) for k in info)
    lines = [title, *(f"  {k:<{width}}  {v}" for k, v in info.items())]
    if extra:
        lines += ["", extra]
    lines += ["", "checks:", *(f"  {c.verdict:<4}  {c.name:<11} {c.detail}" for c in checks)]
    failed = [c.name for c in checks if c.verdict == "FAIL"]
    lines.append(f"verdict: {'FAIL (' + ', '.join(failed) + ')' if failed else 'PASS'}")
    return "\n".join(lines)


def doctor(
    backend: str = BACKENDS[0],
    timeout_s: float = TIMEOUT_S,
    max_bytes: int = int(MAX_MB * 2**20),
    endpoint: str | None = None,
    etcd: str | None = None,
    params: float | None = None,
    step_s: float | None = None,
) -> int:
    """Run the checks this launch allows, print the report (rank 0, or any rank that fails); 0 when all pass.

    endpoint: a rendezvous HOST:PORT to probe from here (e.g. torchrun's --rdzv-endpoint, before
    starting the agents on the other nodes). etcd: the etcd members HOST[:PORT],... of an etcd
    rendezvous (default: those `ddptrain launch --rdzv-backend etcd-v2` gives its workers). params: a model's
    parameter count, to advise from the sweep how to synchronize it (with step_s, its compute seconds per step).
    """
    etcd = etcd or os.environ.get(ETCD_ENV)
    info = environment()
    launch, env = check_launch_env()
    checks = [launch]
    chosen: str | None = None
    device = torch.device("cpu")
    if launch.verdict != "FAIL":
        local, chosen, device = _local_checks(backend, env, timeout_s, endpoint, etcd)
        checks += local
    if env is None or chosen is None or any(c.verdict == "FAIL" for c in checks):
        if env is not None and launch.verdict != "FAIL":
            checks.append(Check("rendezvous", "SKIP", "an earlier check failed"))
        print(_report(_title(env), info, checks), flush=True)
        return int(any(c.verdict == "FAIL" for c in checks))
    rdzv = check_rendezvous(env, chosen, device, timeout_s)
    checks.append(rdzv)
    if rdzv.verdict == "FAIL":
        print(_report(_title(env), info, checks), file=sys.stderr if env[0] else sys.stdout, flush=True)
        return 1
    try:
        envs, rows = _collective_checks(checks, info, device, max_bytes)
    except Exception as e:  # noqa: BLE001 - a collective failing mid-way is itself the finding
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
        checks.append(Check("collectives", "FAIL", f"{type(e).__name__}: {first_line}"))
        print(_report(_title(env), info, checks), file=sys.stderr, flush=True)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    failed = any(c.verdict == "FAIL" for c in checks)
    if env[0] == 0:
        ranks = "\n".join(f"  rank {r}: {e['host']}  {_rank_device(e)}" for r, e in enumerate(envs))
        table = format_bandwidth(rows, env[1], chosen)
        if params:
            table += "\n\n" + format_advice(rows, params, step_s)
        print(_report(_title(env), info, checks, f"ranks:\n{ranks}\n\n{table}"), flush=True)
    elif failed:
        print(_report(_title(env), info, checks), file=sys.stderr, flush=True)
    return int(failed)


def _local_checks(
    backend: str, env: tuple[int, int, int, int] | None, timeout_s: float, endpoint: str | None, etcd: str | None
) -> tuple[list[Check], str | None, torch.device]:
    """The checks that need no other rank: (them, the backend chosen, the device)."""
    backend_check, chosen = check_backend(backend)
    device_check, device = check_device(env[2] if env else 0)
    checks = [backend_check, device_check, check_interface(endpoint)]
    if endpoint:
        checks.append(check_endpoint(endpoint, timeout_s))
    if etcd:
        checks.append(check_etcd(parse_endpoints("--etcd", etcd), min(timeout_s, ETCD_PROBE_S)))
    return checks, chosen, device


def _collective_checks(
    checks: list[Check], info: dict[str, str], device: torch.device, max_bytes: int
) -> tuple[list[dict[str, str]], list[dict[str, float]]]:
    """After the rendezvous: the ranks' versions, one all-reduce's result, the bandwidth sweep, appended to
    checks as each passes (a collective that fails mid-way leaves the earlier ones in the report);
    (every rank's environment, the sweep's rows)."""
    envs = gather_environments(info)
    checks += [check_consistency(envs), check_allreduce(device)]
    rows = bandwidth_sweep(device, max_bytes)
    best = max(rows, key=lambda r: r["busbw_gbs"]) if rows else None
    peak = (
        f"peak busbw {best['busbw_gbs']:.3f} GB/s at {_size(best['bytes'])}" if best else "no sizes below --max-bytes"
    )
    checks.append(Check("bandwidth", "PASS", peak))
    return envs, rows


def _rank_device(e: dict[str, str]) -> str:
    return e.get(f"cuda:{e.get('LOCAL_RANK', '0')}", f"cpu ({e['cpus']} cpus)")


def _title(env: tuple[int, int, int, int] | None) -> str:
    return "ddptrain doctor" + (f" (rank {env[0]} of {env[1]})" if env else " (single machine)")
