"""The panel's Slurm side of "where": the cluster's partitions as `sinfo` lists them (GPUs, cores,
idle nodes), the job's time limit and any other sbatch option in the CLI's `--slurm` words. The
nodes and GPUs (or ranks) per node are the target's controls (target_controls.py): one pair of
numbers plans the run and sizes the job."""

from __future__ import annotations

import html
from typing import Any

import ipywidgets as widgets

from workbench.cluster.slurm import Slurm, from_spec, minutes, partition_line, partitions

STYLE = {"description_width": "140px"}
OWN_CONTROLS = ("partition", "nodes", "gpus_per_node", "processes_per_node", "time")
"""Slurm fields the panel sets with a control of its own: the options box may not set them again."""


class SlurmControls:
    """Partition (read from sinfo, re-read with ↻), time limit and sbatch options; `slurm()` forms
    the Slurm."""

    def __init__(self, cluster: Slurm | None = None) -> None:
        self.preset = cluster
        self.found: dict[str, dict[str, Any]] = {}
        self.error = ""
        """Why the cluster can't be read ('' when sinfo answered)."""
        self.partition = widgets.Dropdown(
            options=[],
            description="partition",
            style=STYLE,
            layout=widgets.Layout(width="380px"),
            tooltip="the Slurm partition the job goes to (sinfo's)",
        )
        self.reread = widgets.Button(
            icon="refresh",
            tooltip="read the partitions from sinfo again (idle nodes change)",
            layout=widgets.Layout(width="36px"),
        )
        self.reread.on_click(lambda _button: self.read())
        self.time = widgets.Text(
            value=str(cluster.time if cluster else 60),
            description="time limit",
            style=STYLE,
            layout=widgets.Layout(width="260px"),
            tooltip="minutes, or Slurm's D-HH:MM:SS / HH:MM:SS / MM:SS",
        )
        self.options = widgets.Text(
            value=_options_text(cluster),
            description="sbatch options",
            style=STYLE,
            placeholder="account=proj,qos=high,setup=module load cuda",
            layout=widgets.Layout(width="520px"),
            tooltip="key=value, comma-separated, as `workbench train --slurm`: account, "
            "qos, mem, constraint, cpus_per_task, setup (lines split by ;), or any "
            "sbatch option (exclusive=true)",
        )
        self.info = widgets.HTML()
        for control, css in (
            (self.partition, "wb-partition"),
            (self.time, "wb-slurm-time"),
            (self.options, "wb-slurm-options"),
            (self.reread, "wb-slurm-reread"),
        ):
            control.add_class(css)
        self.widget = widgets.VBox(
            [widgets.HBox([self.partition, self.reread]), self.info, self.time, self.options]
        )
        self._on_read: list[Any] = []

    def read(self) -> None:
        """Ask sinfo for the partitions; an error (no sinfo, cluster down) is kept for the panel to
        show."""
        try:
            found, error = partitions(), ""
            if not found:
                error = "Slurm: `sinfo` lists no partition; is the cluster up (`scontrol ping`)?"
        except ValueError as e:
            found, error = {}, str(e)
        self.found, self.error = found, error
        keep = self.partition.value
        preset = self.preset.partition if self.preset else None
        default = next(
            (name for name, part in found.items() if part["default"]), next(iter(found), None)
        )
        value = next((v for v in (keep, preset, default) if v in found), None)
        self.partition.options = [
            (partition_line(name, part), name) for name, part in found.items()
        ]
        self.partition.value = value
        for callback in self._on_read:
            callback()

    def on_read(self, callback: Any) -> None:
        self._on_read.append(callback)

    @property
    def part(self) -> dict[str, Any] | None:
        """The chosen partition's sinfo record, or None."""
        return self.found.get(self.partition.value) if self.partition.value else None

    def problem(self) -> str:
        """Why no job can be formed ('' when one can): the cluster unread, the time limit or the
        options."""
        if self.error:
            return self.error
        if self.part is None:
            return "Slurm: choose a partition"
        try:
            minutes(self.time.value.strip())
            self._options()
        except ValueError as e:
            return str(e)
        return ""

    def _options(self) -> Slurm:
        extra = from_spec(self.options.value)
        keys = {item.partition("=")[0].strip() for item in self.options.value.split(",")}
        given = [name for name in OWN_CONTROLS if name in keys]
        if given:
            raise ValueError(
                f"sbatch options {self.options.value!r}: set {', '.join(given)} with the panel's "
                "own control, not in the options"
            )
        return extra

    def slurm(self, *, nodes: int, per_node: int) -> Slurm:
        """The job for the chosen partition: `nodes` x `per_node` GPUs (GPU partitions) or ranks
        (CPU ones)."""
        extra = self._options()
        part = self.part or {"gpus": 0}
        size = {"gpus_per_node": per_node} if part["gpus"] else {"processes_per_node": per_node}
        fields = {
            f: getattr(extra, f)
            for f in (
                "cpus_per_task",
                "mem",
                "account",
                "qos",
                "constraint",
                "setup",
                "job_name",
                "grace_s",
            )
        }
        time: str | int = self.time.value.strip()
        return Slurm(
            partition=self.partition.value,
            nodes=nodes,
            time=int(time) if time.isdigit() else time,
            extra=extra.extra,
            **size,
            **fields,
        )

    def info_html(self) -> str:
        if self.error:
            return f"<small style='color:#b00020'>{html.escape(self.error)}</small>"
        part = self.part
        if part is None:
            return ""
        wait = (
            "; no idle node: a job waits until nodes free up (Slurm says why)"
            if not part["idle"]
            else ""
        )
        return f"<small>{html.escape(partition_line(self.partition.value, part) + wait)}</small>"


def _options_text(cluster: Slurm | None) -> str:
    """A preset Slurm's other fields in the options box's words."""
    if cluster is None:
        return ""
    items = [
        f"{name}={getattr(cluster, name)}"
        for name in ("account", "qos", "mem", "constraint", "cpus_per_task", "job_name")
        if getattr(cluster, name) is not None
    ]
    if cluster.grace_s != Slurm().grace_s:
        items.append(f"grace_s={cluster.grace_s}")
    if cluster.setup:
        items.append("setup=" + ";".join(cluster.setup))
    items += [f"{key}={'true' if value is True else value}" for key, value in cluster.extra.items()]
    return ",".join(items)
