"""What a run listens on (issue 46, item 1): every listening socket of a single-node run, the
rendezvous store first, is bound to loopback, for forked ranks (wb.start) and for `workbench train`
(torchrun), and the store can't be reached through the host's other addresses. And the fork path
against accelerate#4059: nothing in the processes that fork the ranks asks torch about CUDA while
CUDA is reported available.

The probes are real 2-rank gloo runs on CPU; the sockets are read from /proc/net/tcp(6) and the
run's processes' file descriptors, as `ss -ltnp` does."""

from __future__ import annotations

import contextlib
import datetime
import importlib
import ipaddress
import logging
import os
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
import tomllib
import torch
from packaging.requirements import Requirement

import workbench as wb
from workbench.rundir import RunDir
from workbench.utils import distributed

TESTS = Path(__file__).parent
REPO = TESTS.parent


def listening_sockets() -> dict[int, tuple[str, int]]:
    """Socket inode -> (address, port) of every listening TCP socket of this network namespace."""
    found: dict[int, tuple[str, int]] = {}
    for table, size in (("tcp", 4), ("tcp6", 16)):
        path = Path("/proc/net") / table
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A":  # TCP_LISTEN
                continue
            hex_address, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_address)
            # the kernel prints each 32-bit word of the address in host (little-endian) order
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, size, 4))
            found[int(fields[9])] = (str(ipaddress.ip_address(raw)), int(hex_port, 16))
    return found


