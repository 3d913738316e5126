"""A multi-node Ray cluster on this machine, for the tests, `workbench bench launch --cluster ray`
and notebook 07: a head on 127.0.0.1 and each further node on its own loopback address (127.0.0.2,
...), with Ray's token authentication on, as a real cluster's nodes would run it.

`ray start` daemonizes its processes; every one of them (and every worker they start) carries this
cluster's mark in its environment, which is how stop() finds and ends exactly this cluster's
processes and no other Ray's on the machine (`ray stop` ends them all).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil

MARK = "WORKBENCH_LOCAL_RAY"
"""In the environment of every process of a local cluster: its id."""
START_S = 120.0
"""How long one `ray start` may take (here: 6-9 s; a loaded 2-core box more)."""


class LocalRayCluster:
    """Nodes on 127.0.0.1, 127.0.0.2, ... each with `cpus` CPUs; start() brings them up, stop() ends
    every process they started. Use as a context manager, or call both."""

    def __init__(self, nodes: int = 2, cpus: int = 1, port: int | None = None) -> None:
        if nodes < 1:
            raise ValueError(f"nodes={nodes}: at least 1 (the head)")
        self.nodes = nodes
        self.cpus = cpus
        from workbench.launcher.processes import free_port

        self.port = port or free_port()
        self.token = local_token()
        self.id = secrets.token_hex(6)
        self.folder = Path(tempfile.mkdtemp(prefix="wb-ray-"))
        self.started: list[str] = []
        self._env_before: dict[str, str | None] = {}

    @property
    def address(self) -> str:
        """The head's GCS address, what wb.Ray(address=...) takes."""
        return f"127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """What a process needs to talk to this cluster (token auth), set before it imports ray."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token}

    def start(self) -> LocalRayCluster:
        """Bring up the head, then the other nodes; RuntimeError with `ray start`'s output when one
        doesn't come up (the processes started so far are stopped)."""
        try:
            self._start_node("127.0.0.1", head=True)
            for n in range(1, self.nodes):
                self._start_node(f"127.0.0.{n + 1}", head=False)
        except BaseException:
            self.stop()
            raise
        return self

    def add_node(self, cpus: int | None = None) -> str:
        """One more node, on the next loopback address; returns that address."""
        address = f"127.0.0.{len(self.started) + 1}"
        self._start_node(address, head=False, cpus=cpus)
        return address

    def _start_node(self, ip: str, head: bool, cpus: int | None = None) -> None:
        ray = shutil.which("ray") or str(Path(sys.executable).parent / "ray")
        command = [
            ray,
            "start",
            f"--node-ip-address={ip}",
            f"--num-cpus={cpus if cpus is not None else self.cpus}",
            "--num-gpus=0",
            "--disable-usage-stats",
            "--object-store-memory=100000000",
        ]
        if head:
            command += [
                "--head",
                f"--port={self.port}",
                "--include-dashboard=false",
                f"--temp-dir={self.folder}",
            ]
        else:
            command += [f"--address={self.address}"]
        env = {**os.environ, **self.env, MARK: self.id, "RAY_USAGE_STATS_ENABLED": "0"}
        done = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=START_S, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"`{' '.join(command)}` failed (exit {done.returncode}): "
                f"{(done.stderr or done.stdout)[-1500:]}"
            )
        self.started.append(ip)

    def processes(self) -> list[psutil.Process]:
        """Every live process of this cluster: those with the mark in their environment, and their
        children (Ray's agents rename themselves with setproctitle, which overwrites the
        environment's memory, so their mark can't be read)."""
        found: dict[int, psutil.Process] = {}
        for proc in psutil.process_iter(["pid"]):
            with contextlib.suppress(psutil.Error):
                if proc.environ().get(MARK) == self.id:
                    found[proc.pid] = proc
                    found.update((c.pid, c) for c in proc.children(recursive=True))
        return list(found.values())

    def node_processes(self, ip: str) -> list[psutil.Process]:
        """The processes of the node on `ip`: its raylet and what the raylet started."""
        raylets = [
            p
            for p in self.processes()
            if _quiet_name(p) == "raylet" and any(f"--node_ip_address={ip}" in a for a in _args(p))
        ]
        found: list[psutil.Process] = []
        for raylet in raylets:
            found.append(raylet)
            with contextlib.suppress(psutil.Error):
                found.extend(raylet.children(recursive=True))
        return found

    def kill_node(self, ip: str) -> int:
        """Kill the node on `ip` at once (SIGKILL to its raylet and its workers), as a machine lost;
        returns how many processes were killed."""
        victims = self.node_processes(ip)
        for proc in victims:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGKILL)
        psutil.wait_procs(victims, timeout=10)
        return len(victims)

    def stop(self) -> None:
        """End every process of the cluster (SIGTERM, then SIGKILL after 3 s; the GCS server at
        once, since it ignores SIGTERM and a caller at its own exit can't wait) and remove its
        folder."""
        procs = self.processes()
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                if _quiet_name(proc) == "gcs_server":
                    proc.kill()
                else:
                    proc.terminate()
        _, alive = psutil.wait_procs(procs, timeout=3)
        for proc in alive:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(alive, timeout=10)
        shutil.rmtree(self.folder, ignore_errors=True)
        self.started = []

    @contextlib.contextmanager
    def in_environment(self) -> Iterator[LocalRayCluster]:
        """This process talks to the cluster (its token in the environment) for the block."""
        before = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        try:
            yield self
        finally:
            for key, value in before.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value

    def __enter__(self) -> LocalRayCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def local_token() -> str:
    """The token of this user's local clusters, made once (~/.cache/workbench/ray-local-token, mode
    600). One for all of them: a process reads Ray's token once, when it first imports ray, so a
    process that talked to one local cluster can talk to the next."""
    path = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "workbench"
    path = path / "ray-local-token"
    with contextlib.suppress(OSError):
        token = path.read_text().strip()
        if len(token) >= 32:
            return token
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(16)
    fd = os.open(path.with_suffix(".tmp"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(token)
    os.replace(path.with_suffix(".tmp"), path)
    return token


def _quiet_name(proc: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        return proc.name()
    return ""


def _args(proc: psutil.Process) -> list[str]:
    with contextlib.suppress(psutil.Error):
        return proc.cmdline()
    return []


def available() -> str | None:
    """None when Ray Train can run here; else why not (for a skip). Doesn't import ray: a process
    reads Ray's token settings when it first imports it, so that must come after the cluster's
    environment is set (LocalRayCluster.in_environment)."""
    import importlib.util

    # find_spec("ray.train") would import ray itself
    spec = importlib.util.find_spec("ray")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    if not any((Path(folder) / "train" / "torch").is_dir() for folder in folders):
        return "Ray Train is not installed here; pip install 'workbench[ray]'"
    if shutil.which("ray") is None and not (Path(sys.executable).parent / "ray").exists():
        return "the `ray` command is not on PATH"
    return None
