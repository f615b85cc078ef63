"""`ddptrain launch`'s options as torchrun's: the command line and the environment they stand for.

torchrun's own parser and `config_from_args` turn the command line into a LaunchConfig (launcher.py);
`--dry-run` prints it. What torchrun's CLI cannot say (the agent's exit-code contract, a bounded
exit barrier, stores bound to one address) is the agent's (agent.py) and is described by
`beyond_torchrun`.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import socket
import struct

from ddptrain.dist import BIND_ADDR_ENV
from ddptrain.endpoints import host_port
from ddptrain.errors import EXIT_INTERRUPTED, EXIT_LEASE_LOST, EXIT_PREEMPTED, EXIT_USAGE, LaunchError
from ddptrain.etcd_endpoints import ETCD_ENV, format_endpoints, parse_endpoints
from ddptrain.launch.options import LaunchOptions, node_counts, nproc_per_node
from ddptrain.observe.triage import TRIAGE_STORE_ENV
from ddptrain.train.agent_watch import GRACE_ENV

LOOPBACK = "127.0.0.1"
ETCD_READ_TIMEOUT_S = 10  # per etcd request, below the dynamic rendezvous' keep-alive expiry (15 s)
# torchrun variables a scheduler may set (the Kubeflow operator does) and the launch option each stands for.
_PET_OPTIONS = {
    "PET_NNODES": "nnodes",
    "PET_NPROC_PER_NODE": "nproc_per_node",
    "PET_RDZV_ENDPOINT": "rdzv_endpoint",
    "PET_RDZV_ID": "run_id",
    "PET_MAX_RESTARTS": "max_restarts",
}
# Where a job meets: (torchrun's --rdzv-endpoint, --rdzv-id, the address this node advertises or None).
Rendezvous = tuple[str, str, str | None]


def workers_here(value: str) -> tuple[int, str | None]:
    """--nproc-per-node resolved on this node, and a note saying what `auto` chose.

    auto: one worker per GPU; on a node without one, a single worker, whose ops use every core
    through torch's intra-op threads. torchrun's own auto starts one worker per CPU: 64 ranks on a
    64-core node, each with a copy of the model and optimizer state, for about the throughput of one
    (DDP ranks of one thread each ran 0.97x one process with that many threads here).
    """
    count = nproc_per_node(value)
    if count is not None:
        return count, None
    import torch  # the agent already imports torch.distributed; this only asks for devices

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus:
        return gpus, None
    return 1, (
        f"--nproc-per-node auto: no GPU on this node, so 1 worker using its {os.cpu_count()} CPUs through "
        "intra-op threads; pass a number for more ranks"
    )


def default_run_id(endpoint: str) -> str:
    """A rendezvous id every node derives alike from the endpoint, so none has to be passed around."""
    return "ddptrain-" + hashlib.sha256(endpoint.encode()).hexdigest()[:12]


def interface_of(addr: str) -> str | None:
    """The network interface holding IPv4 address `addr` on this machine, or None."""
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on this interface
            if socket.inet_ntoa(raw[20:24]) == addr:
                return name
    return None


def torchrun_command(options: LaunchOptions) -> tuple[dict[str, str], list[str]]:
    """(environment additions, torchrun arguments) equivalent to the launch options."""
    worker = options.worker_argv()
    _, max_nodes = node_counts(options.nnodes)
    workers, _ = workers_here(options.nproc_per_node)
    options.check_numbers()
    # torch's older etcd rendezvous calls the join timeout `timeout`; etcd-v2 shares c10d's keys.
    join = "timeout" if options.rdzv_backend == "etcd" else "join_timeout"
    conf = [f"{join}={options.rdzv_timeout}", f"last_call_timeout={options.rdzv_last_call}"]
    env = _worker_env(options, workers)
    if options.etcd:
        endpoint, run_id, node_addr = _etcd_rendezvous(options, conf, env)
    elif options.rdzv_endpoint:
        endpoint, run_id, node_addr = _c10d_rendezvous(options, conf, env)
    elif max_nodes > 1:
        raise LaunchError(f"--nnodes {options.nnodes} needs --rdzv-endpoint HOST:PORT (the same on every node)")
    else:
        endpoint, run_id, node_addr = _local_rendezvous(options, env)
    if options.rdzv_conf:
        conf.append(options.rdzv_conf)
    argv = [
        *("--nnodes", options.nnodes, "--nproc-per-node", str(workers), "--rdzv-backend", options.rdzv_backend),
        # torchrun itself takes one etcd member; the agent here is given all of them
        *("--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--rdzv-conf", ",".join(conf)),
        *("--max-restarts", str(options.max_restarts), "--monitor-interval", str(options.monitor_interval)),
        *("--signals-to-handle", options.signals_to_handle, "--shutdown-timeout", str(options.shutdown_timeout)),
    ]
    if node_addr:
        argv += ["--local-addr", node_addr]
        iface = interface_of(node_addr)
        if iface and "GLOO_SOCKET_IFNAME" not in os.environ:
            env["GLOO_SOCKET_IFNAME"] = iface  # gloo would otherwise pick by resolving the hostname
    return env, [*argv, *worker]


def _worker_env(options: LaunchOptions, workers: int) -> dict[str, str]:
    # Each rendezvous round gets a fresh worker store (on rank 0, new port): the store shared
    # across rounds keeps the previous workers' keys, and a restarted worker that starts early
    # reads a dead peer's address from them and fails to connect. With etcd it is also what lets
    # the job outlive the first node: the shared store lives in that node's agent.
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = "1"  # what torchrun sets then, without its 4-line warning saying so
    # A worker whose agent dies gets the time the agent would have given it to stop (train/agent_watch.py).
    env[GRACE_ENV] = str(options.shutdown_timeout)
    return env


def _etcd_rendezvous(options: LaunchOptions, conf: list[str], env: dict[str, str]) -> Rendezvous:
    backend = options.rdzv_backend
    if not options.rdzv_endpoint:
        raise LaunchError(f"--rdzv-backend {backend} needs --rdzv-endpoint HOST[:PORT],... (etcd members)")
    if not options.run_id:
        raise LaunchError(
            f"--rdzv-backend {backend} needs --run-id: jobs share the etcd cluster, so its "
            "address cannot tell them apart (use e.g. the scheduler's job id)"
        )
    endpoint = format_endpoints(parse_endpoints("--rdzv-endpoint", options.rdzv_endpoint))
    env[ETCD_ENV] = endpoint  # `ddptrain doctor` as the worker command checks every member
    if "read_timeout=" not in options.rdzv_conf:
        # torch waits 60 s on an etcd request; a member that stopped answering then holds a node's
        # keep-alive past its expiry (3 x 5 s) and the others drop it. After this long the client
        # moves on to another member: etcd answers in milliseconds when it answers at all.
        conf.append(f"read_timeout={ETCD_READ_TIMEOUT_S}")
    if options.node_addr:
        env[BIND_ADDR_ENV] = options.node_addr  # the workers' store listens on this address only
    return endpoint, options.run_id, options.node_addr


def _c10d_rendezvous(options: LaunchOptions, conf: list[str], env: dict[str, str]) -> Rendezvous:
    endpoint = options.rdzv_endpoint or ""
    host, _ = host_port("--rdzv-endpoint", endpoint)
    env[TRIAGE_STORE_ENV] = endpoint  # the rendezvous store outlives any worker: triage checks in there
    if options.node_addr:
        # torchrun guesses whether it hosts the store by resolving hostnames, which fails
        # wherever hostnames do not resolve (containers, namespaces): say it explicitly.
        conf.insert(0, f"is_host={'true' if options.node_addr == host else 'false'}")
        env[BIND_ADDR_ENV] = options.node_addr  # stores listen on this address only
    return endpoint, options.run_id or default_run_id(endpoint), options.node_addr


def _local_rendezvous(options: LaunchOptions, env: dict[str, str]) -> Rendezvous:
    # One node: a free port. Nothing of a one-node job needs to be reachable from elsewhere:
    # loopback only (or the address given), for the stores, gloo and NCCL's bootstrap alike.
    node_addr = options.node_addr or LOOPBACK
    env[BIND_ADDR_ENV] = node_addr
    iface = interface_of(node_addr)
    if iface and "NCCL_SOCKET_IFNAME" not in os.environ:
        env["NCCL_SOCKET_IFNAME"] = iface
    return "localhost:0", options.run_id or "ddptrain-local", node_addr


def beyond_torchrun(options: LaunchOptions, env: dict[str, str]) -> str:
    """The comment `--dry-run` prints under the torchrun line: what the agent adds to what that line says."""
    return (
        f"# beyond torchrun: worker exit {EXIT_PREEMPTED}, {EXIT_INTERRUPTED}, {EXIT_LEASE_LOST} or {EXIT_USAGE} "
        "ends the job with "
        f"that code (no restart), exit barrier {options.exit_barrier_timeout:g} s, restarts stop workers within "
        f"{options.shutdown_timeout} s, "
        + (f"the etcd client is given every member ({options.rdzv_endpoint}), " if options.etcd else "")
        + "stores listen on "
        + (f"{env[BIND_ADDR_ENV]} only" if BIND_ADDR_ENV in env else "every interface (pass --node-addr)")
        + (
            ", workers fork from a server that imported torch once (--worker-start preloaded)"
            if options.worker_start == "preloaded"
            else ""
        )
    )


def pet_conflicts(options: LaunchOptions, inherited: dict[str, str]) -> list[str]:
    """One line per inherited torchrun variable that contradicts the command line (which wins)."""
    lines = []
    for key, value in inherited.items():
        dest = _PET_OPTIONS.get(key)
        ours = getattr(options, dest, None) if dest is not None else None
        if dest is not None and ours is not None and str(ours) != value:
            lines.append(
                f"warning: {key}={value} from the environment differs from --{dest.replace('_', '-')} {ours}; "
                "using the command line"
            )
    return lines
