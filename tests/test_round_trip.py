"""The notebook round trip: a task's own optimizer and schedule, rank output in the caller, the trained
model and per-rank values back in the kernel, resume, files the team can read, and refusals before launch."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from collected_ids import cases
from tasks_for_tests import TinyBlocks, TinyRegression

import workbench as wb
from workbench.config.preflight import preflight
from workbench.rundir import RunDir

pytestmark = pytest.mark.slow
TESTS = Path(__file__).parent


def cfg_for(runs_dir: Path, **fields: Any) -> wb.RunConfig:
    base = dict(
        task="tiny-regression",
        num_processes=2,
        device="cpu",
        micro_batch_size=16,
        max_steps=8,
        log_every=1,
        lr=5e-2,
        runs_dir=str(runs_dir),
        seed=3,
    )
    return wb.RunConfig(**{**base, **fields})


class SGDTask(TinyRegression):
    """nanoGPT-style: the task builds its optimizer (SGD with momentum) and keeps a constant learning rate."""

    name = "sgd-task"

    def configure_optimizers(
        self, model: torch.nn.Module, cfg: wb.RunConfig
    ) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)

    def lr_scale(self, step: int, cfg: wb.RunConfig) -> float:
        return 1.0


def optimizer_keys(run: RunDir) -> set[str]:
    _, ckpt = run.checkpoints()[-1]
    return set(dcp.FileSystemReader(str(ckpt / "optim")).read_metadata().state_dict_metadata)


def test_a_tasks_own_optimizer_steps_checkpoints_and_resumes(runs_dir: Path) -> None:
    straight = wb.launch(cfg_for(runs_dir, run_name="straight"), task=SGDTask())
    keys = optimizer_keys(straight.dir)
    assert any(k.endswith("momentum_buffer") for k in keys) and not any(
        "exp_avg" in k for k in keys
    ), keys
    # the task's schedule, not warm-up/cosine
    assert {r["lr"] for r in straight.metrics if "lr" in r} == {5e-2}
    half = wb.launch(cfg_for(runs_dir, run_name="halves", max_steps=4), task=SGDTask())
    resumed = half.resume(max_steps=8)
    # Bit for bit the uninterrupted run: the momentum buffers were saved and loaded, not restarted at zero.
    assert resumed.summary["weights_sha256"] == straight.summary["weights_sha256"]
    # one curve, continued
    assert [r["step"] for r in resumed.metrics if "loss" in r] == list(range(1, 9))


def test_betas_and_eps_reach_the_default_adamw(runs_dir: Path) -> None:
    default = wb.launch(cfg_for(runs_dir, max_steps=4), task=TinyRegression())
    nano = wb.launch(cfg_for(runs_dir, max_steps=4, beta2=0.99), task=TinyRegression())
    assert nano.summary["weights_sha256"] != default.summary["weights_sha256"]
    with pytest.raises(ValueError, match=r"beta2=1.0: must be in \[0, 1\)"):
        cfg_for(runs_dir, beta2=1.0)
    with pytest.raises(ValueError, match=r"eps=0: must be a small positive number"):
        cfg_for(runs_dir, eps=0)


class Chatty(TinyRegression):
    name = "chatty"

    def build_model(self, cfg: wb.RunConfig) -> torch.nn.Module:
        # a partial line: ends when the rank closes it
        print(f"hello from rank {os.environ['RANK']}", end="")
        print(" building the model")
        return super().build_model(cfg)


def test_a_ranks_print_reaches_the_caller_with_its_rank(
    runs_dir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    wb.launch(cfg_for(runs_dir, max_steps=2), task=Chatty())
    out = capfd.readouterr().out
    for rank in (0, 1):
        assert f"[rank {rank}] hello from rank {rank} building the model\n" in out, out
    assert "Launching training on" not in out  # accelerate's misleading line is still dropped


def test_an_import_path_task_gets_a_valid_automatic_run_name(
    runs_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(TESTS))
    result = wb.launch(cfg_for(runs_dir, task="tasks_for_tests:TinyRegression", max_steps=2))
    assert (
        result.run_dir.name.startswith("TinyRegression-") and result.status == wb.Status.COMPLETED
    )
    path = runs_dir / "shell.yaml"
    cfg_for(runs_dir, task="tasks_for_tests:TinyRegression", max_steps=2).to_yaml(path)
    # the shell names the run as it prepares the directory (the shell's entry point, in process: the name is
    # chosen before any rank starts, so `--prepare-only` is where it shows)
    from workbench.cli import main

    assert main(["train", str(path), "--prepare-only"]) == 0
    assert len([p for p in runs_dir.iterdir() if p.name.startswith("TinyRegression-")]) == 2


class Reporting(TinyBlocks):
    """Every rank sends back its rank, a statistic of its own data and a tensor."""

    name = "reporting"

    def rank_value(self, model: torch.nn.Module, cfg: wb.RunConfig) -> Any:
        rank = int(os.environ["RANK"])
        return {"rank": rank, "pid": os.getpid(), "scale": torch.full((2,), float(rank))}


@pytest.mark.parametrize("mode", ["ddp", "zero3"])
def test_the_trained_model_and_rank_values_come_back(runs_dir: Path, mode: str) -> None:
    result = wb.launch(
        cfg_for(
            runs_dir,
            task="reporting",
            parallelism=mode,
            max_steps=3,
            task_options={"width": 16, "blocks": 2},
        ),
        task=Reporting(),
    )
    final = result.load_model()
    from_checkpoint = result.load_model(step=3)
    assert isinstance(final, torch.nn.Module) and not final.training
    final_state, ckpt_state = final.state_dict(), from_checkpoint.state_dict()
    assert final_state.keys() == ckpt_state.keys()
    assert all(torch.equal(final_state[k], ckpt_state[k]) for k in final_state)  # bit for bit
    assert not torch.equal(
        final_state["inp.weight"], Reporting().build_model(result.config).state_dict()["inp.weight"]
    )
    values = result.rank_values
    assert [v["rank"] for v in values] == [0, 1]
    assert values[0]["pid"] != values[1]["pid"] and torch.equal(values[1]["scale"], torch.ones(2))
    with pytest.raises(
        ValueError, match=r"step=2: .* has complete checkpoints at steps \[3\] only"
    ):
        result.load_model(step=2)


def test_a_rank_value_that_cant_be_loaded_safely_fails_the_run(runs_dir: Path) -> None:
    class Unsafe(TinyRegression):
        name = "unsafe"

        def rank_value(self, model: torch.nn.Module, cfg: wb.RunConfig) -> Any:
            return model  # a whole module: loading it back would need pickle's code execution

    with pytest.raises(
        wb.RunFailedError, match=r"rank_value returned a .* that can't be loaded safely"
    ):
        wb.launch(cfg_for(runs_dir, max_steps=2), task=Unsafe())


def test_the_panel_resumes_a_stopped_run_and_the_curve_continues(runs_dir: Path) -> None:
    panel = wb.Panel(
        cfg_for(runs_dir, max_steps=4, num_processes=1, parallelism="none"),
        task=TinyRegression(),
        estimate=False,
    )
    panel.poll_interval = 0.2
    assert panel.resume_button.disabled  # nothing to resume yet
    panel.launch()
    first = panel.wait(timeout=300, show=False)
    assert first.status == wb.Status.COMPLETED and not panel.resume_button.disabled
    panel.controls["max_steps"].value = 7
    panel.resume_button.click()
    assert panel.state.error == "" and "max_steps=7" in panel.state.message
    second = panel.wait(timeout=300, show=False)
    assert second.run_dir == first.run_dir and second.status == wb.Status.COMPLETED
    assert [r["step"] for r in second.metrics if "loss" in r] == list(range(1, 8))
    assert any(e["event"] == "resumed" for e in second.events)


def test_written_files_honour_the_umask(runs_dir: Path) -> None:
    old = os.umask(0o022)
    try:
        result = wb.launch(
            cfg_for(runs_dir, max_steps=2, num_processes=1, parallelism="none"),
            task=TinyRegression(),
        )
    finally:
        os.umask(old)
    modes = {
        p.relative_to(result.run_dir): stat.S_IMODE(p.stat().st_mode)
        for p in result.run_dir.rglob("*")
    }
    files = {p: m for p, m in modes.items() if (result.run_dir / p).is_file()}
    for name in ("config.yaml", "summary.json", "metrics.jsonl", "model.safetensors"):
        assert files[Path(name)] == 0o644, (name, oct(files[Path(name)]))
    assert {oct(m) for m in files.values()} == {oct(0o644)}, {
        str(p): oct(m) for p, m in files.items() if m != 0o644
    }
    assert all(m == 0o755 for p, m in modes.items() if (result.run_dir / p).is_dir())


@pytest.mark.parametrize(
    ("fields", "message"),
    cases(
        [
            (
                {"task": "digits", "micro_batch_size": 5000},
                r"micro_batch_size=5000 x num_processes=2 is more than the 1,438 training samples of task 'digits': "
                r"use micro_batch_size=719 or fewer",
            )
        ]
    ),
)
def test_what_can_be_known_before_launch_is_refused_before_launch(
    runs_dir: Path, fields: dict, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        wb.launch(cfg_for(runs_dir, **fields))
    assert not list(runs_dir.iterdir())
    panel = wb.Panel(cfg_for(runs_dir, **fields), estimate=False)
    assert (
        panel.launch_button.disabled
        and "micro_batch_size=5000 x num_processes=2" in panel.state.problem
    )


def test_data_that_isnt_available_offline_is_refused_before_launch(
    runs_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORKBENCH_DATA_DIR", str(tmp_path / "empty-cache"))
    (tmp_path / "empty-mirror").mkdir()
    monkeypatch.setenv("WORKBENCH_DATA_MIRROR", str(tmp_path / "empty-mirror"))
    with pytest.raises(
        ValueError,
        match=r"task 'char-gpt': dataset 'tinyshakespeare' is not available offline .*"
        r"`workbench data fetch tinyshakespeare`",
    ):
        preflight(cfg_for(runs_dir, task="char-gpt"))
    panel = wb.Panel(cfg_for(runs_dir, task="char-gpt"), estimate=False)
    assert panel.launch_button.disabled and "not available offline" in panel.state.problem
    # the implied launch doesn't contradict the refusal
    assert "launching" not in panel.launch_info.value


def test_ranks_forked_after_the_caller_used_openmp_do_not_hang(runs_dir: Path) -> None:
    """A kernel that did CPU math has a live OpenMP pool; a forked rank that enters a parallel region with
    more than one thread waits forever for the pool's threads, which exist only in the kernel."""
    if torch.get_num_threads() < 2:
        pytest.skip("needs 2 or more intra-op threads to start an OpenMP pool")
    torch.rand(4_000_000).sqrt()  # MKL's threaded sqrt: the pool now exists in this process
    run = wb.start(
        cfg_for(runs_dir, max_steps=3, num_processes=1, parallelism="none"), task=TinyRegression()
    )
    try:
        result = run.wait(timeout=240)
    except TimeoutError:
        run.kill()
        pytest.fail("the forked rank hung after the caller used OpenMP")
    assert result.status == wb.Status.COMPLETED


