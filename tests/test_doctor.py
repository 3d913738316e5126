"""`workbench doctor`: topology parsing, environment pitfalls, a real all-reduce sweep under a deadline, and the
CLI's JSON report with every section."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest

import workbench.commands.doctor.allreduce as allreduce
import workbench.commands.doctor.checkup as report_module
from workbench.cli import main
from workbench.commands.doctor import (
    SECTIONS,
    Finding,
    bus_factor,
    env_pitfalls,
    parse_topo_matrix,
    run_doctor,
    run_sweep,
)
from workbench.commands.doctor.findings import Section
from workbench.commands.doctor.topology import add_topology, describe_link
from workbench.config import RunConfig

FIXTURE = Path(__file__).parent / "fixtures" / "doctor" / "nvidia-smi-topo-4x-a100-nvlink.txt"
KiB = 1024


def _assert_no_rank_left() -> None:
    deadline = time.monotonic() + 5
    while mp.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert mp.active_children() == []


# ---- topology ------------------------------------------------------------------------------------
def test_topology_parses_a_4_gpu_nvlink_matrix() -> None:
    topo = parse_topo_matrix(FIXTURE.read_text())
    assert topo.gpus == ["GPU0", "GPU1", "GPU2", "GPU3"]
    assert topo.devices == [*topo.gpus, "NIC0", "NIC1"]  # the terminal underline codes are stripped
    assert [link for _, _, link in topo.gpu_pairs()] == ["NV4"] * 6
    assert topo.links[("GPU0", "GPU0")] == "X" and topo.links[("GPU2", "NIC1")] == "PXB"
    assert topo.cpu_affinity == {
        "GPU0": "0-31,64-95",
        "GPU1": "0-31,64-95",
        "GPU2": "32-63,96-127",
        "GPU3": "32-63,96-127",
    }
    assert topo.numa_affinity == {"GPU0": "0", "GPU1": "0", "GPU2": "1", "GPU3": "1"}
    section = Section("devices", "Devices")
    add_topology(section, topo)
    assert "GPU0 <-> GPU3: NV4 (NVLink x4)" in section.lines
    assert "GPU2 CPU affinity: 32-63,96-127 (NUMA node 1)" in section.lines
    assert section.findings == []  # all-NVLink: nothing to fix


def test_a_pcie_only_topology_says_so() -> None:
    text = (
        "\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\n"
        "GPU0\t X \tSYS\t0-15\t0\n"
        "GPU1\tSYS\t X \t16-31\t1\n\nLegend:\n\n  X    = Self\n"
    )
    topo = parse_topo_matrix(text)
    section = Section("devices", "Devices")
    add_topology(section, topo)
    assert describe_link("SYS").startswith("crosses PCIe and the interconnect between NUMA nodes")
    assert [f.text for f in section.findings] == [
        "no NVLink between GPUs: all-reduce goes over PCIe, expect a few to ~25 GB/s bus bandwidth",
        "GPU pairs GPU0-GPU1 cross the NUMA interconnect (SYS)",
    ]
    assert parse_topo_matrix("No devices were found").gpus == []


# ---- environment ---------------------------------------------------------------------------------
def test_env_pitfalls_are_found_in_the_environment_with_their_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in list(os.environ):
        if name.startswith(("NCCL_", "GLOO_", "TORCH_NCCL", "OMP_", "CUDA_")):
            monkeypatch.delenv(name)
    assert env_pitfalls(os.environ, cpus=8, cpu_ranks=1) == []
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    monkeypatch.setenv("NCCL_IB_DISABLE", "1")
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "lo")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "^lo,docker")  # excludes loopback: fine
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "1")
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    found = {
        f.text.split(":")[0].split("=")[0].split(" ")[0]: f
        for f in env_pitfalls(os.environ, cpus=8, cpu_ranks=4, visible_gpus=2, physical_gpus=4)
    }
    assert sorted(found) == [
        "CUDA_VISIBLE_DEVICES",
        "NCCL_DEBUG",
        "NCCL_IB_DISABLE",
        "NCCL_P2P_DISABLE",
        "NCCL_SOCKET_IFNAME",
        "OMP_NUM_THREADS",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "TORCH_NCCL_BLOCKING_WAIT",
    ]
    assert all(f.level == "warn" for f in found.values())
    assert found["NCCL_P2P_DISABLE"].fix == (
        "unset NCCL_P2P_DISABLE (a debugging workaround; keep it only if P2P "
        "is known broken on this machine)"
    )
    assert found["NCCL_IB_DISABLE"].fix == (
        "unset NCCL_IB_DISABLE on a cluster with InfiniBand/RoCE (harmless only "
        "where there is none)"
    )
    assert (
        found["NCCL_DEBUG"].fix
        == "unset NCCL_DEBUG or set NCCL_DEBUG=WARN; use INFO only while debugging"
    )
    assert found["NCCL_SOCKET_IFNAME"].text == (
        "NCCL_SOCKET_IFNAME=lo: loopback only; ranks on other nodes cannot reach this one"
    )
    assert found["OMP_NUM_THREADS"].fix == "export OMP_NUM_THREADS=2"  # 8 cores / 4 ranks
    assert found["CUDA_VISIBLE_DEVICES"] == Finding(
        "warn",
        "CUDA_VISIBLE_DEVICES='0,1' hides 2 of 4 GPUs from this process",
        "unset CUDA_VISIBLE_DEVICES, or list every GPU the job should use (e.g. CUDA_VISIBLE_DEVICES=0,1,2,3)",
    )
    assert found["TORCH_NCCL_BLOCKING_WAIT"].fix.startswith("unset TORCH_NCCL_BLOCKING_WAIT; ")
    assert found["TORCH_NCCL_ASYNC_ERROR_HANDLING"].fix == (
        "unset TORCH_NCCL_ASYNC_ERROR_HANDLING (default 3 tears the process down on an error or timeout)"
    )
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    (omp,) = [
        f for f in env_pitfalls(os.environ, cpus=8, cpu_ranks=4) if "OMP_NUM_THREADS" in f.text
    ]
    assert omp.text == "OMP_NUM_THREADS=8 x 4 CPU ranks = 32 threads on 8 cores: oversubscribed"


# ---- all-reduce ----------------------------------------------------------------------------------
def test_bus_bandwidth_follows_nccl_tests() -> None:
    r = allreduce.row(1 << 20, 1e-3, 4, iters=20)
    assert r["algbw_GBps"] == pytest.approx(1.048576)  # bytes / time, in GB/s (1e9)
    assert r["busbw_GBps"] == pytest.approx(1.048576 * 2 * 3 / 4)
    assert bus_factor(2) == 1.0 and bus_factor(8) == 1.75


@pytest.mark.slow
def test_allreduce_sweep_on_three_cpu_ranks_reports_bus_bandwidth() -> None:
    sizes = (4 * KiB, 64 * KiB, 256 * KiB)
    result = run_sweep(3, "cpu", sizes, warmup=1, deadline_s=60)
    assert result.error is None and result.backend == "gloo"
    assert [r["size_bytes"] for r in result.rows] == list(sizes)
    for r in result.rows:
        assert r["time_us"] > 0 and r["algbw_GBps"] > 0
        assert r["algbw_GBps"] == pytest.approx(r["size_bytes"] / (r["time_us"] * 1e-6) / 1e9)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * 2 * (3 - 1) / 3)
    _assert_no_rank_left()


def _hang_on_rank_1(size: int, rank: int, world: int, warmup: int, device: object) -> dict:
    if rank == 1:
        time.sleep(600)  # a rank that never reaches the collective
    return _real_time_size(size, rank, world, warmup, device)


_real_time_size = allreduce._time_size


@pytest.mark.slow
def test_a_hung_rank_is_killed_at_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(allreduce, "_time_size", _hang_on_rank_1)  # forked ranks inherit the patch
    start = time.monotonic()
    result = run_sweep(2, "cpu", (4 * KiB,), deadline_s=2, start_method="fork")
    assert time.monotonic() - start < 10
    assert (
        result.error
        == "rank(s) 0, 1 still running after the 2 s deadline (0 of the sizes done): killed"
    )
    _assert_no_rank_left()


@pytest.mark.slow
def test_a_rank_that_dies_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        allreduce,
        "_time_size",
        lambda size, rank, *a: os._exit(3) if rank == 1 else _real_time_size(size, rank, *a),
    )
    result = run_sweep(2, "cpu", (4 * KiB,), deadline_s=30, start_method="fork")
    assert result.error.startswith("rank 1 exited with code 3 without reporting")
    _assert_no_rank_left()


# ---- the whole report ----------------------------------------------------------------------------
@pytest.mark.slow
def test_cli_doctor_json_quick_has_every_section(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--json", "--quick"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert sorted(out["sections"]) == sorted(SECTIONS)
    assert all(s["error"] is None for s in out["sections"].values()), out["sections"]
    sweep = out["sections"]["allreduce"]["data"]
    assert sweep["backend"] == "gloo" and sweep["ranks"] == 2 and len(sweep["rows"]) >= 3
    for r in sweep["rows"]:
        assert r["algbw_GBps"] > 0 and r["busbw_GBps"] == pytest.approx(
            r["algbw_GBps"] * 2 * (2 - 1) / 2
        )
    pipeline = out["sections"]["input_pipeline"]["data"]
    assert pipeline["task"] == "digits" and pipeline["loader_samples_per_s"] > 0
    assert pipeline["model_samples_per_s"] > 0 and pipeline["verdict"]
    assert out["sections"]["cache_read"]["data"]["mb_per_s"] > 0
    assert "CPU-only box" in " ".join(out["sections"]["devices"]["lines"])
    assert isinstance(out["fixes"], list)
    _assert_no_rank_left()


def test_a_failing_section_is_a_line_and_the_others_still_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def broken(section: Section) -> None:
        raise OSError("nvidia-smi crashed")

    monkeypatch.setattr(report_module, "build_versions", broken)
    monkeypatch.setenv("WORKBENCH_DATA_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("WORKBENCH_DATA_MIRROR", str(tmp_path / "no-mirror"))
    report = run_doctor(RunConfig(task="char-gpt"), quick=True, skip=("allreduce",))
    assert report.section("versions").error == "OSError: nvidia-smi crashed"
    pipeline = report.section("input_pipeline")
    assert (
        pipeline.error is not None
        and "dataset 'tinyshakespeare' is not available offline" in pipeline.error
    )
    assert pipeline.findings[0].fix == (
        "workbench data fetch tinyshakespeare (or point WORKBENCH_DATA_MIRROR at a copy)"
    )
    assert (
        report.section("cache_read").data["mb_per_s"] > 0
        and report.section("devices").error is None
    )
    text = report.text()
    assert "Traceback" not in text and "== What to fix ==" in text
    assert "[error] Versions: could not run (OSError: nvidia-smi crashed)" in text
