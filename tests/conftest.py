"""Shared fixtures: a data mirror (../shared/data beside the repo), a private cache, a temp runs dir per test."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from collected_ids import mark_unstable_ids, pytest_runtest_setup  # noqa: F401  (a hook: stable test ids)

from tests.ray_cluster import ray_cluster  # noqa: F401  (the Ray stage's one cluster, shared by its modules)
from workbench.rundir import RunDir

REPO = Path(__file__).resolve().parents[1]
LONGEST_FIRST = (
    "test_slurm.py",
    "test_estimate_layouts.py",
    "test_compile.py",
    "test_fault_tolerance.py",
    "test_s3_checkpoints.py",
    "test_training.py",
    "test_context_parallel.py",
    "test_tensor_parallel.py",
    "test_estimate.py",
    "test_estimate_timing.py",
    "test_browser.py",
    "test_launcher_death.py",
    "test_parallelism.py",
    "test_smoke_suite.py",
    "test_cli.py",
    "test_regress.py",
    "test_pipeline_layouts.py",
    "test_hf_models.py",
    "test_hf_tasks.py",
    "test_estimate_hf.py",
    "test_launch_view.py",
    "test_time_verdict.py",
    "test_estimate_progress.py",
)
"""Test files by their time in the suite, longest first (2 cores, a fresh cache). Two xdist workers take whole
files in collection order (addopts: --dist loadfile --no-loadscope-reorder), so these go first and the many
short files fill in at the end: the workers finish within seconds of each other, where a long file drawn last
kept one worker busy for minutes alone."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest files first (the same order in every worker), and every unstable test id marked to fail."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    position = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), position[id(item)]))
    mark_unstable_ids(items)


def shared_mirror() -> Path | None:
    """The dataset mirror tests use: $WORKBENCH_TEST_MIRROR, else ../shared/data beside the repository."""
    env = os.environ.get("WORKBENCH_TEST_MIRROR")
    path = Path(env) if env else REPO.parent / "shared" / "data"
    return path if path.is_dir() else None


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("data-cache")


def session_folder(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A folder of this pytest session shared by its xdist workers (each has its own basetemp under the
    session's), and new in every session."""
    base = tmp_path_factory.getbasetemp()
    path = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session", autouse=True)
def offline_data(data_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every test resolves data offline: a private cache, the shared mirror, never a URL. Session-wide, so
    module-scoped fixtures that launch runs (set up before any per-test fixture) get it too; a test that
    changes these variables through monkeypatch gets them back afterwards. workbench's own cache (machine
    profiles, learnt estimates, compiled kernels) is the session's too, shared by its workers: every run of the
    suite starts from none, as CI does, and leaves the user's ~/.cache/workbench alone."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WORKBENCH_CACHE_DIR", str(session_folder(tmp_path_factory, "workbench-cache")))
        env.setenv("WORKBENCH_DATA_DIR", str(data_cache))
        env.setenv("WORKBENCH_OFFLINE", "1")
        mirror = shared_mirror()
        if mirror is not None:
            env.setenv("WORKBENCH_DATA_MIRROR", str(mirror))
        yield


@pytest.fixture(scope="session", autouse=True)
def no_default_trackers() -> Iterator[None]:
    """trackers='auto' (the default) loads TensorBoard on rank 0 of every run, half a second each over the suite's
    many launches; here it resolves to none. Runs that name trackers get them (tests/test_trackers.py), and
    tracking.resolve's own 'auto' rule is tested there. Forked ranks inherit the patch."""
    from workbench.training import accelerator

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            accelerator,
            "resolve_trackers",
            lambda setting: [] if setting == "auto" else list(setting),
        )
        yield


@pytest.fixture
def runs_dir(tmp_path: Path) -> Path:
    path = tmp_path / "runs"
    path.mkdir()
    return path


@pytest.fixture
def needs_mirror() -> Path:
    mirror = shared_mirror()
    if mirror is None:
        pytest.skip(
            "no dataset mirror: set WORKBENCH_TEST_MIRROR or provide ../shared/data beside the repo"
        )
    return mirror


def copy_for_resume(saved: RunDir, target: RunDir, step: int) -> None:
    """A new run directory `target` holding `saved`'s records and its checkpoint of `step` only: what a resume
    under another layout starts from."""
    target.path.mkdir()
    for item in ("config.yaml", "metrics.jsonl", "events.jsonl", "summary.json"):
        (target.path / item).write_bytes((saved.path / item).read_bytes())
    target.checkpoints_path.mkdir()
    shutil.copytree(dict(saved.checkpoints())[step], target.checkpoints_path / f"step_{step}")


@contextmanager
def cpu_refusals_lifted() -> Iterator[None]:
    """wb.launch with preflight's CPU refusals of fp16 and cpu_offload lifted (every other check still runs), so
    a gloo run can prove a layout takes them: fp16 computes in half precision on the CPU too, and the offload
    policy is accepted (though there is no GPU memory to offload from)."""
    from workbench.launcher import launch as launching

    checked = launching.preflight
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            launching,
            "preflight",
            lambda cfg, task=None, device=None: checked(
                cfg.replace(precision="fp32", cpu_offload=False), task=task, device=device
            ),
        )
        yield


@pytest.fixture
def ring_lifted(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Context parallel on gloo CPU ranks (tests/test_context_parallel.py, test_sync_free_step.py): the estimator's
    CPU ring attention stands in for the CUDA kernels, and preflight's CPU refusal of cp, only that, is lifted."""
    ring = pytest.importorskip(
        "workbench.estimator.trace.ring", reason="PyTorch's ring templates moved"
    )
    from workbench.config.preflight import check_context_parallel_task
    from workbench.launcher import launch as launching
    from workbench.tasks import get_task

    checked = launching.preflight

    def lifted(cfg, task=None, device=None) -> None:  # preflight's own signature
        checked(cfg.replace(cp=1), task=task, device=device)
        check_context_parallel_task(cfg, task or get_task(cfg.task))

    monkeypatch.setattr(launching, "preflight", lifted)
    with ring.installed():
        yield