# ---- the task's code changed since the run -------------------------------------------------------
class Widened(TinyRegression):
    """tiny-regression after its hidden layer was widened from 32 to 48."""

    def build_model(self, cfg: wb.RunConfig) -> torch.nn.Module:
        return torch.nn.Sequential(
            torch.nn.Linear(8, 48), torch.nn.GELU(), torch.nn.Dropout(0.0), torch.nn.Linear(48, 1)
        )


class Deeper(TinyRegression):
    """tiny-regression with a layer added at the end."""

    def build_model(self, cfg: wb.RunConfig) -> torch.nn.Module:
        return torch.nn.Sequential(*super().build_model(cfg), torch.nn.Linear(1, 1))


class Shallower(TinyRegression):
    """tiny-regression with its output layer removed."""

    def build_model(self, cfg: wb.RunConfig) -> torch.nn.Module:
        return torch.nn.Sequential(*list(super().build_model(cfg))[:3])


class WithSGD(TinyRegression):
    """tiny-regression, the same model, now with SGD and momentum instead of the default AdamW."""

    def configure_optimizers(
        self, model: torch.nn.Module, cfg: wb.RunConfig
    ) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> wb.RunResult:
    """A 2-rank DDP run of tiny-regression with its final weights and a checkpoint at step 2."""
    return wb.launch(
        cfg_for(tmp_path_factory.mktemp("runs"), run_name="trained", max_steps=2),
        task=TinyRegression(),
    )


