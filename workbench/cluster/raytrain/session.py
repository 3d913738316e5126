"""This process's connection to a Ray cluster, kept quiet: Ray's own lines (its logger's, and what
its C++ core writes straight to the process's stderr: token-auth notes, connection banners) go to
a log file, not into the notebook cell (ipykernel shows a process's file-descriptor output too).

`ray` is imported here, lazily: `import workbench` and a local run never load it."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

RAY_LOGGERS = ("ray", "ray.train", "ray.data", "ray.tune")
INSTALL = "pip install 'workbench[ray]'"


def import_ray() -> Any:
    """The ray module, or ImportError saying how to install it."""
    try:
        import ray
    except ImportError as e:
        raise ImportError(
            f"wb.Ray needs Ray Train, which is not installed here ({e}); {INSTALL}"
        ) from e
    return ray


def resolve_address(address: str | None) -> str:
    """The address ray.init gets: `address`, else $RAY_ADDRESS, else 'auto' (a cluster `ray start`
    brought up on this machine)."""
    return address or os.environ.get("RAY_ADDRESS") or "auto"


@contextlib.contextmanager
def quiet(log_path: Path | None, keep: bool = True) -> Iterator[None]:
    """Ray's lines into `log_path` (appended) for the block: its Python loggers, and file
    descriptors 1 and 2, which its core writes to directly. None: into the void. `keep`: Ray's
    loggers go on writing there after the block (a line Ray logs later, a reconnect)."""
    target = str(log_path) if log_path is not None else os.devnull
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with open(target, "ab") as sink:
        saved = [os.dup(1), os.dup(2)]
        handler = logging.StreamHandler(open(target, "a", encoding="utf-8"))  # noqa: SIM115
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        loggers = [logging.getLogger(name) for name in RAY_LOGGERS]
        before = [(lg.handlers[:], lg.propagate) for lg in loggers]
        try:
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            for lg in loggers:
                lg.handlers[:] = [handler]
                lg.propagate = False
            yield
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            for lg, (handlers, propagate) in zip(loggers, before, strict=True):
                lg.handlers[:] = [handler] if keep else handlers
                lg.propagate = False if keep else propagate
            if not keep:
                handler.close()


def connect(
    address: str | None, namespace: str, log_path: Path | None = None, keep: bool = True
) -> Any:
    """Connect this process to the cluster at `address` (resolve_address) once; again only when the
    address changes. ValueError saying what to do when no cluster answers there."""
    ray = import_ray()
    _check_token_settings()
    where = resolve_address(address)
    current = _connected_to()
    if current is not None:
        if current == (where, namespace):
            return ray
        ray.shutdown()
    with quiet(log_path, keep=keep):
        try:
            ray.init(
                address=where,
                namespace=namespace,
                log_to_driver=False,
                logging_level=logging.WARNING,
                configure_logging=False,
                include_dashboard=False,
            )
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise ValueError(_no_cluster(where, e)) from e
        except Exception as e:  # Ray raises its own types for a refused token, say
            raise ValueError(_no_cluster(where, e)) from e
    _CONNECTED[0] = (where, namespace)
    return ray


_CONNECTED: list[tuple[str, str] | None] = [None]


def _connected_to() -> tuple[str, str] | None:
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    return _CONNECTED[0]


def _check_token_settings() -> None:
    """Ray reads RAY_AUTH_MODE when it is first imported: a process that imported it before the
    variable was set can't use token authentication (it retries for ~20 s, then fails without
    saying why)."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        return
    from ray._private.authentication.authentication_utils import is_token_auth_enabled

    if not is_token_auth_enabled():
        raise ValueError(
            "Ray: RAY_AUTH_MODE=token is set, but Ray was imported in this process before it "
            "was, and Ray reads it once, at import; restart the kernel (or process) and set "
            "RAY_AUTH_MODE and RAY_AUTH_TOKEN before anything imports ray (in the shell that "
            "starts Jupyter, or in the first cell)"
        )


def _chain(error: BaseException) -> str:
    """The error's text and its causes' (Ray wraps the reason a connection failed)."""
    texts, seen = [], set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        texts.append(str(current))
        current = current.__cause__ or current.__context__
    return " ".join(texts)


def _no_cluster(where: str, error: BaseException) -> str:
    said = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error) else ''}"
    cause = error.__cause__ or error.__context__
    if cause is not None and str(cause).strip():
        # Ray's outer message says only that it failed; the reason is in the cause
        lines = [line.strip() for line in str(cause).strip().splitlines() if line.strip()]
        said += f"; {type(cause).__name__}: {lines[-1][:300]}"
    auth = ""
    if "InvalidAuthToken" in _chain(error) or "auth" in str(error).lower():
        auth = (
            " The cluster refused this process's token (Ray's token authentication): set "
            "RAY_AUTH_MODE=token and RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) to the cluster's, as "
            "on its nodes, before ray is imported (restart the kernel after changing them)."
        )
    return (
        f"Ray: no cluster answered at address={where!r} ({said}).{auth} Start one (`ray start "
        "--head` on the head node, `ray start --address=HEAD:6379` on the others) or give the "
        "head's address: wb.Ray(address='HOST:6379')"
    )


def head_node_id(nodes: list[dict[str, Any]]) -> str | None:
    """The head node's id among ray.nodes() (the one with the internal head resource)."""
    for node in nodes:
        if node.get("Alive") and "node:__internal_head__" in node.get("Resources", {}):
            return str(node["NodeID"])
    return None
