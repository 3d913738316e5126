"""Wrong training refused loudly, on 2 forked gloo CPU ranks: replicas that don't synchronise, a Task method that
returns the wrong thing, ranks with different metric keys, an empty eval set; and DDP's find_unused_parameters."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from tasks_for_tests import TinyRegression
from torch.utils.data import TensorDataset

import workbench as wb
from workbench.rundir import RunDir
from workbench.utils import files

pytestmark = pytest.mark.slow


def cfg_for(runs_dir: Path, **fields: Any) -> wb.RunConfig:
    base = {
        "task": "tiny-regression",
        "num_processes": 2,
        "device": "cpu",
        "micro_batch_size": 16,
        "max_steps": 6,
        "log_every": 1,
        "lr": 5e-2,
        "runs_dir": str(runs_dir),
        "seed": 3,
        "run_name": "run",
        "dist_timeout_s": 30,
    }
    return wb.RunConfig(**{**base, **fields})


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


# ---- replicas that don't synchronise -------------------------------------------------------------
class BypassesDDP(TinyRegression):
    """The notebook idiom `getattr(model, "module", model)(x)`: from loss call `from_call` on, DDP's forward (and
    so its gradient all-reduce) is skipped."""

    name = "bypasses-ddp"

    def __init__(self, from_call: int = 1) -> None:
        super().__init__()
        self.from_call = from_call

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        self.calls += 1
        x, y = batch
        net = getattr(model, "module", model) if self.calls >= self.from_call else model
        return torch.nn.functional.mse_loss(net(x), y)


@pytest.mark.parametrize("parallelism", ["ddp", "zero1"], ids=["ddp", "zero1"])
def test_a_loss_that_bypasses_ddp_fails_at_the_first_step_naming_the_idiom(
    runs_dir: Path, parallelism: str
) -> None:
    # zero1 ends with equal weights (each partition's owner broadcasts it), each updated from one rank's batches
    # alone: only the gradients tell.
    with pytest.raises(
        wb.RunFailedError,
        match=r"UnsyncedReplicas: the ranks' gradients differ after the first "
        r"step's backward .*getattr\(model, 'module', model\)\(x\).*call "
        r"the model you were given, `model\(x\)`",
    ) as info:
        wb.launch(cfg_for(runs_dir, parallelism=parallelism), task=BypassesDDP())
    assert RunDir(info.value.run_dir).metrics() == [], "no step may be applied"


def test_replicas_whose_weights_differ_at_the_end_fail_the_run_and_export_nothing(
    runs_dir: Path,
) -> None:
    # The first step synchronises (the first step's check passes); from the second loss call on DDP is bypassed.
    with pytest.raises(
        wb.RunFailedError,
        match=r"UnsyncedReplicas: the replicas' parameters differ at the end of "
        r"training \(parallelism='ddp'; sha256 rank 0: \w{12}, rank 1: \w{12};"
        r" gradient syncs per rank: \[\d, \d\]\).*model.safetensors was not "
        r"written.*call the model you were given",
    ) as info:
        wb.launch(cfg_for(runs_dir, eval_every=0), task=BypassesDDP(from_call=2))
    run = RunDir(info.value.run_dir)
    summary = run.summary()
    assert summary.status == "failed" and summary.steps == 6
    digests = [r["weights_sha256"] for r in summary.ranks]
    assert digests[0] != digests[1], "what the ranks reported is kept"
    assert not run.weights_path.exists()


class WithBatchNorm(TinyRegression):
    name = "with-batchnorm"

    def build_model(self, cfg: wb.RunConfig) -> torch.nn.Module:
        return torch.nn.Sequential(
            torch.nn.Linear(8, 32),
            torch.nn.BatchNorm1d(32),
            torch.nn.GELU(),
            torch.nn.Linear(32, 1),
        )

    def build_datasets(self, cfg: wb.RunConfig) -> tuple[TensorDataset, None]:
        return super().build_datasets(cfg)[
            0
        ], None  # no evaluation: its forward would broadcast rank 0's buffers


def test_running_statistics_that_differ_between_ranks_are_not_unsynced_replicas(
    runs_dir: Path,
) -> None:
    # The last training forward updates each rank's BatchNorm statistics from its own batch: buffers differ,
    # parameters don't.
    result = wb.launch(cfg_for(runs_dir), task=WithBatchNorm())
    assert result.summary["status"] == "completed"
    ranks = result.summary["ranks"]
    assert ranks[0]["weights_sha256"] != ranks[1]["weights_sha256"], (
        "the buffers differ: the parameters are compared"
    )
    assert result.run_dir.joinpath("model.safetensors").exists()


# ---- find_unused_parameters ----------------------------------------------------------------------
class TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.spare = torch.nn.Linear(8, 1), torch.nn.Linear(8, 1)
        self.use_spare = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) + (self.spare(x) if self.use_spare else 0)


class SpareHead(TinyRegression):
    """TwoHeads through DDP's forward; the spare head takes part on the loss calls in `used_on` only."""

    name = "spare-head"

    def __init__(self, used_on: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.used_on = used_on

    def build_model(self, cfg: wb.RunConfig) -> torch.nn.Module:
        return TwoHeads()

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        self.calls += 1
        getattr(model, "module", model).use_spare = self.calls in self.used_on
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)