CHANGED = {
    "widened": (
        Widened,
        (
            "shape mismatch: 0.bias saved [32], model [48], 0.weight saved [32, 8], model [48, 8], "
            "3.weight saved [1, 32], model [1, 48]"
        ),
    ),
    "deeper": (
        Deeper,
        "missing from the saved weights (the model has them): 4.bias [1], 4.weight [1, 1]",
    ),
    "shallower": (
        Shallower,
        "unexpected (saved, the model has no such entry): 3.bias [1], 3.weight [1, 32]",
    ),
}


@pytest.mark.parametrize("change", sorted(CHANGED))
def test_load_model_with_changed_task_code_names_every_difference(
    trained: wb.RunResult, change: str
) -> None:
    task, differences = CHANGED[change]
    result = wb.RunResult(trained.run_dir, task=task())
    ckpt = trained.run_dir / "checkpoints" / "step_2"
    with pytest.raises(
        ValueError,
        match=re.escape(  # a ValueError: `except Exception` catches it
            f"checkpoint {ckpt} doesn't match the task's model: {differences}. The task's code changed since the "
            "run saved it (the config is the run's own): load it with the task as it was"
        ),
    ):
        result.load_model(step=2)
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"{trained.run_dir / 'model.safetensors'} doesn't match the task's model: {differences}. "
        ),
    ):
        result.load_model()