def listeners_of(pids: list[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every listening socket the processes `pids` hold."""
    table, held = listening_sockets(), set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("socket:[") and int(target[8:-1]) in table:
                        held.add((pid, *table[int(target[8:-1])]))
    return sorted(held)


def non_loopback_address() -> str | None:
    """An IPv4 address of this host that isn't loopback; None if it has none."""
    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback:
                return a.address
    return None


def accepts(address: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(3)
        try:
            s.connect((address, port))
        except OSError:
            return False
        return True


def assert_bound_to_loopback(listeners: list[tuple[int, str, int]]) -> None:
    """Every listener on loopback, and none reachable through this host's other address (when a
    listener on every interface is, there: else the host can't tell)."""
    open_to_all = [
        (pid, a, p) for pid, a, p in listeners if not ipaddress.ip_address(a).is_loopback
    ]
    assert open_to_all == [], f"listening beyond loopback: {open_to_all} (all: {listeners})"
    other = non_loopback_address()
    if other is None:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as control:
        control.bind(("0.0.0.0", 0))
        control.listen()
        if not accepts(other, control.getsockname()[1]):
            return  # unreachable even when open: a refusal below would prove nothing
    reachable = sorted({p for _, _, p in listeners if accepts(other, p)})
    assert reachable == [], f"ports accepting connections through {other}: {reachable}"


def the_config(tmp_path: Path, name: str, **fields: object) -> wb.RunConfig:
    fields = {"max_steps": 100_000, "task_options": {"slow_s": 0.03}} | fields
    return wb.RunConfig(
        task="tasks_for_tests:TinyRegression",
        num_processes=2,
        device="cpu",
        micro_batch_size=16,
        log_every=1,
        runs_dir=str(tmp_path / "runs"),
        run_name=name,
        **fields,
    )


def wait_until_training(run: RunDir, alive: Callable[[], bool], steps: int = 2) -> None:
    deadline = time.monotonic() + 120
    while len([r for r in run.metrics() if "loss" in r]) < steps:
        assert run.observed_status()[0] != "failed", f"the run failed: {run.summary()}"
        assert alive(), "the launcher ended before training"
        assert time.monotonic() < deadline, f"no {steps} steps trained within 120 s"
        time.sleep(0.1)


def kill_all(tree: list[psutil.Process], timeout: float = 30) -> None:
    """SIGKILL to every process of `tree` still running, then wait until each is gone (a zombie
    whose parent died first counts as gone: nobody here may reap it)."""
    for p in tree:
        with contextlib.suppress(psutil.Error):
            p.kill()  # psutil checks the start time: never another process that got the pid
    deadline = time.monotonic() + timeout
    for p in tree:
        with contextlib.suppress(psutil.Error):
            while p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                assert time.monotonic() < deadline, f"{p.pid} survived SIGKILL for {timeout} s"
                time.sleep(0.05)


@pytest.mark.slow
def test_a_forked_run_listens_on_loopback_only(tmp_path: Path) -> None:
    """The probe: `ss -ltnp` of a live fork-mode run showed its TCPStore as *:PORT."""
    cfg = the_config(tmp_path, "forked", start_method="fork")
    run = wb.start(cfg)
    tree: list[psutil.Process] = []
    try:
        wait_until_training(RunDir(tmp_path / "runs" / "forked"), lambda: not run.done())
        tree = psutil.Process().children(recursive=True)
        listeners = listeners_of([p.pid for p in tree])
        supervisors = {p.pid for p in psutil.Process().children()}
        assert [e for e in listeners if e[0] in supervisors], (
            f"the supervisor's rendezvous store wasn't found among {listeners}"
        )
        assert len({pid for pid, _, _ in listeners}) >= 3, (
            f"the 2 ranks' gloo listeners: {listeners}"
        )
        assert_bound_to_loopback(listeners)
    finally:
        tree += psutil.Process().children(recursive=True)
        with contextlib.suppress(Exception):
            run.kill()  # ends and reaps the supervisor (multiprocessing's child) and the ranks
        kill_all(tree)  # whatever kill() left


@pytest.mark.slow
def test_workbench_train_listens_on_loopback_only(tmp_path: Path) -> None:
    """The probe: `workbench train` (torchrun, even with --master_addr 127.0.0.1) showed its store
    as *:PORT."""
    config = tmp_path / "run.yaml"
    the_config(tmp_path, "trained").to_yaml(config)
    env = {**os.environ, "PYTHONPATH": str(TESTS), "PYTHONUNBUFFERED": "1"}
    with open(tmp_path / "output.txt", "w") as output:
        proc = subprocess.Popen(
            [sys.executable, "-m", "workbench.cli", "train", str(config), "--no-progress"],
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    tree = [psutil.Process(proc.pid)]
    try:
        wait_until_training(RunDir(tmp_path / "runs" / "trained"), lambda: proc.poll() is None)
        tree += tree[0].children(recursive=True)
        listeners = listeners_of([p.pid for p in tree])
        assert len({pid for pid, _, _ in listeners}) >= 3, (
            f"torchrun's store and the 2 ranks' gloo listeners expected: {listeners}\n"
            + (tmp_path / "output.txt").read_text()[-3000:]
        )
        assert_bound_to_loopback(listeners)
    finally:
        with contextlib.suppress(psutil.Error):
            tree += tree[0].children(recursive=True)
        kill_all(tree)
        proc.wait(30)


@pytest.fixture
def restored_stores(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stores' constructors bind_store_servers wraps, put back after the test."""
    for name in (
        "torch.distributed.elastic.rendezvous.static_tcp_rendezvous",
        "torch.distributed.rendezvous",
    ):
        module = importlib.import_module(name)
        monkeypatch.setattr(module, "TCPStore", module.TCPStore)


def test_the_rendezvous_store_binds_where_it_is_told(restored_stores: None) -> None:
    """elastic's static rendezvous (notebook_launcher's, torchrun's, `accelerate launch`'s), as it
    builds its store: on every interface by default, on loopback once bound; bound twice wraps
    once."""
    from torch.distributed.elastic.rendezvous import static_tcp_rendezvous

    timeout = datetime.timedelta(seconds=30)
    default = static_tcp_rendezvous.TCPStore(
        "127.0.0.1", distributed_port(), 1, True, timeout, multi_tenant=True
    )
    assert [a for _, a, p in listeners_of([os.getpid()]) if p == default.port] in (
        ["::"],
        ["0.0.0.0"],
    )
    distributed.bind_store_servers(distributed.LOOPBACK)
    distributed.bind_store_servers(distributed.LOOPBACK)
    assert not hasattr(static_tcp_rendezvous.TCPStore._workbench_original, "_workbench_original")
    port = distributed_port()
    server = static_tcp_rendezvous.TCPStore("127.0.0.1", port, 1, True, timeout, multi_tenant=True)
    assert [a for _, a, p in listeners_of([os.getpid()]) if p == port] == ["127.0.0.1"]
    client = torch.distributed.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    client.set("written", "by a client")
    assert server.get("written") == b"by a client"


def distributed_port() -> int:
    from workbench.launcher.processes import free_port

    return free_port()


def test_the_ranks_listeners_go_to_loopback_unless_the_user_chose() -> None:
    lo = distributed.loopback_interface()
    assert "127.0.0.1" in [a.address for a in psutil.net_if_addrs()[lo]]
    assert distributed.single_node_listeners({}) == {
        "GLOO_SOCKET_IFNAME": lo,
        "NCCL_SOCKET_IFNAME": lo,
    }
    assert distributed.single_node_listeners({"NCCL_SOCKET_IFNAME": "eth7"}) == {
        "GLOO_SOCKET_IFNAME": lo
    }


def test_a_rank_hosting_the_store_binds_where_its_ranks_dial_and_multi_node_to_the_nodes_address(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # single node: where the ranks dial (MASTER_ADDR as it resolves), loopback when it names one
    assert distributed.store_address("no-such-host.invalid", single_node=True) == "127.0.0.1"
    assert distributed.store_address("127.0.0.2", single_node=True) == "127.0.0.2"
    assert distributed.store_address("localhost", single_node=True) in ("127.0.0.1", "::1")
    other = non_loopback_address()
    if other is not None:
        assert distributed.store_address(other, single_node=False) == other
    with caplog.at_level(logging.WARNING, logger="workbench"):
        assert distributed.store_address("127.0.0.1", single_node=False) is None
    assert "MASTER_ADDR=127.0.0.1 resolves to ['127.0.0.1']" in caplog.text
    assert "listens on every interface" in caplog.text


def test_a_rank_hosting_the_env_store_binds_it_only_when_it_knows_where_the_ranks_are(
    restored_stores: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 of ranks without an agent (a Slurm job's) hosts torch's env:// store: on loopback when
    every rank is on this node, left on every interface when the nodes' address isn't known here,
    untouched under an agent (the ranks are its clients)."""
    # by name: torch.distributed's `rendezvous` attribute is the function of that name
    env_rendezvous = importlib.import_module("torch.distributed.rendezvous")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    unbound = env_rendezvous.TCPStore
    agent = {"MASTER_ADDR": "127.0.0.1", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    distributed.bind_rank_store(agent | {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})
    assert env_rendezvous.TCPStore is unbound
    distributed.bind_rank_store({"MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "2"})  # nodes unknown
    assert env_rendezvous.TCPStore is unbound
    distributed.bind_rank_store(
        {"MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    )
    port = distributed_port()
    store = env_rendezvous._create_c10d_store(
        "127.0.0.1", port, 0, 1, datetime.timedelta(seconds=30)
    )
    assert [a for _, a, p in listeners_of([os.getpid()]) if p == port] == ["127.0.0.1"]
    store.set("key", "value")
    assert store.get("key") == b"value"


# --- the fork path against accelerate#4059 -------------------------------------------------------

CUDA_QUERIES = ("is_available", "device_count", "_lazy_init", "init", "current_device")


@contextlib.contextmanager
def cuda_reported_available(record: Path) -> Iterator[None]:
    """torch.cuda says GPUs are there: any query or initialisation of CUDA in a process that isn't
    a rank (this one, the fork-mode supervisor: forks inherit the patch) is written to `record` with
    its stack, and raises. A rank (RANK set by elastic) gets torch's real answers: it trains on
    CPU."""
    originals = {name: getattr(torch.cuda, name) for name in CUDA_QUERIES}

    def guard(name: str) -> object:
        def query(*args: object, **kwargs: object) -> object:
            if "RANK" in os.environ:
                return originals[name](*args, **kwargs)
            stack = "".join(traceback.format_stack()[-12:-1])  # the callers, innermost last
            with open(record, "a") as f:
                f.write(f"pid {os.getpid()}: torch.cuda.{name}() called\n{stack}\n")
            raise RuntimeError(f"torch.cuda.{name}() in the launching process {os.getpid()}")

        return query

    with pytest.MonkeyPatch.context() as patch:
        for name in CUDA_QUERIES:
            patch.setattr(torch.cuda, name, guard(name))
        yield


def test_the_cuda_guard_catches_torchs_numa_autodetection(tmp_path: Path) -> None:
    """What accelerate#4059 fixed, caught by the guard: torch's LaunchConfig (torch >= 2.9) asks
    CUDA for NUMA options when none are given, in the process that then forks the ranks."""
    from torch.distributed.launcher.api import LaunchConfig

    record = tmp_path / "cuda.txt"
    with cuda_reported_available(record), pytest.raises(RuntimeError, match="launching process"):
        LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2)
    assert "torch.cuda.is_available() called" in record.read_text()


@pytest.mark.slow
def test_a_forked_launch_never_asks_cuda_in_the_launching_processes(tmp_path: Path) -> None:
    """The launching process and the supervisor that forks the ranks (accelerate's
    notebook_launcher, and its LaunchConfig) ask nothing of CUDA while CUDA is reported available:
    forked ranks could not use it."""
    record = tmp_path / "cuda.txt"
    cfg = the_config(tmp_path, "no-cuda-asked", start_method="fork", max_steps=2, task_options={})
    with cuda_reported_available(record):
        result = wb.launch(cfg, progress=False)
    asked = record.read_text() if record.exists() else ""
    assert asked == "", f"CUDA was asked in a launching process:\n{asked}"
    assert result.summary["status"] == "completed", result.summary


def test_accelerate_is_required_at_the_version_with_the_fork_fix() -> None:
    """accelerate 1.14 (accelerate#4059) is the first whose notebook_launcher leaves CUDA alone on
    torch >= 2.9; pyproject.toml requires it."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    required = next(
        Requirement(d) for d in pyproject["project"]["dependencies"] if d.startswith("accelerate")
    )
    assert not required.specifier.contains("1.13.0") and required.specifier.contains("1.14.0")
