"""RunResult: a run that has ended, as the caller holds it. It composes the run directory's read
side with what the run directory itself must not import: the task's model (load_model), the figures
(plot) and the launcher (resume)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workbench.rundir import RunDir, RunFiles
from workbench.rundir.run_files import resume_config
from workbench.utils.jsonl import JsonlRows

if TYPE_CHECKING:
    from workbench.config import RunConfig
    from workbench.tasks import Task

log = logging.getLogger("workbench")


@dataclass(repr=False)  # RunFiles' one-line repr, not every field's
class RunResult(RunFiles):
    """A run that has ended, read back from its run directory."""

    run_dir: Path
    config: RunConfig | None = None
    task: Task | None = field(default=None, repr=False)
    """The task object the run was launched with (a notebook's own); else the one cfg.task names."""

    def _task(self) -> Task:
        from workbench.tasks import get_task

        return self.task if self.task is not None else get_task(self._config().task)

    def _config(self) -> RunConfig:
        cfg = self.config or self.dir.config()
        if cfg is None:
            raise FileNotFoundError(
                f"{self.dir.config_path}: no such file; is {self.run_dir} a run directory?"
            )
        return cfg

    def load_model(self, step: int | None = None, device: str | Any = "cpu") -> Any:
        """The task's model with this run's final weights (or those of the checkpoint at `step`), on
        `device`, in eval mode, whatever parallelism trained it."""
        from workbench.training.weights import load_model

        return load_model(self.dir, self._config(), self._task(), step=step, device=device)

    def save_pretrained(
        self, path: str | os.PathLike[str], *, merged: bool = False, step: int | None = None
    ) -> Path:
        """Write this run's model as a transformers folder, loadable without workbench: config,
        safetensors weights (those of `load_model(step=step)`, gathered from whatever layout
        trained them), generation config, and the tokenizer the run trained with (its run
        directory's `tokenizer/`, when the task kept one).

        A LoRA run writes its adapter (adapter_config.json, adapter_model.safetensors: load it
        with `PeftModel.from_pretrained(base, path)`); with `merged=True`, the model with the
        adapters folded in, a plain transformers folder. A base built at random init (an
        architecture name, no folder) is written beside the adapter, in `path/base`, and the
        adapter names it as its base. The task's model must be a transformers PreTrainedModel.
        Returns the folder."""
        from workbench.tasks.hf import lora
        from workbench.tasks.model_plans import is_transformers_model

        model = self.load_model(step=step)
        if not is_transformers_model(model):
            raise TypeError(
                f"save_pretrained: task {self._config().task!r} built a {type(model).__name__}, "
                "not a transformers PreTrainedModel; use load_model() and torch.save or "
                f"safetensors for it (its final weights are {self.dir.weights_path})"
            )
        folder = Path(path)
        # one bar per shard in the cell says nothing for a folder written in a second
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        if lora.is_peft(model):
            if merged:
                lora.merged(model).save_pretrained(folder)
            else:
                lora.save_adapter(model, folder)
        else:
            if merged:
                log.warning(
                    "save_pretrained(merged=True): %s has no adapters to merge", self.dir.name
                )
            model.save_pretrained(folder)
        if self.dir.tokenizer_path.is_dir():
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(
                self.dir.tokenizer_path, local_files_only=True
            )
            tokenizer.save_pretrained(folder)
        return folder

    @property
    def rank_values(self) -> list[Any]:
        """What Task.rank_value returned on every rank at the end of the run, in rank order."""
        from workbench.training.weights import rank_values

        return rank_values(self.dir)

    def resume(self, **changes: Any) -> RunResult:
        """Continue this run from its newest checkpoint, with `changes` to the config (e.g.
        max_steps=2000); blocks like wb.launch. Changes you name are allowed even where they alter
        the trajectory."""
        # Through the public wb.launch (resolved on first use, PEP 562): the launcher imports this
        # module, so a module-level import back would be a cycle, and a RunResult alone (reading old
        # runs) loads no launcher.
        import workbench

        return workbench.launch(resume_config(self._config(), self.run_dir, changes), self.task)

    _metrics_rows: JsonlRows | None = field(default=None, init=False, repr=False, compare=False)
    """metrics.jsonl as parsed so far (`metrics`)."""

    @property
    def metrics(self) -> list[dict[str, Any]]:
        """The rows of metrics.jsonl: a list of plain dicts, as written (`dir.metrics_rows()`:
        typed). Parsed at the first access and kept; a later one parses only the rows appended since
        (a result of a run still going, as wb.runs() gives one) and reads the file again only when
        it was replaced (a resume sets rows aside). A new list each time; its dicts are the ones
        kept, so copy a row before changing it."""
        if self._metrics_rows is None or self._metrics_rows.path != self.dir.metrics_path:
            self._metrics_rows = JsonlRows(self.dir.metrics_path, shared=("verdicts",))
        return list(self._metrics_rows.read())

    def plot(self, *others: RunResult, **kwargs: Any) -> Any:
        """Loss, throughput and memory; pass other results to overlay them (e.g. fp32 against bf16).
        A long run is drawn from an even sample of its rows (the newest and its evaluations
        included), read without parsing the rest of metrics.jsonl."""
        from workbench.notebook.plots import plot_runs

        return plot_runs([self, *others], **kwargs)

    @classmethod
    def load(cls, run_dir: str | os.PathLike[str]) -> RunResult:
        """The run in `run_dir` (one folder under runs_dir, as wb.launch made it). ValueError when
        it isn't a run directory (a mistyped path, the runs_dir itself), naming the runs there are:
        a RunResult of nothing would read as a run forever 'starting', with no rows."""
        run = RunDir(Path(run_dir).expanduser())
        if not run.config_paths() and not run.summary_path.exists():
            raise ValueError(not_a_run_directory(run.path))
        return cls(run.path, run.config())


SHOWN_RUNS = 5
"""Run names an error about a runs_dir lists (the newest)."""


def _runs_in(folder: Path) -> list[str]:
    """Names of the run directories in `folder`, most recently written first."""
    try:
        found = [
            (p.stat().st_mtime, p.parent.name)
            for pattern in ("*/summary.json", "*/config.yaml")
            for p in folder.glob(pattern)
        ]
    except OSError:
        return []
    newest: dict[str, float] = {}
    for modified, name in found:
        newest[name] = max(modified, newest.get(name, modified))
    return sorted(newest, key=lambda name: (-newest[name], name))


def not_a_run_directory(path: Path, call: str = "RunResult.load") -> str:
    """What is wrong with loading `path` as a run (through `call`), and what to load instead."""
    from workbench.utils.suggest import did_you_mean

    head = f"{call}: not a run directory: {path}"
    if not path.is_dir():
        siblings = _runs_in(path.parent) if path.parent.is_dir() else []
        hint = did_you_mean(path.name, siblings)
        there = f"; the runs in {path.parent} are {_listed(siblings)}" if siblings else ""
        return f"{head} {'is a file' if path.exists() else 'does not exist'}{hint}{there}"
    runs = _runs_in(path)
    if runs:
        return (
            f"{head} has no config.yaml or summary.json: it is a runs_dir; its runs are "
            f"{_listed(runs)}. Load one, e.g. wb.{call}({str(path / runs[0])!r}), or list them "
            f"with wb.runs({str(path)!r})"
        )
    return (
        f"{head} has no config.yaml or summary.json, nor runs in it; pass the folder wb.launch "
        "made under runs_dir (result.run_dir)"
    )


def _listed(names: list[str]) -> str:
    more = len(names) - SHOWN_RUNS
    return ", ".join(names[:SHOWN_RUNS]) + (f", ... ({len(names)} in all)" if more > 0 else "")
