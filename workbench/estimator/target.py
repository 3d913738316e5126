"""Where a run is planned to go: this machine, a catalog accelerator x GPUs per node x nodes, or a
Slurm partition's nodes. A plan is checked against its target's devices, not against the box the
notebook sits on: 8 processes, fp16 and hsdp 2 x 4 are a valid plan for 8 x H100 on a 2-core laptop,
and only launching it here is refused (a Slurm target is launched by submitting it)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

from workbench.estimator.catalog import THIS_MACHINE, Accelerator, load_catalog, lookup
from workbench.utils.hardware import GPU, Hardware, detect

if TYPE_CHECKING:
    from workbench.config import RunConfig
    from workbench.tasks import Task


@dataclass(frozen=True, kw_only=True)
class Target:
    """The hardware a run is planned for."""

    gpu: str = THIS_MACHINE
    """A catalog accelerator ('H100-SXM-80GB'; see workbench.estimator.load_catalog()), or
    'this-machine'."""
    gpus_per_node: int = 0
    """Devices per node; 0 on this machine means as many as the run has processes."""
    nodes: int = 1
    """Machines the run spans."""
    catalog: str | None = None
    """A YAML file of extra accelerators (as WORKBENCH_ACCELERATORS), or None."""
    partition: str | None = None
    """The Slurm partition the run is submitted to, or None. With gpu 'this-machine' the partition's
    nodes are CPU nodes taken to be like this one (gpus_per_node then counts ranks per node)."""
    cpus_per_node: int = 0
    """A Slurm CPU partition's cores per node (sinfo's); 0: as this machine has."""

    def __post_init__(self) -> None:
        if self.gpus_per_node < 0 or self.nodes < 1:
            raise ValueError(
                f"target {self.gpu}: gpus_per_node={self.gpus_per_node}, nodes={self.nodes}: use "
                "at least 1 GPU per node (0: as many as processes, on this machine) and 1 node"
            )
        if self.local and self.nodes != 1:
            raise ValueError(
                f"target this machine with nodes={self.nodes}: this machine is one node; pick a "
                "catalog accelerator to plan for several nodes"
            )
        if not self.cpu_nodes:
            self.accelerator()  # an unknown name is refused now, with the catalog's names

    @property
    def local(self) -> bool:
        """The run goes to this machine's own devices (launched here)."""
        return self.gpu == THIS_MACHINE and self.partition is None

    @property
    def cpu_nodes(self) -> bool:
        """The devices are CPUs like this machine's: this machine, or a Slurm CPU partition."""
        return self.gpu == THIS_MACHINE

    @property
    def launchable(self) -> bool:
        """Launch can start it from here: on this machine, or by submitting it to its Slurm
        partition."""
        return self.local or self.partition is not None

    def accelerator(self) -> Accelerator:
        return lookup(self.gpu, load_catalog(self.catalog) if not self.local else None)

    def world(self, cfg: RunConfig) -> int:
        """Ranks of the run on this target: GPUs per node x nodes (on this machine: the run's
        processes)."""
        return (self.gpus_per_node or cfg.num_processes) * self.nodes

    def describe(self, cfg: RunConfig | None = None) -> str:
        """Where the run goes, in words: 'this machine', or e.g. '2 x 4 x H100-SXM-80GB' (nodes x
        GPUs per node x accelerator)."""
        if self.local:
            return "this machine"
        per_node = self.gpus_per_node or (cfg.num_processes if cfg else 0)
        nodes = f"{self.nodes} x " if self.nodes > 1 else ""
        if self.cpu_nodes:
            cores = f" ({self.cpus_per_node} cores each)" if self.cpus_per_node else ""
            ranks = f"{per_node} CPU rank" + "s" * (per_node != 1)
            return (
                f"{self.nodes} node{'s' * (self.nodes != 1)}{cores} x {ranks} on Slurm "
                f"partition {self.partition}"
            )
        where = f" on Slurm partition {self.partition}" if self.partition else ""
        return f"{nodes}{per_node} x {self.gpu}{where}"

    def hardware(self, cfg: RunConfig) -> Hardware:
        """The devices checks run against: this machine's, a CPU partition's nodes, or the target's
        GPUs as the catalog describes them."""
        if self.local:
            return detect()
        if self.cpu_nodes:
            return Hardware(
                cpu_count=self.cpus_per_node or detect().cpu_count,
                nodes=self.nodes,
                planned=self.describe(cfg),
            )
        accel = self.accelerator()
        # what the catalog lists a peak for is what the device runs natively (bf16 from 8.0, fp8
        # from 8.9)
        capability = (8, 9) if accel.peak("fp8") else (8, 0) if accel.peak("bf16") else (7, 0)
        per_node = self.gpus_per_node or cfg.num_processes
        gpu = GPU(name=accel.name, compute_capability=capability, memory_bytes=accel.memory_bytes)
        return Hardware(
            cpu_count=16 * per_node,
            gpus=(gpu,) * per_node,
            nodes=self.nodes,
            planned=self.describe(cfg),
        )


def check_plan(cfg: RunConfig, target: Target, task: Task | None = None) -> list[str]:
    """preflight() against the target's devices: ValueError naming the field when the plan can't run
    there. Returns the warnings it gave (e.g. ranks sharing cores), for the estimate to state."""
    from workbench.config.preflight import preflight

    problems = _target_problems(cfg, target)
    if problems:
        raise ValueError(problems[0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        preflight(
            cfg.replace(device="auto") if not target.cpu_nodes else cfg,
            task=task,
            hardware=target.hardware(cfg),
        )
    return [str(w.message) for w in caught]


def plan_problems(cfg: RunConfig, target: Target, task: Task | None = None) -> list[str]:
    """Every refusal check_plan() would give, not only the first ([] when the plan can run): the
    panel lists them at once. Warnings are check_plan's to return."""
    from workbench.config.preflight import preflight_problems

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _target_problems(cfg, target) + preflight_problems(
            cfg.replace(device="auto") if not target.cpu_nodes else cfg,
            task=task,
            hardware=target.hardware(cfg),
        )


def _target_problems(cfg: RunConfig, target: Target) -> list[str]:
    """The config against the target's kind of device and its rank count."""
    problems = []
    if not target.cpu_nodes and cfg.device == "cpu":
        problems.append(
            f"device='cpu' with target {target.describe(cfg)}: the target's devices are GPUs; use "
            "device='auto' (or 'cuda'), or set the target to this machine"
        )
    world = target.world(cfg)
    if cfg.num_processes != world:
        unit = "rank" if target.cpu_nodes else "GPU"
        problems.append(
            f"num_processes={cfg.num_processes} with target {target.describe(cfg)}: the target has "
            f"{world} {unit}(s) in all; use num_processes={world}, or change the target's {unit}s "
            "per node or nodes"
        )
    return problems


def check_here(cfg: RunConfig, target: Target) -> None:
    """A plan for another target can't be launched on this machine: say so, and what to do
    instead."""
    if target.launchable:
        return
    here = detect()
    raise ValueError(
        f"this run is planned for {target.describe(cfg)}; this machine has "
        f"{here.device_line('cuda' if here.has_cuda else 'cpu')}, so it can't be launched here: "
        "set the target to 'this machine' (and the processes it has) to run here, or save the "
        "config as YAML and run `workbench train run.yaml` on a machine with "
        f"{target.describe(cfg)}"
    )
