"""The panel's Ray side of "where": the cluster's address, the worker-group failures Ray recovers
from and the resources each worker holds; the workers are the run's processes, one rank each.

What the cluster has is read only when the user asks (↻): reading it connects this kernel to the
cluster, which takes seconds, so building the panel never does. Until then the run is planned on
the controls alone (CPU workers like this machine's, or the catalog GPU chosen), and the cluster's
own check (can its nodes place the workers?) runs when Launch submits."""

from __future__ import annotations

import dataclasses
import html
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets

from workbench.cluster.raytrain.spec import Ray, check_placement, check_run
from workbench.estimator.target import Target
from workbench.utils.hardware import Hardware

if TYPE_CHECKING:
    from workbench.cluster.raytrain.run import RayRun
    from workbench.config import RunConfig

STYLE = {"description_width": "140px"}


def default_address() -> str:
    """What the address box starts with: $RAY_ADDRESS, else 'auto' (the cluster `ray start`
    brought up on this machine)."""
    return os.environ.get("RAY_ADDRESS") or "auto"


@dataclass(frozen=True, kw_only=True)
class RayTarget(Target):
    """A plan for a Ray cluster's workers, one rank each: CPU workers taken to be like this
    machine's cores, or GPU workers of the catalog model `gpu`. Launch submits it (launchable);
    its world size is the run's processes."""

    address: str = "auto"
    """The cluster's address as the address box has it."""
    cpus_per_worker: float = 1.0
    """CPUs each worker holds (Ray's CPU resource)."""
    gpus_per_worker: float = 0.0
    """GPUs each worker holds; 0: CPU workers."""

    @property
    def local(self) -> bool:
        return False

    @property
    def launchable(self) -> bool:
        return True

    def describe(self, cfg: RunConfig | None = None) -> str:
        """'2 Ray workers (CPU 1 each) on the cluster at auto'."""
        workers = cfg.num_processes if cfg is not None else 0
        each = f"CPU {self.cpus_per_worker:g}" + (
            f", GPU {self.gpus_per_worker:g}" if self.gpus_per_worker else ""
        )
        device = "" if self.cpu_nodes else f" x {self.gpu}"
        return (
            f"{workers} Ray worker{'s' * (workers != 1)}{device} ({each} each) on the cluster at "
            f"{self.address}"
        )

    def hardware(self, cfg: RunConfig) -> Hardware:
        """CPU workers: as many cores as the workers hold in all (at least one each); GPU workers:
        the catalog's GPUs, one node of the run's processes."""
        if not self.cpu_nodes:
            return super().hardware(cfg)
        cores = max(cfg.num_processes, int(self.cpus_per_worker * cfg.num_processes))
        return Hardware(cpu_count=cores, nodes=1, planned=self.describe(cfg))