def test_a_resume_with_changed_task_code_fails_naming_what_changed_and_the_way_out(
    trained: wb.RunResult,
) -> None:
    ckpt = trained.run_dir / "checkpoints" / "step_2"
    fix = (
        "The task's code changed since the checkpoint was written (its config, task_options included, is checked "
        "before launch; resume_allow allows config changes, not another model): resume with the code that wrote "
        "it, or start a new run (another run_name, or resume=False)"
    )
    with pytest.raises(
        wb.RunFailedError,
        match=re.escape(
            f"failed with ModelMismatchError: resume from {ckpt}: the checkpoint doesn't match the task's model: "
            f"{CHANGED['widened'][1]}. {fix}\n"
        ),
    ):
        wb.RunResult(trained.run_dir, task=Widened()).resume(max_steps=4)
    # the same model with another optimizer: torch's CheckpointException (a BaseException) made an error that says
    # what each rank met
    with pytest.raises(
        wb.RunFailedError,
        match=re.escape(
            f"failed with CheckpointLoadError: resume from {ckpt}: the checkpoint could not be loaded into this run: "
            "rank 0: RuntimeError: Missing key in checkpoint state_dict: optim.state.0.weight.momentum_buffer."
        ),
    ):
        wb.RunResult(trained.run_dir, task=WithSGD()).resume(max_steps=4)
    assert trained.load_model(step=2) is not None, (
        "the checkpoint is untouched by the refused resumes"
    )


def test_a_run_read_back_in_a_fresh_interpreter_resumes(runs_dir: Path) -> None:
    """`import workbench` loads its names on first use; RunResult.resume must not depend on wb.launch having been
    touched first."""
    import signal
    import subprocess
    import sys

    import psutil

    cfg = cfg_for(
        runs_dir, task="tasks_for_tests:TinyRegression", run_name="halves", max_steps=2, trackers=[]
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(TESTS))
        wb.launch(cfg)
    code = (
        "import sys, workbench as wb\n"
        "result = wb.RunResult.load(sys.argv[1]).resume(max_steps=4)\n"
        "print('resumed to', result.summary['steps'], result.status.value)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(runs_dir / "halves")],
        text=True,
        env={**os.environ, "PYTHONPATH": str(TESTS)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:  # timed out: it and everything it started go
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    assert proc.returncode == 0 and "needs the launcher" not in err, err[-3000:]
    assert "resumed to 4 completed" in out, out
