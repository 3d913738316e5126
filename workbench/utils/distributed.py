"""Small corrections to torch.distributed that both sides use (a leaf module): the OpenMP flag of
forked ranks, DCP alone, and the listeners of a run bound to the interface its processes use."""

from __future__ import annotations

import contextlib
import importlib
import ipaddress
import logging
import os
import socket
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import psutil
import torch.distributed as dist

log = logging.getLogger("workbench")

FORKED_RANKS = "WORKBENCH_FORKED_RANKS"
"""Set by the fork-mode supervisor: the ranks are forks of the caller's process (see rank.py on
OpenMP)."""


@contextlib.contextmanager
def single_process_dcp(alone: bool = False) -> Iterator[None]:
    """DCP warns when it runs without a process group (or with `no_dist`: `alone`); one process
    saving or loading alone is what's meant."""
    with warnings.catch_warnings():
        if alone or not dist.is_initialized():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


LOOPBACK = "127.0.0.1"
"""Where every listener of a single-node run is bound: its processes talk to each other only."""


def loopback_interface() -> str:
    """The name of the network interface holding 127.0.0.1 ('lo' on Linux), for the variables that
    take an interface name (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME)."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == LOOPBACK for a in addresses):
            return name
    return "lo"


def single_node_listeners(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables that bind the ranks' own listeners of a single-node run to the loopback
    interface: gloo's (without it, gloo binds the address this host's name resolves to, a LAN
    address on many hosts) and NCCL's bootstrap (which skips `lo` unless told). A variable the user
    set is kept: their choice of interface stands."""
    environ = os.environ if environ is None else environ
    lo = loopback_interface()
    wanted = {"GLOO_SOCKET_IFNAME": lo, "NCCL_SOCKET_IFNAME": lo}
    kept = {k: environ[k] for k in wanted if k in environ and environ[k] != lo}
    if kept:
        log.info("single-node run: %s kept as set (workbench would bind them to %s)", kept, lo)
    return {k: v for k, v in wanted.items() if k not in kept}


def listening_socket(address: str, port: int) -> socket.socket:
    """A TCP socket listening on `address`:`port` only, for a TCPStore server to take over."""
    family, kind, proto, _, where = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        # as TCPStore's own server socket: a port left in TIME_WAIT by the last run can be reused
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(where)
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return sock


def bind_store_servers(address: str) -> None:
    """Every TCPStore server this process creates from now on (the rendezvous store of torch
    elastic's static rendezvous, which notebook_launcher, torchrun and `accelerate launch` use, and
    the env:// store of a rank 0 without an agent) listens on `address` only.

    torch's TCPStore server binds every interface whatever host name it is given, and takes no
    variable to change that; what it does take is a socket already listening (master_listen_fd),
    so the stores' constructors are wrapped to hand it one. The store owns the descriptor then and
    closes it when it is destroyed."""
    # by name: torch.distributed's `rendezvous` attribute is the function, not the module
    for name in (
        "torch.distributed.elastic.rendezvous.static_tcp_rendezvous",
        "torch.distributed.rendezvous",
    ):
        module = importlib.import_module(name)
        original = module.TCPStore
        if getattr(original, "_workbench_bound", None) == address:
            continue
        original = getattr(original, "_workbench_original", original)
        module.TCPStore = _bound_store(original, address)  # type: ignore[attr-defined]


def _bound_store(original: Any, address: str) -> Any:
    names = ("host_name", "port", "world_size", "is_master")

    def store(*args: Any, **kwargs: Any) -> Any:
        given = dict(zip(names, args, strict=False)) | kwargs
        if given.get("is_master") and given.get("master_listen_fd") is None:
            kwargs["master_listen_fd"] = listening_socket(address, int(given["port"])).detach()
        return original(*args, **kwargs)

    store._workbench_bound = address  # type: ignore[attr-defined]
    store._workbench_original = original  # type: ignore[attr-defined]
    return store


def store_address(master_addr: str, single_node: bool) -> str | None:
    """The address a rank 0's TCPStore server (torch.distributed's env:// rendezvous, without an
    agent's store: a Slurm job's ranks) is bound to, or None for every interface (torch's own).

    Single-node: the address the ranks connect to (MASTER_ADDR, as it resolves here: the ranks
    dial it, so binding anything else would leave them knocking on a closed port), which is a
    loopback address where the job names this node by one; loopback itself when it doesn't
    resolve. Multi-node: the address the nodes reach it by when it resolves, here, to an address
    of one of this host's interfaces that isn't loopback; a name that resolves to loopback here
    (Debian's /etc/hosts maps the host's own name to 127.0.1.1) while the other nodes resolve it
    elsewhere can't say which interface they use, so every interface stays open, with a
    warning."""
    try:
        resolved = {info[4][0] for info in socket.getaddrinfo(master_addr, None)}
    except OSError:
        resolved = set()
    local = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs}
    if single_node:
        here = sorted(
            (not ipaddress.ip_address(a).is_loopback, a)
            for a in resolved
            if a in local or ipaddress.ip_address(a).is_loopback
        )
        return here[0][1] if here else LOOPBACK
    usable = sorted(a for a in resolved & local if not ipaddress.ip_address(a).is_loopback)
    if usable:
        return usable[0]
    log.warning(
        "MASTER_ADDR=%s resolves to %s on this node, not to an address of a network interface "
        "the other nodes can reach: the rendezvous store listens on every interface (set "
        "MASTER_ADDR to this node's address on the nodes' network to bind only that)",
        master_addr,
        sorted(resolved) or "nothing",
    )
    return None


def bind_rank_store(environ: Mapping[str, str] | None = None) -> None:
    """In a rank: a TCPStore server it creates itself (rank 0 of ranks started without an elastic
    agent, as a Slurm job's are) listens on store_address's answer. Ranks under an agent only
    connect to the agent's store, bound by their launcher."""
    environ = os.environ if environ is None else environ
    master = environ.get("MASTER_ADDR")
    if not master or environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return
    # without LOCAL_WORLD_SIZE the ranks may be on other nodes: bound only where they can reach it
    local = environ.get("LOCAL_WORLD_SIZE")
    address = store_address(master, single_node=local == environ.get("WORLD_SIZE", "1"))
    if address is not None:
        bind_store_servers(address)
