"""`Ray`: where a run goes on a Ray cluster, and the checks of a run against what the cluster has
(its alive nodes and their resources), made before anything is submitted."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from workbench.config import RunConfig

PlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass(frozen=True, kw_only=True)
class Ray:
    """A Ray cluster and what a run asks of it (`wb.start(cfg, cluster=wb.Ray(...))`): the ranks run
    as Ray Train workers (TorchTrainer), one rank each."""

    address: str | None = None
    """The cluster: 'host:port' of its head (the GCS, 6379 unless `ray start` said otherwise), or
    'auto'/None: $RAY_ADDRESS, else the cluster `ray start` brought up on this machine. Never a new
    cluster of its own: with no cluster there the run is refused."""
    workers: int | None = None
    """Ray Train workers, one rank each; None: the run's num_processes (they must agree)."""
    resources_per_worker: dict[str, float] | None = None
    """Ray resources each worker holds ({'CPU': 8, 'GPU': 1}, custom ones too); None: one CPU, and
    one GPU when use_gpu."""
    use_gpu: bool | None = None
    """Each worker gets a GPU; None: when the run's device is 'cuda', or it is 'auto' and the
    cluster has GPUs."""
    runtime_env: dict[str, Any] | None = None
    """Ray's runtime environment for the run's actors and workers (env_vars, working_dir, pip,
    ...)."""
    max_failures: int = 0
    """Worker-group failures Ray recovers from: it restarts the workers and the run resumes from its
    last complete checkpoint. -1: without limit. A failure past the limit fails the run, named."""
    placement_strategy: PlacementStrategy = "PACK"
    """How Ray places the workers on nodes (its placement group strategy): PACK fills nodes in
    turn, SPREAD spreads them, STRICT_SPREAD one worker per node."""
    namespace: str = "workbench"
    """The Ray namespace of the run's driver actor (wb.attach finds it by name there)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables for the ranks (beside runtime_env's env_vars, which Ray applies to the
    whole actor)."""

    def __post_init__(self) -> None:
        if self.workers is not None and (
            isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1
        ):
            raise ValueError(
                f"Ray workers={self.workers!r}: a whole number of at least 1, or None for the "
                "run's num_processes"
            )
        if (
            isinstance(self.max_failures, bool)
            or not isinstance(self.max_failures, int)
            or self.max_failures < -1
        ):
            raise ValueError(
                f"Ray max_failures={self.max_failures!r}: a whole number, 0 for none, -1 for no "
                "limit"
            )
        if self.placement_strategy not in _STRATEGIES:
            raise ValueError(
                f"Ray placement_strategy={self.placement_strategy!r}: one of "
                f"{', '.join(_STRATEGIES)}"
            )
        if self.use_gpu not in (None, True, False):
            raise ValueError(f"Ray use_gpu={self.use_gpu!r}: True, False or None")
        if self.resources_per_worker is not None:
            if not isinstance(self.resources_per_worker, dict) or not self.resources_per_worker:
                raise ValueError(
                    f"Ray resources_per_worker={self.resources_per_worker!r}: a dict of resource "
                    "-> amount, e.g. {'CPU': 4, 'GPU': 1}"
                )
            for name, amount in self.resources_per_worker.items():
                if (
                    isinstance(amount, bool)
                    or not isinstance(amount, (int, float))
                    or not amount >= 0
                    or math.isinf(amount)
                ):
                    raise ValueError(
                        f"Ray resources_per_worker[{name!r}]={amount!r}: a number of at least 0"
                    )
            if self.use_gpu is False and self.resources_per_worker.get("GPU"):
                raise ValueError(
                    f"Ray use_gpu=False with resources_per_worker={self.resources_per_worker!r}: "
                    "drop 'GPU' from the resources, or set use_gpu=True"
                )
        if self.runtime_env is not None and not isinstance(self.runtime_env, dict):
            raise ValueError(
                f"Ray runtime_env={self.runtime_env!r}: a dict, e.g. "
                "{'env_vars': {'HF_HOME': '/shared/hf'}}"
            )
        object.__setattr__(self, "env", {str(k): str(v) for k, v in dict(self.env).items()})

    def world(self, cfg: RunConfig) -> int:
        """The workers the run asks for: `workers`, or the run's processes."""
        return self.workers if self.workers is not None else cfg.num_processes

    def gpu(self, cfg: RunConfig, cluster_gpus: float = 0.0) -> bool:
        """Whether each worker gets a GPU, for `cfg` on a cluster of `cluster_gpus` GPUs in all."""
        if self.use_gpu is not None:
            return self.use_gpu
        if self.resources_per_worker and self.resources_per_worker.get("GPU"):
            return True
        if cfg.device == "auto":
            return cluster_gpus > 0
        return cfg.device == "cuda"

    def per_worker(self, use_gpu: bool) -> dict[str, float]:
        """The resources each worker holds."""
        found = dict(self.resources_per_worker or {"CPU": 1.0})
        if use_gpu:
            found.setdefault("GPU", 1.0)
        return {k: float(v) for k, v in found.items()}


_FIELDS = {
    "address": str,
    "workers": int,
    "use_gpu": bool,
    "max_failures": int,
    "placement_strategy": str,
    "namespace": str,
}