def test_a_parameter_left_out_of_the_loss_under_ddp_fails_at_the_first_step_naming_the_switch(
    runs_dir: Path,
) -> None:
    with pytest.raises(
        wb.RunFailedError,
        match=r"ValueError: SpareHead.loss left parameters out of the first step's "
        r"loss \(rank 0: spare.weight, spare.bias; rank 1: spare.weight, "
        r"spare.bias\).*Set find_unused_parameters=True",
    ):
        wb.launch(cfg_for(runs_dir), task=SpareHead())


def test_a_parameter_left_out_of_a_later_step_gets_ddps_error_with_workbenchs_fix(
    runs_dir: Path,
) -> None:
    # Used in step 1 (the check passes), unused from step 2 on: DDP itself fails at step 3's forward.
    with pytest.raises(
        wb.RunFailedError,
        match=r"RuntimeError: DistributedDataParallel found parameters that took "
        r"no part in the previous step's loss.*set "
        r"find_unused_parameters=True \(RunConfig",
    ):
        wb.launch(cfg_for(runs_dir, eval_every=0), task=SpareHead(used_on=(1,)))


def test_find_unused_parameters_reaches_ddp_and_trains_such_a_model_as_one(runs_dir: Path) -> None:
    result = wb.launch(
        cfg_for(runs_dir, find_unused_parameters=True, eval_every=0), task=SpareHead(used_on=(1, 4))
    )
    assert result.summary["status"] == "completed" and result.summary["steps"] == 6
    ranks = result.summary["ranks"]
    assert ranks[0]["weights_sha256"] == ranks[1]["weights_sha256"]


def test_find_unused_parameters_on_one_rank_says_it_does_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from types import SimpleNamespace

    from workbench.training.parallel.replicated import Replicated

    one_rank = SimpleNamespace(device=torch.device("cpu"), num_processes=1)
    with caplog.at_level("WARNING", logger="workbench"):
        Replicated(
            wb.RunConfig(find_unused_parameters=True),
            one_rank,
            torch.nn.Linear(2, 1),
            lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
        )
    assert (
        "find_unused_parameters=True: this run has one rank, hence no DistributedDataParallel"
        in caplog.text
    )


