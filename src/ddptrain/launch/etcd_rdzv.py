"""The rendezvous through an existing etcd cluster (`ddptrain launch --rdzv-backend etcd-v2|etcd`).

torch's own etcd backends take one `HOST:PORT` and connect to that member alone; losing it ends
the job, which is the single point of failure etcd is there to remove. Here the python-etcd client
gets every member given in `--rdzv-endpoint` and may reconnect to any of them (and to the members
the cluster itself advertises), then the handler is assembled from torch's pieces exactly as
torch's registry would: `etcd-v2` is torch's DynamicRendezvousHandler over an etcd state backend
(the same state machine, keep-alives and conf keys as c10d), `etcd` the older EtcdRendezvous.

The conf keys torch's etcd-v2 backend reads are read alike for both: read_timeout (seconds per
etcd request, default 60), protocol (http or https), ca_cert, ssl_cert, ssl_cert_key.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousHandler
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

from ddptrain.endpoints import Endpoint, format_endpoint
from ddptrain.errors import DdptrainError, LaunchError
from ddptrain.etcd_endpoints import format_endpoints, require_client, wait_healthy

# The key prefixes torch's own factories use, so that a job started with plain torchrun and one
# started by ddptrain on the same etcd see each other's state the same way.
V2_STATE_PREFIX, V2_STORE_PREFIX, V1_PREFIX = "/torch/elastic/rendezvous", "/torch/elastic/store", "/torchelastic/p2p"


def _client(params: RendezvousParameters, endpoints: Sequence[Endpoint]) -> Any:
    require_client()
    import etcd

    read_timeout = params.get_as_int("read_timeout", 60)
    if read_timeout is None or read_timeout <= 0:
        raise LaunchError(f"--rdzv-conf read_timeout={params.get('read_timeout')} must be a positive number of seconds")
    protocol = str(params.get("protocol", "http")).strip().lower()
    if protocol not in ("http", "https"):
        raise LaunchError(f"--rdzv-conf protocol={protocol} must be http or https")
    cert = params.get("ssl_cert")
    if cert and params.get("ssl_cert_key"):
        cert = (cert, params.get("ssl_cert_key"))
    # One member: python-etcd's plain form. Several: a tuple of (host, port), which it requires to
    # come with allow_reconnect; it then also learns the members the cluster advertises.
    # python-etcd pastes hosts into URLs as they are: IPv6 needs its brackets.
    members = tuple((f"[{h}]" if ":" in h else h, p) for h, p in endpoints)
    host: Any = members[0][0] if len(members) == 1 else members
    try:
        return etcd.Client(
            host=host,
            port=members[0][1],
            read_timeout=read_timeout,
            protocol=protocol,
            cert=cert,
            ca_cert=params.get("ca_cert"),
            allow_reconnect=True,
        )
    except etcd.EtcdException as e:
        # Exit 1, not 2: the input may be right and etcd down, like any rendezvous that fails.
        raise DdptrainError(f"cannot reach etcd at {format_endpoints(endpoints)}: {e}") from None


def etcd_handler(params: RendezvousParameters, endpoints: Sequence[Endpoint]) -> RendezvousHandler:
    """The rendezvous handler of `params.backend` (etcd-v2 or etcd) over a client of every member."""
    client = _client(params, endpoints)
    if params.backend == "etcd-v2":
        from torch.distributed.elastic.rendezvous.etcd_rendezvous_backend import EtcdRendezvousBackend
        from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore

        backend = EtcdRendezvousBackend(client, params.run_id, key_prefix=V2_STATE_PREFIX)
        return create_handler(EtcdStore(client, V2_STORE_PREFIX), backend, params)
    from torch.distributed.elastic.rendezvous.etcd_rendezvous import EtcdRendezvous, EtcdRendezvousHandler

    rdzv = EtcdRendezvous(
        client=client,
        prefix=str(params.get("etcd_prefix", V1_PREFIX)),
        run_id=params.run_id,
        num_min_workers=params.min_nodes,
        num_max_workers=params.max_nodes,
        timeout=params.get_as_int("timeout", 600),
        last_call_timeout=params.get_as_int("last_call_timeout", 30),
    )
    return EtcdRendezvousHandler(rdzv_impl=rdzv, local_addr=params.local_addr)


def no_healthy_member(endpoints: Sequence[Endpoint], timeout_s: float) -> str | None:
    """Wait (at most timeout_s) for one member to be healthy; None when one is, else a line naming each and why.

    torch's etcd client would otherwise retry a dead endpoint until the rendezvous timeout and end
    with an exception that does not name it.
    """
    answers = wait_healthy(endpoints, timeout_s)
    if any(why is None for why in answers.values()):
        return None
    whys = "; ".join(f"{format_endpoint(e)}: {why}" for e, why in answers.items())
    return f"no etcd member was healthy within {timeout_s:g} s ({whys})"