def from_spec(spec: str) -> Ray:
    """A Ray from the CLI's `--ray address=10.0.0.1:6379,workers=8,use_gpu=true,max_failures=2`;
    resources_per_worker as 'CPU:8;GPU:1'. ValueError naming an item that isn't key=value, or a key
    that isn't one of Ray's fields."""
    fields: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        key, sep, value = (s.strip() for s in item.partition("="))
        if not sep or not key:
            raise ValueError(
                f"--ray {item!r}: write key=value, e.g. address=10.0.0.1:6379,max_failures=1"
            )
        if key == "resources_per_worker":
            fields[key] = _resources(value)
        elif key not in _FIELDS:
            known = ", ".join([*_FIELDS, "resources_per_worker"])
            raise ValueError(f"--ray {key}={value!r}: not a field of wb.Ray; use one of {known}")
        elif _FIELDS[key] is int:
            try:
                fields[key] = int(value)
            except ValueError:
                raise ValueError(f"--ray {key}={value!r}: a whole number") from None
        elif _FIELDS[key] is bool:
            if value.lower() not in ("true", "false"):
                raise ValueError(f"--ray {key}={value!r}: true or false")
            fields[key] = value.lower() == "true"
        else:
            fields[key] = value
    return Ray(**fields)


def _resources(text: str) -> dict[str, float]:
    found: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, sep, amount = (s.strip() for s in part.partition(":"))
        try:
            found[name] = float(amount)
        except ValueError:
            sep = ""
        if not sep or not name:
            raise ValueError(
                f"--ray resources_per_worker={text!r}: write NAME:AMOUNT;NAME:AMOUNT, e.g. "
                "CPU:8;GPU:1"
            )
    return found


def check_run(cfg: RunConfig, ray: Ray) -> None:
    """What can be refused without asking the cluster: the workers against the run's processes, a
    GPU asked for against the run's device."""
    if ray.workers is not None and ray.workers != cfg.num_processes:
        raise ValueError(
            f"Ray workers={ray.workers} with num_processes={cfg.num_processes}: each worker is one "
            f"rank; set num_processes={ray.workers}, or workers={cfg.num_processes} (or leave "
            "workers None)"
        )
    if cfg.max_restarts:
        raise ValueError(
            f"max_restarts={cfg.max_restarts}: on Ray, Ray restarts the workers; set "
            f"wb.Ray(max_failures={cfg.max_restarts}) and max_restarts=0"
        )
    if ray.use_gpu is False and cfg.device == "cuda":
        raise ValueError(
            "device='cuda' with Ray use_gpu=False: the workers would hold no GPU; set use_gpu=True "
            "(or None) or device='cpu'"
        )
    if ray.use_gpu and cfg.device == "cpu":
        raise ValueError(
            "Ray use_gpu=True with device='cpu': the run would hold GPUs it doesn't use; set "
            "device='cuda' (or 'auto'), or use_gpu=False"
        )


def check_placement(cfg: RunConfig, ray: Ray, nodes: list[dict[str, Any]]) -> dict[str, Any]:
    """Refuse a run the cluster's alive nodes can't place (totals, not what is free now: workers
    waiting for busy resources wait, as Ray makes them). `nodes`: ray.nodes(). Returns the plan:
    world size, whether workers use GPUs, resources per worker, workers that fit on each node."""
    alive = [n for n in nodes if n.get("Alive")]
    if not alive:
        raise ValueError("Ray: the cluster has no alive node; is it up (`ray status`)?")
    cluster_gpus = sum(float(n.get("Resources", {}).get("GPU", 0)) for n in alive)
    use_gpu = ray.gpu(cfg, cluster_gpus)
    need = ray.per_worker(use_gpu)
    world = ray.world(cfg)
    fits = {str(n.get("NodeManagerAddress")): _fits(n.get("Resources", {}), need) for n in alive}
    where = ", ".join(f"{addr}: {count}" for addr, count in fits.items())
    asked = ", ".join(f"{k} {v:g}" for k, v in need.items())
    if use_gpu and cluster_gpus == 0:
        raise ValueError(
            "Ray: the run asks each worker for a GPU, but no node of the cluster has one; set "
            "use_gpu=False and device='cpu', or connect to a cluster with GPU nodes"
        )
    if ray.placement_strategy == "STRICT_PACK":
        placeable = max(fits.values())
    elif ray.placement_strategy == "STRICT_SPREAD":
        placeable = sum(1 for count in fits.values() if count)
    else:
        placeable = sum(fits.values())
    if placeable < world:
        raise ValueError(
            f"Ray: {world} worker(s) of {asked} each can't be placed "
            f"({ray.placement_strategy}): the cluster's {len(alive)} alive node(s) fit "
            f"{where}; ask for fewer resources_per_worker or workers, another "
            "placement_strategy, or add nodes"
        )
    return {"world": world, "use_gpu": use_gpu, "per_worker": need, "fits": fits}


def _fits(resources: dict[str, float], need: dict[str, float]) -> int:
    counts = [
        int(float(resources.get(name, 0)) // amount) for name, amount in need.items() if amount > 0
    ]
    return min(counts) if counts else 10**6