@pytest.mark.parametrize(
    "fields,message",
    [
        (
            {"parallelism": "zero3"},
            (
                r"find_unused_parameters=True with parallelism='zero3': it is "
                r"DistributedDataParallel's switch.*set find_unused_parameters=False, or "
                r"parallelism='ddp'"
            ),
        ),
        ({"parallelism": "hsdp", "num_processes": 4, "dp_shard": 2}, r"with parallelism='hsdp'"),
        ({"tp": 2}, r"find_unused_parameters=True with parallelism='ddp' with tp=2"),
        (
            {"pp": 2, "grad_accum_steps": 2},
            r"find_unused_parameters=True with parallelism='ddp' with pp=2",
        ),
        ({"parallelism": "none", "num_processes": 1}, r"with parallelism='none'"),
    ],
    ids=["zero3", "hsdp", "tp", "pp", "none"],
)
def test_find_unused_parameters_is_refused_where_there_is_no_ddp(
    fields: dict, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        wb.RunConfig(**{"find_unused_parameters": True, "num_processes": 2, **fields})


@pytest.mark.parametrize("parallelism", ["ddp", "zero1"], ids=["ddp", "zero1"])
def test_find_unused_parameters_is_accepted_with_ddp(parallelism: str) -> None:
    assert wb.RunConfig(
        find_unused_parameters=True, num_processes=2, parallelism=parallelism
    ).find_unused_parameters
    assert wb.RunConfig().with_overrides(["find_unused_parameters=true"]).find_unused_parameters
    from workbench.launcher.processes import describe_launch

    assert "DDP finds unused parameters" in describe_launch(
        wb.RunConfig(find_unused_parameters=True, num_processes=2)
    )


# ---- what a Task returns -------------------------------------------------------------------------
class Returns(TinyRegression):
    """TinyRegression whose loss or model is wrong in the way `kind` says."""

    name = "returns"

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def build_model(self, cfg: wb.RunConfig) -> torch.nn.Module:
        if self.kind == "no parameters":
            return torch.nn.Sequential(torch.nn.Identity())
        model = super().build_model(cfg)
        if self.kind == "frozen":
            model.requires_grad_(False)
        return model

    def loss(self, model: torch.nn.Module, batch: Any) -> Any:
        loss = super().loss(model, batch)
        x, _ = batch
        metric = {
            "detached": None,
            "string metric": {"note": "fine"},
            "vector metric": {"acc": x[:, 0]},
            "metric named loss": {"loss": 1.0},
            "three items": None,
            "metric keys by batch": {},
        }
        if self.kind == "detached":
            return loss.detach()
        if self.kind == "three items":
            return loss, {}, {}
        if self.kind == "metric keys by batch":
            return loss, {"acc": 1.0} if self.calls % 2 else {}
        return (loss, metric[self.kind]) if self.kind in metric else loss


RETURNS = [
    (
        "detached",
        {},
        (
            r"TypeError: Returns.loss returned a torch.float32 tensor that does not require grad \(no "
            r"grad_fn\).*not under torch.no_grad\(\)"
        ),
    ),
    (
        "frozen",
        {"parallelism": "zero3"},
        (
            r"ValueError: Returns.build_model\(cfg\) returned a Sequential whose 4 "
            r"parameters all have requires_grad=False: there is nothing to train"
        ),
    ),
    (
        "no parameters",
        {"parallelism": "zero3"},
        (
            r"ValueError: Returns.build_model\(cfg\) returned a Sequential "
            r"with no parameters"
        ),
    ),
    (
        "string metric",
        {},
        (
            r"TypeError: Returns.loss returned metric 'note' as str \('fine'\); a metric must be a "
            r"number"
        ),
    ),
    (
        "vector metric",
        {},
        (
            r"TypeError: Returns.loss returned metric 'acc' as a torch.float32 tensor of shape "
            r"\(16,\); a metric must be a scalar"
        ),
    ),
    ("metric named loss", {}, r"TypeError: Returns.loss returned a metric named 'loss'"),
    ("three items", {}, r"TypeError: Returns.loss returned a tuple of 3 items"),
    (
        "metric keys by batch",
        {"grad_accum_steps": 2},
        (
            r"ValueError: Returns.loss returned metrics \['acc'\] on "
            r"one micro-batch and \[\] on another"
        ),
    ),
]


@pytest.mark.parametrize("kind,fields,message", RETURNS, ids=[kind for kind, _, _ in RETURNS])
def test_a_wrong_task_return_fails_by_the_first_step_naming_the_method_and_the_value(
    runs_dir: Path, kind: str, fields: dict, message: str
) -> None:
    with pytest.raises(wb.RunFailedError, match=message) as info:
        wb.launch(cfg_for(runs_dir, **fields), task=Returns(kind))
    assert RunDir(info.value.run_dir).metrics() == [], (
        "the error comes by the first step, before its update"
    )


class Datasets(TinyRegression):
    name = "datasets"

    def __init__(self, kind: str, known_size: bool = False) -> None:
        super().__init__()
        self.kind, self.known_size = kind, known_size

    def build_datasets(self, cfg: wb.RunConfig) -> Any:
        train, evaluation = super().build_datasets(cfg)
        return {
            "bare": train,
            "empty eval": (train, TensorDataset(torch.zeros(0, 8), torch.zeros(0, 1))),
            "triple": (train, evaluation, None),
        }[self.kind]

    def train_size(
        self, cfg: wb.RunConfig
    ) -> int | None:  # known: the pre-launch check doesn't build them
        return 512 if self.known_size else super().train_size(cfg)


DATASETS = [
    (
        "bare",
        TypeError,
        (
            r"Datasets.build_datasets\(cfg\) returned TensorDataset \(one dataset: return "
            r"\(dataset, None\) to train without evaluation\); it must return a pair "
            r"\(train_dataset, eval_dataset or None\)"
        ),
    ),
    (
        "empty eval",
        ValueError,
        (
            r"Datasets.build_datasets\(cfg\) returned an empty eval dataset "
            r"\(TensorDataset of 0 samples\).*return \(train, None\) to train without "
            r"evaluation"
        ),
    ),
    ("triple", TypeError, r"Datasets.build_datasets\(cfg\) returned tuple of 3 item\(s\)"),
]


@pytest.mark.parametrize("kind,error,message", DATASETS, ids=[kind for kind, _, _ in DATASETS])
def test_build_datasets_not_returning_a_pair_is_refused_before_launch(
    runs_dir: Path, kind: str, error: type, message: str
) -> None:
    with pytest.raises(error, match=message):
        wb.launch(cfg_for(runs_dir), task=Datasets(kind))
    assert not any(runs_dir.iterdir()), "refused before anything is created"


@pytest.mark.parametrize("kind,error,message", DATASETS, ids=[kind for kind, _, _ in DATASETS])
def test_build_datasets_not_returning_a_pair_fails_in_the_ranks_too(
    runs_dir: Path, kind: str, error: type, message: str
) -> None:
    with pytest.raises(wb.RunFailedError, match=f"{error.__name__}: {message}"):
        wb.launch(cfg_for(runs_dir), task=Datasets(kind, known_size=True))


# ---- metric keys that differ between ranks -------------------------------------------------------
class KeysByRank(TinyRegression):
    """Rank 0 reports an accuracy, rank 1 doesn't: in every loss call, or in evaluation only."""

    name = "keys-by-rank"

    def __init__(self, eval_only: bool) -> None:
        super().__init__()
        self.eval_only = eval_only

    def loss(self, model: torch.nn.Module, batch: Any) -> Any:
        loss = super().loss(model, batch)
        report = rank() == 0 and (not self.eval_only or not torch.is_grad_enabled())
        return loss, {"acc": 0.5} if report else {}


@pytest.mark.parametrize(
    "eval_only,where",
    [(False, "in the first training step"), (True, "in evaluation")],
    ids=["training", "evaluation"],
)
def test_ranks_returning_different_metric_keys_fail_at_once_naming_the_keys(
    runs_dir: Path, eval_only: bool, where: str
) -> None:
    started = time.monotonic()
    message = rf"ValueError: KeysByRank.loss returned different metric keys on different ranks {where}.*rank 0: \["
    with pytest.raises(wb.RunFailedError, match=message + r".*'acc'.*\]; rank 1: \[") as info:
        wb.launch(cfg_for(runs_dir, eval_every=2, checkpoint_every=2), task=KeysByRank(eval_only))
    assert time.monotonic() - started < 25, "no rank may wait for the other (dist_timeout_s=30)"
    summary = files.read_json(info.value.run_dir / "summary.json")
    assert summary["error"]["type"] == "ValueError"


# ---- a preemption recorded while the ranks trained -----------------------------------------------
def test_a_preemption_recorded_by_the_launcher_says_the_step_the_ranks_were_at(
    tmp_path: Path,
) -> None:
    from workbench.launcher.preempted import record_preemption
    from workbench.rundir import Status

    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.set_status(Status.RUNNING)
    run.write_heartbeat(0, {"pid": 1, "step": 6, "phase": "evaluation"})
    run.write_heartbeat(1, {"pid": 2, "step": 6, "phase": "checkpoint"})
    assert record_preemption(run, 15, "reached the launcher before the ranks recorded an ending")
    ending = run.summary().ending
    assert ending["ranks_at_step"] == 6 and ending["step"] == 0, ending
    assert ending["message"] == (
        "SIGTERM reached the launcher before the ranks recorded an ending; the ranks had "
        "completed 6 step(s), last seen in 'checkpoint', 'evaluation'; it has no checkpoint: "
        "a resume starts it over"
    )


def test_a_preemption_before_training_says_nothing_of_steps(tmp_path: Path) -> None:
    from workbench.rundir import Status

    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.set_status(Status.RUNNING)
    run.write_heartbeat(0, {"pid": 1, "step": 0, "phase": "ended"})
    run.end_preempted("SIGTERM", "before training started: the ranks exited with nothing to save")
    assert "ranks_at_step" not in run.summary().ending
    assert (
        run.summary()
        .ending["message"]
        .startswith(
            "SIGTERM before training started: the ranks exited with "
            "nothing to save; it has no checkpoint"
        )
    )
