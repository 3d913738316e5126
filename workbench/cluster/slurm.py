"""`Slurm`: where a run goes on a Slurm cluster, checked against what the cluster says before
anything is submitted, and the submission itself through submitit (sbatch generation, one Slurm task
per rank, the rendezvous from the job's first node).

The run directory lives on the filesystem the nodes share and stays the only channel back: the ranks
write it as they do locally; slurm.json in it names the job, so a new kernel can attach to it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from workbench.config import RunConfig

COMMANDS = ("sbatch", "squeue", "sinfo", "scancel", "scontrol")
_TIME = re.compile(r"^(?:(\d+)-)?(?:(\d+):)?(\d+)(?::(\d+))?$")


@dataclass(frozen=True, kw_only=True)
class Slurm:
    """A Slurm cluster and the resources a run asks of it (`wb.start(cfg,
    cluster=wb.Slurm(...))`)."""

    partition: str | None = None
    """The partition (`sinfo` lists them); None: the cluster's default partition."""
    nodes: int = 1
    """Nodes the job spans."""
    gpus_per_node: int = 0
    """GPUs asked for on each node; 0 for a CPU run."""
    processes_per_node: int | None = None
    """Ranks (Slurm tasks) on each node; None: gpus_per_node, or the run's processes over the nodes
    on CPU."""
    cpus_per_task: int | None = None
    """CPU cores for each rank; None: Slurm's default (one)."""
    mem: str | None = None
    """Memory per node, in Slurm's words ('64G'); None: the partition's default."""
    time: str | int = 60
    """The time limit: minutes, or Slurm's 'D-HH:MM:SS' / 'HH:MM:SS' / 'MM:SS'."""
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    """Node features the job needs (`--constraint`)."""
    setup: tuple[str, ...] = ()
    """Shell lines run in the batch script before the ranks start (module load ..., source
    venv/bin/activate)."""
    extra: dict[str, str | int | bool] = field(default_factory=dict)
    """Any other sbatch option, by its long name without dashes; True for a flag ({'hold': True,
    'mail-type': 'END'})."""
    job_name: str | None = None
    """The job's name in squeue; None: 'workbench-<run name>'."""
    grace_s: int = 120
    """Seconds before the time limit at which Slurm warns the ranks (SIGUSR2): they checkpoint, and
    the job is requeued to resume while the run's max_restarts allows."""

    def __post_init__(self) -> None:
        if not isinstance(self.nodes, int) or self.nodes < 1:
            raise ValueError(f"Slurm nodes={self.nodes!r}: a whole number of at least 1")
        for name in ("gpus_per_node", "grace_s"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(
                    f"Slurm {name}={getattr(self, name)!r}: a whole number, 0 for no GPU"
                )
        for name in ("processes_per_node", "cpus_per_task"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"Slurm {name}={value!r}: a whole number of at least 1, or None")
        minutes(self.time)
        if isinstance(self.setup, str):
            raise ValueError(
                f"Slurm setup={self.setup!r}: a list of shell lines, e.g. [{self.setup!r}]"
            )
        object.__setattr__(self, "setup", tuple(self.setup))

    @property
    def minutes(self) -> int:
        return minutes(self.time)

    def per_node(self, cfg: RunConfig) -> int:
        """Ranks on each node for `cfg`."""
        if self.processes_per_node is not None:
            return self.processes_per_node
        if self.gpus_per_node:
            return self.gpus_per_node
        return max(1, cfg.num_processes // self.nodes)


_INTS = ("nodes", "gpus_per_node", "processes_per_node", "cpus_per_task", "grace_s")


def from_spec(spec: str) -> Slurm:
    """A Slurm from the CLI's `--slurm partition=gpu,nodes=2,gpus_per_node=8` (any other key=value
    is an sbatch option: `exclusive=true` for a flag); ValueError naming the item that isn't
    key=value or a number."""
    fields: dict[str, Any] = {}
    extra: dict[str, str | int | bool] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(
                f"--slurm {item!r}: write key=value, e.g. partition=gpu,nodes=2,gpus_per_node=8"
            )
        if key in _INTS:
            if not value.strip().isdigit():
                raise ValueError(f"--slurm {key}={value!r}: a whole number")
            fields[key] = int(value)
        elif key in ("partition", "mem", "time", "account", "qos", "constraint", "job_name"):
            fields[key] = value.strip()
        elif key == "setup":
            fields[key] = tuple(line.strip() for line in value.split(";") if line.strip())
        else:
            extra[key.replace("_", "-")] = (
                True if value.strip().lower() == "true" else value.strip()
            )
    return Slurm(**fields, extra=extra)


def minutes(time: str | int) -> int:
    """A Slurm time limit in whole minutes (at least 1). ValueError naming the format otherwise."""
    if isinstance(time, bool) or not isinstance(time, (int, str)):
        raise ValueError(f"Slurm time={time!r}: minutes, or 'D-HH:MM:SS' / 'HH:MM:SS' / 'MM:SS'")
    if isinstance(time, int):
        if time < 1:
            raise ValueError(f"Slurm time={time!r}: at least 1 minute")
        return time
    match = _TIME.match(time.strip())
    if not match:
        raise ValueError(f"Slurm time={time!r}: minutes, or 'D-HH:MM:SS' / 'HH:MM:SS' / 'MM:SS'")
    days, first, second, third = match.groups()
    if third is not None:  # H:M:S
        total_s = int(first) * 3600 + int(second) * 60 + int(third)
    elif first is not None:  # D-H:M (with days) or M:S
        total_s = int(first) * 3600 + int(second) * 60 if days else int(first) * 60 + int(second)
    else:
        total_s = int(second) * (3600 if days else 60)
    total_s += int(days or 0) * 86400
    return max(1, -(-total_s // 60))


def slurm_command(name: str) -> str:
    """The path of a Slurm command, or ValueError saying it isn't there and what to do."""
    path = shutil.which(name)
    if path is None:
        raise ValueError(
            f"Slurm: `{name}` is not on PATH here ({os.environ.get('PATH', '')[:200]}); run from a "
            "machine that can submit to the cluster (a login node), or install Slurm's client "
            "commands and its configuration here"
        )
    return path


def partitions() -> dict[str, dict[str, Any]]:
    """The cluster's partitions, from `sinfo`: name -> nodes, CPUs per node, GPUs per node, the
    GPUs' type as GRES names it ('' when untyped), idle nodes, default."""
    out = _run([slurm_command("sinfo"), "-h", "-o", "%P|%D|%c|%G|%t"])
    found: dict[str, dict[str, Any]] = {}
    for line in out.splitlines():
        name, nodes, cpus, gres, state = (line.split("|") + [""] * 5)[:5]
        default = name.endswith("*")
        name = name.rstrip("*")
        rec = found.setdefault(
            name, {"nodes": 0, "cpus": 0, "gpus": 0, "gpu_type": "", "idle": 0, "default": default}
        )
        count = int(nodes or 0)
        rec["nodes"] += count
        rec["cpus"] = max(rec["cpus"], int(re.sub(r"\D", "", cpus) or 0))
        gpus, gpu_type = _gpus(gres)
        if gpus > rec["gpus"]:
            rec["gpus"], rec["gpu_type"] = gpus, gpu_type
        rec["idle"] += count if state.startswith("idle") else 0
    return found


def _gpus(gres: str) -> tuple[int, str]:
    """GPUs per node and their type in sinfo's GRES column ('gpu:8', 'gpu:h100:8(S:0-1)',
    '(null)')."""
    match = re.search(r"gpu(?::([^:,(]+))?:(\d+)", gres)
    return (int(match.group(2)), match.group(1) or "") if match else (0, "")


def partition_line(name: str, part: dict[str, Any]) -> str:
    """One line for a partition: 'gpu: 4 nodes (2 idle), 8 x h100 GPUs and 64 CPUs per node'."""
    gpus = (
        (
            f"{part['gpus']} x {part['gpu_type']} GPUs"
            if part["gpu_type"]
            else f"{part['gpus']} GPUs"
        )
        if part["gpus"]
        else "no GPU"
    )
    default = " (default)" if part["default"] else ""
    return (
        f"{name}{default}: {part['nodes']} node{'s' * (part['nodes'] != 1)} ({part['idle']} idle), "
        f"{gpus} and {part['cpus']} CPUs per node"
    )


def _run(cmd: list[str]) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    if done.returncode != 0:
        raise ValueError(
            f"Slurm: `{' '.join(cmd)}` failed (exit {done.returncode}): "
            f"{(done.stderr or done.stdout).strip()[-500:]}"
        )
    return done.stdout


def check(cfg: RunConfig, slurm: Slurm) -> str:
    """Refuse, before anything is submitted, what this cluster can't run: a missing command, an
    unknown partition, more nodes or GPUs per node than it has, a world size that isn't nodes x
    ranks per node. Returns the partition the job goes to."""
    name = check_cluster(slurm)
    world = slurm.nodes * slurm.per_node(cfg)
    if cfg.num_processes != world:
        raise ValueError(
            f"num_processes={cfg.num_processes}: the job runs {slurm.nodes} node(s) x "
            f"{slurm.per_node(cfg)} rank(s) = {world}; set num_processes={world}, or change the "
            "nodes or processes_per_node"
        )
    if slurm.gpus_per_node == 0 and cfg.device == "cuda":
        raise ValueError(
            "device='cuda' with Slurm gpus_per_node=0: ask for GPUs (gpus_per_node=...) or set "
            "device='cpu'"
        )
    check_shared_folder(cfg.runs_dir)  # last: it creates the folder
    return name


def check_shared_folder(runs_dir: str) -> None:
    """The run directory is the only channel back from the nodes: its folder must take files before
    a job is submitted (created if missing, a probe file written and removed). ValueError with the
    fix otherwise."""
    folder = Path(runs_dir).expanduser()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".wb-probe-"):
            pass
    except OSError as e:
        raise ValueError(
            f"runs_dir={runs_dir!r}: can't write there ({e.strerror or e}); a cluster run's "
            "directory is the only channel back from its nodes: set runs_dir to a writable folder "
            "on the filesystem the nodes share (e.g. ~/runs or /scratch/$USER/runs)"
        ) from e


def check_cluster(slurm: Slurm) -> str:
    """The cluster's side of check(): its commands, the partition, nodes and GPUs per node. Returns
    the partition."""
    for name in COMMANDS:
        slurm_command(name)
    known = partitions()
    if not known:
        raise ValueError("Slurm: `sinfo` lists no partition; is the cluster up (`scontrol ping`)?")
    name = slurm.partition or next(
        (p for p, rec in known.items() if rec["default"]), next(iter(known))
    )
    if name not in known:
        raise ValueError(
            f"Slurm partition={slurm.partition!r}: not a partition of this cluster (sinfo lists "
            f"{', '.join(sorted(known))}); choose one of those"
        )
    part = known[name]
    if slurm.nodes > part["nodes"]:
        raise ValueError(
            f"Slurm nodes={slurm.nodes}: partition {name!r} has {part['nodes']} node(s); ask for "
            "at most that many, or another partition"
        )
    if slurm.gpus_per_node > part["gpus"]:
        raise ValueError(
            f"Slurm gpus_per_node={slurm.gpus_per_node}: partition {name!r} has "
            f"{part['gpus']} GPU(s) per node (sinfo's GRES); ask for at most that many"
        )
    return name


def executor_parameters(
    slurm: Slurm,
    partition: str,
    *,
    job_name: str,
    nodes: int,
    tasks_per_node: int,
    requeue: bool = False,
) -> dict[str, Any]:
    """submitit's SlurmExecutor parameters for a job of `nodes` x `tasks_per_node` tasks asking what
    `slurm` asks; `requeue`: the job may be requeued (--requeue)."""
    params: dict[str, Any] = {
        "job_name": slurm.job_name or job_name,
        "partition": partition,
        "nodes": nodes,
        "ntasks_per_node": tasks_per_node,
        "time": slurm.minutes,
        "setup": list(slurm.setup),
    }
    if slurm.gpus_per_node:
        params["gpus_per_node"] = slurm.gpus_per_node
    optional = {
        "cpus_per_task": slurm.cpus_per_task,
        "mem": slurm.mem,
        "account": slurm.account,
        "qos": slurm.qos,
        "constraint": slurm.constraint,
    }
    params.update({k: v for k, v in optional.items() if v is not None})
    extra = {**({"requeue": True} if requeue else {}), **slurm.extra}
    if extra:
        params["additional_parameters"] = extra
    return params


def python_for_jobs() -> str:
    """The interpreter the job runs: this one (the nodes share its filesystem, as they share the run
    directory)."""
    return sys.executable