class RayControls:
    """Address (with ↻ to read the cluster), max failures, CPUs and GPUs per worker; `spec()`
    forms the wb.Ray, keeping a preset's other fields (runtime_env, env, namespace, placement)."""

    def __init__(self, cluster: Ray | None = None) -> None:
        self.preset = cluster or Ray()
        """The wb.Ray the panel was given (or Ray()): its fields without a control carry over."""
        self.nodes: list[dict[str, Any]] | None = None
        """ray.nodes() as ↻ read them last; None before (or after the address changed)."""
        self.error = ""
        """Why the cluster couldn't be read ('' when it was, or wasn't asked)."""
        per = self.preset.resources_per_worker or {}
        self.address = widgets.Text(
            value=self.preset.address or default_address(),
            description="Ray address",
            style=STYLE,
            placeholder="auto, or HOST:6379",
            layout=widgets.Layout(width="380px"),
            tooltip="the head node's HOST:PORT; auto: $RAY_ADDRESS, else the cluster `ray start` "
            "brought up on this machine",
        )
        self.reread = widgets.Button(
            icon="refresh",
            tooltip="ask the cluster for its nodes and resources (connects to it: seconds)",
            layout=widgets.Layout(width="36px"),
        )
        self.reread.on_click(lambda _button: self.read())
        self.max_failures = widgets.BoundedIntText(
            value=self.preset.max_failures,
            min=-1,
            max=10_000,
            description="max failures",
            style=STYLE,
            layout=widgets.Layout(width="220px"),
            tooltip="worker-group failures Ray recovers from: it restarts the workers and the run "
            "resumes from its last checkpoint; -1: no limit",
        )
        self.cpus = widgets.BoundedFloatText(
            value=per.get("CPU", 1.0),
            min=0,
            max=4096,
            step=1,
            description="CPUs per worker",
            style=STYLE,
            layout=widgets.Layout(width="220px"),
            tooltip="Ray CPUs each worker (rank) holds; its rank runs that many threads",
        )
        self.gpus = widgets.BoundedFloatText(
            value=per.get("GPU", 1.0 if self.preset.use_gpu else 0.0),
            min=0,
            max=64,
            step=1,
            description="GPUs per worker",
            style=STYLE,
            layout=widgets.Layout(width="220px"),
            tooltip="Ray GPUs each worker holds; 0: the ranks run on CPUs",
        )
        self.info = widgets.HTML()
        for control, css in (
            (self.address, "wb-ray-address"),
            (self.reread, "wb-ray-reread"),
            (self.max_failures, "wb-ray-max-failures"),
            (self.cpus, "wb-ray-cpus"),
            (self.gpus, "wb-ray-gpus"),
        ):
            control.add_class(css)
        self.widget = widgets.VBox(
            [
                widgets.HBox([self.address, self.reread]),
                self.info,
                self.max_failures,
                self.cpus,
                self.gpus,
            ]
        )
        # what was read is about the address it was read at
        self.address.observe(self._forget, names="value")
        self._on_read: list[Callable[[], None]] = []

    @property
    def values(self) -> list[widgets.ValueWidget]:
        """The controls whose value changes the plan (the target controls observe them)."""
        return [self.address, self.max_failures, self.cpus, self.gpus]

    def on_read(self, callback: Callable[[], None]) -> None:
        self._on_read.append(callback)

    def _forget(self, change: Any = None) -> None:
        self.nodes, self.error = None, ""

    def read(self) -> None:
        """Connect to the cluster at the address and read its nodes (↻); an error (no cluster
        there, a token it wants, Ray not installed) is kept for the panel to show."""
        from workbench.cluster.raytrain.session import connect, quiet

        self.reread.disabled = True
        try:
            ray = connect(self._address(), self.preset.namespace)
            with quiet(None, keep=False):
                self.nodes, self.error = ray.nodes(), ""
        except (ImportError, ValueError) as e:  # their messages say what to do
            self.nodes, self.error = None, str(e)
        except Exception as e:  # noqa: BLE001  (Ray's own errors: shown in the panel)
            self.nodes, self.error = None, f"Ray: the cluster couldn't be read: {e}"
        finally:
            self.reread.disabled = False
        for callback in self._on_read:
            callback()

    def _address(self) -> str | None:
        return self.address.value.strip() or None

    def spec(self) -> Ray:
        """The wb.Ray Launch submits: the controls' fields over the preset's. ValueError naming
        the field when they don't form one."""
        keep = {
            k: v
            for k, v in (self.preset.resources_per_worker or {}).items()
            if k not in ("CPU", "GPU")
        }
        gpus = float(self.gpus.value)
        per = {**keep, "CPU": float(self.cpus.value), **({"GPU": gpus} if gpus else {})}
        return dataclasses.replace(
            self.preset,
            address=self._address(),
            max_failures=int(self.max_failures.value),
            resources_per_worker=per,
            use_gpu=gpus > 0,
        )

    def target(self, gpu: str, catalog: str | None) -> RayTarget:
        """The plan: GPU workers of the catalog model `gpu`, or CPU workers."""
        from workbench.estimator.catalog import THIS_MACHINE

        gpus = float(self.gpus.value)
        return RayTarget(
            gpu=gpu if gpus else THIS_MACHINE,
            catalog=catalog,
            address=self.address.value.strip() or "auto",
            cpus_per_worker=float(self.cpus.value),
            gpus_per_worker=gpus,
        )

    def problem(self, cfg: RunConfig | None = None) -> str:
        """Why Launch can't submit ('' when it can): the cluster unreadable (after ↻), the fields,
        the workers against `cfg`, and what the cluster's nodes can place (after ↻)."""
        if self.error:
            return self.error
        try:
            spec = self.spec()
            if cfg is not None:
                check_run(cfg, spec)
                if self.nodes is not None:
                    check_placement(cfg, spec, self.nodes)
        except ValueError as e:
            return str(e)
        return ""

    def accelerator_type(self) -> str | None:
        """The GPU model the cluster's nodes report (Ray's accelerator_type:NAME resource), if
        read."""
        for node in self.nodes or []:
            for name in node.get("Resources", {}):
                if node.get("Alive") and name.startswith("accelerator_type:"):
                    return name.split(":", 1)[1]
        return None

    def info_html(self) -> str:
        """What the cluster has (after ↻), why it couldn't be read, or that it wasn't asked."""
        if self.error:
            return f"<small style='color:#b00020'>{html.escape(self.error)}</small>"
        if self.nodes is None:
            return (
                "<small>the cluster isn't asked until ↻ (it connects to it); Launch checks "
                "what its nodes can place</small>"
            )
        return f"<small>{html.escape(cluster_line(self.nodes))}</small>"


def cluster_line(nodes: list[dict[str, Any]]) -> str:
    """'2 alive nodes: 2 CPUs, 0 GPUs in all' from ray.nodes()."""
    alive = [n for n in nodes if n.get("Alive")]
    cpus = sum(float(n.get("Resources", {}).get("CPU", 0)) for n in alive)
    gpus = sum(float(n.get("Resources", {}).get("GPU", 0)) for n in alive)
    kinds = sorted(
        {
            name.split(":", 1)[1]
            for n in alive
            for name in n.get("Resources", {})
            if name.startswith("accelerator_type:")
        }
    )
    return (
        f"{len(alive)} alive node{'s' * (len(alive) != 1)}: {cpus:g} CPUs, {gpus:g} GPUs"
        + (f" ({', '.join(kinds)})" if kinds else "")
        + " in all"
    )


def driver_line(run: RayRun) -> str:
    """The status line's word on a run on Ray: its driver actor's state and where the ranks run,
    'Ray driver workbench-r-ab12 alive, 2 rank(s) on 2 node(s)'."""
    from workbench.cluster.raytrain.run import UNKNOWN

    state, why = run.driver()
    line = f"Ray driver {run.job.get('actor', '?')} {state.lower()}"
    if state == UNKNOWN:
        return f"{line} ({why})"
    placed = run.workers()
    if placed:
        nodes = len({w.get("node_id") for w in placed})
        line += f", {len(placed)} rank(s) on {nodes} node(s)"
    return line
