"""The panel's "where" on a Slurm cluster, planning side: the partitions come from `sinfo` (here a stand-in
script on PATH that prints what sinfo prints for GPU partitions this machine doesn't have), and the target the
checks and the estimate use is the partition's GPUs. Submitting from the panel to a real cluster is tested in
test_slurm.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import workbench as wb

SINFO = [
    "gpu*|3|64|gpu:h100:8(S:0-1)|idle",
    "gpu*|1|64|gpu:h100:8(S:0-1)|mixed",
    "a100|2|32|gpu:a100_80g:4|alloc",
    "cpu|10|128|(null)|idle",
]


@pytest.fixture
def sinfo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An `sinfo` on PATH that answers `sinfo -h -o %P|%D|%c|%G|%t` with SINFO's lines."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "sinfo"
    script.write_text("#!/bin/sh\nprintf '%s\\n' " + " ".join(f"'{line}'" for line in SINFO) + "\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return script


def gpt(runs_dir: Path) -> wb.RunConfig:
    return wb.RunConfig(
        task="char-gpt",
        num_processes=2,
        micro_batch_size=8,
        max_steps=10,
        runs_dir=str(runs_dir),
        task_options={"preset": "tiny"},
    )


def test_the_partitions_come_from_sinfo_with_their_gpus_and_idle_nodes(
    sinfo: Path, runs_dir: Path
) -> None:
    panel = wb.Panel(gpt(runs_dir), display=False, estimate=False)
    t = panel.target_controls
    assert t.slurm.widget.layout.display == "none", "Slurm's controls show only when it is chosen"
    t.where.value = "slurm"
    assert [label for label, _ in t.slurm.partition.options] == [
        "gpu (default): 4 nodes (3 idle), 8 x h100 GPUs and 64 CPUs per node",
        "a100: 2 nodes (0 idle), 4 x a100_80g GPUs and 32 CPUs per node",
        "cpu: 10 nodes (10 idle), no GPU and 128 CPUs per node",
    ]
    assert t.slurm.partition.value == "gpu" and t.slurm.widget.layout.display is None
    assert t.gpu.value == "H100-SXM-80GB" and "this-machine" not in dict(t.gpu.options).values()
    assert (t.gpus_per_node.max, t.nodes.max) == (8, 4), "sizes bounded by what the partition has"
    t.slurm.partition.value = "a100"
    assert t.gpu.value == "A100-SXM-80GB", "GRES type a100_80g is the catalog's A100"
    assert "no idle node: a job waits" in t.slurm.info.value


def test_the_plan_and_the_estimate_are_for_the_partitions_gpus(sinfo: Path, runs_dir: Path) -> None:
    panel = wb.Panel(gpt(runs_dir), display=False)
    t, c = panel.target_controls, panel.controls
    t.where.value = "slurm"
    t.nodes.value = 2
    assert c["num_processes"].value == 16, "processes = nodes x GPUs per node"
    assert panel.state.problem == "" and not panel.launch_button.disabled, panel.state.problem
    assert (
        "Launch submits a Slurm job: 2 x 8 x H100-SXM-80GB on Slurm partition gpu"
        in panel.launch_info.value
    )
    c["precision"].value = "bf16"  # the partition's GPUs run it, whatever this box has
    assert panel.state.problem == ""
    panel.estimate_box.wait(timeout=100)
    est = panel.estimate_box.state.result
    assert est is not None and est.target.name == "H100-SXM-80GB" and len(est.ranks) == 16
    assert (est.gpus, est.nodes) == (8, 2)

    t.slurm.partition.value = "cpu"
    assert t.gpu.layout.display == "none" and t.gpus_per_node.description == "ranks per node"
    assert "unavailable" in {v: k for k, v in c["precision"].options}["fp16"], (
        "CPU nodes can't run fp16"
    )
    c["precision"].value = "fp32"
    t.gpus_per_node.value = 1
    assert c["num_processes"].value == 2 and panel.state.problem == ""
    assert "2 nodes (128 cores each) x 1 CPU rank on Slurm partition cpu" in panel.launch_info.value
    panel.estimate_box.wait(timeout=100)
    est = panel.estimate_box.state.result
    assert est is not None and est.target.kind == "cpu" and "Slurm partition cpu" in est.where
    assert any("CPU nodes, priced as this machine's" in a for a in est.assumptions)
    job = t.cluster()
    assert job is not None and (
        job.partition,
        job.nodes,
        job.processes_per_node,
        job.gpus_per_node,
    ) == ("cpu", 2, 1, 0)


def test_the_job_options_are_the_clis_words_and_own_fields_are_refused(
    sinfo: Path, runs_dir: Path
) -> None:
    panel = wb.Panel(
        gpt(runs_dir),
        display=False,
        estimate=False,
        cluster=wb.Slurm(
            partition="a100", nodes=2, gpus_per_node=1, account="proj", time="2:00:00"
        ),
    )
    t = panel.target_controls
    assert t.where.value == "slurm" and t.slurm.partition.value == "a100"
    assert (t.nodes.value, t.gpus_per_node.value, panel.controls["num_processes"].value) == (
        2,
        1,
        2,
    )
    assert t.slurm.options.value == "account=proj" and t.slurm.time.value == "2:00:00"
    t.slurm.options.value = (
        "qos=high,setup=module load cuda;source venv/bin/activate,exclusive=true"
    )
    job = t.cluster()
    assert job is not None and job.qos == "high" and job.extra == {"exclusive": True}
    assert job.setup == ("module load cuda", "source venv/bin/activate") and job.minutes == 120
    t.slurm.options.value = "nodes=3"
    assert panel.launch_button.disabled
    assert "sbatch options 'nodes=3': set nodes with the panel's own control" in panel.state.problem
    t.slurm.options.value = ""
    t.slurm.time.value = "soon"
    assert (
        "Slurm time='soon': minutes, or 'D-HH:MM:SS'" in panel.state.problem
        and panel.launch_button.disabled
    )


def test_without_slurm_commands_the_choice_says_so_and_launch_stays_off(
    runs_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(runs_dir))  # no sinfo anywhere
    panel = wb.Panel(gpt(runs_dir), display=False, estimate=False)
    panel.target_controls.where.value = "slurm"
    assert "`sinfo` is not on PATH here" in panel.state.problem and panel.launch_button.disabled
    assert "a login node" in panel.target_controls.slurm.info.value
    with pytest.raises(ValueError, match="`sinfo` is not on PATH here"):
        panel.launch()
    panel.target_controls.where.value = "here"
    assert panel.state.problem == "" and panel.target.local
