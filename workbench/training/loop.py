"""The per-rank training loop.

Every rank runs `Trainer.fit()`. The loop only sequences a step: micro-batches with gradient sync held
back until the last one, clipping, the update; then logging, evaluation and checkpoints when due. How
the model is parallel (parallel.py), how metrics are agreed and written (logger.py), how checkpoints are
saved and restored (checkpoint.py) and what the summary says (report.py) live in their own modules.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import send_to_device, set_seed

from .. import data
from ..config import RunConfig
from ..hardware import detect
from ..metrics import peak_flops
from ..rundir import RunDir, Status
from ..tasks import Task
from .accelerator import build_accelerator
from .batches import ShardedBatches
from .checkpoint import Checkpointer
from .evaluation import evaluate, split_loss
from .logger import MetricsLogger
from .memory import tracked
from .optim import build_optimizer, lr_at, set_lr
from .parallel import parallelize
from .report import export_weights, first_leaf_dtype, running_fields, summary_fields
from .state import TrainerState

_log = logging.getLogger("workbench")


class _RankLog(logging.LoggerAdapter):
    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        return f"[rank {self.extra['rank']}] {msg}", kwargs


class Trainer:
    """One rank's run. Construct on every rank inside the launched process, then call `fit()`."""

    def __init__(self, cfg: RunConfig, task: Task, run_dir: Path, *, progress: bool = False) -> None:
        self.cfg, self.task, self.run, self.progress = cfg, task, RunDir(run_dir), progress
        self.accelerator = build_accelerator(cfg)
        self.rank = self.accelerator.process_index
        self.world = self.accelerator.num_processes
        self.main = self.accelerator.is_main_process
        # Over all ranks of all machines: cfg.global_batch_size counts this machine's num_processes only.
        self.global_batch = cfg.micro_batch_size * cfg.grad_accum_steps * self.world
        self.log = _RankLog(_log, {"rank": self.rank})
        self.device = self.accelerator.device
        self.state = TrainerState()
        self.step_times: list[float] = []
        self.prior_time = 0.0  # training time of earlier sessions of a resumed run
        self.eval_row: dict[str, float] | None = None
        self.tracked_memory: dict[str, int] | None = None  # track_memory: the first step's bytes by category

        data.reset_used_datasets()  # a forked rank inherits the kernel's list; record only this run's data
        set_seed(cfg.seed)  # identical initial weights on every rank
        model = task.build_model(cfg)
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"{type(task).__name__}.build_model returned {type(model).__name__}, not a torch.nn.Module")
        self.n_params = sum(p.numel() for p in model.parameters())
        self.flops_per_sample = task.flops_per_sample(cfg, model)
        self.tokens_per_sample = task.tokens_per_sample(cfg)
        gpus = detect().gpus
        self.peak_flops = peak_flops(gpus[0].name, cfg.precision) if self.device.type == "cuda" and gpus else None
        self.compute_dtype = first_leaf_dtype(model)
        train_ds, self.eval_ds = task.build_datasets(cfg)
        self.collate_fn = task.collate_fn(cfg)
        self.batches = ShardedBatches(train_ds, cfg, self.rank, self.world, self.collate_fn)
        self.parallel = parallelize(cfg, self.accelerator, model, task, lambda m: build_optimizer(m, cfg))
        self.model = self.parallel.model
        # Dropout masks should differ between ranks, yet be reproducible.
        torch.manual_seed(cfg.seed + 1000 * (self.rank + 1))
        self.checkpoints = Checkpointer(self.accelerator, self.run, cfg, self.parallel)
        self.metrics = MetricsLogger(self.accelerator, self.run, cfg, global_batch=self.global_batch,
                                     tokens_per_sample=self.tokens_per_sample, mfu=self.mfu,
                                     epoch_of=self.batches.epoch_of, held_bytes=lambda: self.parallel.held_bytes)

    # ---- the run --------------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        resumed_from = self._resume() if self.cfg.resume else None
        self._announce(resumed_from)
        start = (self.state.step, self.state.samples, self.state.tokens)
        status = self._train()
        return self._finish(status, *start)

    def _announce(self, resumed_from: str | None) -> None:
        if not self.main:
            return
        cfg = self.cfg
        self.run.event("resumed" if resumed_from else "started", step=self.state.step, world_size=self.world,
                       device=str(self.device), checkpoint=resumed_from)
        self.run.set_status(Status.RUNNING, **running_fields(self))
        self.log.info("training %s: %d ranks on %s, %s, global batch %d, %d params", cfg.task, self.world,
                      self.device.type, cfg.precision, self.global_batch, self.n_params)

    def _train(self) -> Status:
        """Steps until max_steps or an agreed stop; step time runs from one step's start to the next, so
        logging, eval and checkpoints count too."""
        batches = self.batches.iterate(self.state.micro_batches)
        self.model.train()
        bar = self._progress_bar()
        step_start = time.perf_counter()
        try:
            while self.state.step < self.cfg.max_steps:
                if self._track_this_step():
                    grad_norm, self.tracked_memory = tracked(self.parallel, lambda: self._step(batches))
                else:
                    grad_norm = self._step(batches)
                if bar is not None:
                    bar.update(1)
                stop = self._after_step(grad_norm, bar)
                now = time.perf_counter()
                self.step_times.append(now - step_start)
                step_start = now
                if stop:
                    if self.main:
                        self.run.event("stopped", step=self.state.step)
                    return Status.STOPPED
            return Status.COMPLETED
        finally:
            if bar is not None:
                bar.close()

    def _step(self, batches: Iterator[Any]) -> torch.Tensor | None:
        """One optimizer step: accumulate micro-batches, clip, update. Returns the gradient norm if clipped."""
        cfg, parallel = self.cfg, self.parallel
        set_lr(parallel.optimizer, lr_at(self.state.step, cfg))
        for micro in range(cfg.grad_accum_steps):
            batch = send_to_device(next(batches), self.device)
            with parallel.sync_gradients(micro == cfg.grad_accum_steps - 1):
                with parallel.forward_context():
                    loss, _ = split_loss(self.task.loss(self.model, batch))
                parallel.backward(loss / cfg.grad_accum_steps)
            self.metrics.add_micro_batch_loss(loss)
        grad_norm = parallel.clip_grad_norm(cfg.grad_clip) if cfg.grad_clip > 0 else None
        if parallel.step():
            self.state.skipped_steps += 1  # fp16 overflow: the scaler skipped the update and lowered the scale
        self.state.step += 1
        self.state.micro_batches += cfg.grad_accum_steps
        self.state.samples += self.global_batch
        self.state.tokens += self.global_batch * (self.tokens_per_sample or 0)
        self.metrics.step_done()
        return grad_norm

    def _after_step(self, grad_norm: torch.Tensor | None, bar: Any) -> bool:
        """Log, evaluate and checkpoint when due; True when the ranks agreed to stop."""
        cfg, step = self.cfg, self.state.step
        final = step == cfg.max_steps
        if self.metrics.due(step, final):
            row, stop = self.metrics.log(self.state, grad_norm, self.elapsed_s())
            if bar is not None:
                bar.set_postfix(loss=f"{row['loss']:.4f}", samples_s=f"{row['samples_per_s']:.0f}")
        else:
            stop = self.metrics.stop_agreed(step)
        if self.eval_ds is not None and (final or stop or (cfg.eval_every and step % cfg.eval_every == 0)):
            self.eval_row = evaluate(self.model, self.task, self.eval_ds, cfg, self.accelerator, self.collate_fn,
                                     self.parallel.forward_context)
            if self.main:
                self.run.append_metrics({"step": step, **self.eval_row})
            self.metrics.restart_clock()
        if self.checkpoints.due(step, final, stop):
            self.state.train_time_s = self.elapsed_s()
            self.checkpoints.save(self.state)
            self.metrics.restart_clock()
        return stop

    def _finish(self, status: Status, steps0: int, samples0: int, tokens0: int) -> dict[str, Any]:
        session_time = sum(self.step_times) or 1e-9
        tokens = self.state.tokens - tokens0
        fields = summary_fields(self, samples_per_s=(self.state.samples - samples0) / session_time,
                                tokens_per_s=tokens / session_time if tokens else None,
                                steps_run=self.state.step - steps0)
        fields["weights_sha256"] = export_weights(self)
        if self.main:
            self.run.set_status(status, **running_fields(self), **fields)
            self.run.write_timings(self.step_times)
            if status is Status.COMPLETED:
                self.run.event("completed", step=self.state.step)
        self.accelerator.wait_for_everyone()
        return fields

    # ---- pieces ---------------------------------------------------------------------------------------
    def _track_this_step(self) -> bool:
        """track_memory watches the session's second step (steady state), or its only one."""
        if not self.cfg.track_memory or self.tracked_memory is not None:
            return False
        done = len(self.step_times)
        return done == 1 or (done == 0 and self.cfg.max_steps - self.state.step == 1)

    def elapsed_s(self) -> float:
        """Training time over all sessions of the run."""
        return self.prior_time + sum(self.step_times)

    def mfu(self, samples_per_s: float) -> float | None:
        if not (self.peak_flops and self.flops_per_sample):
            return None
        return self.flops_per_sample * samples_per_s / self.world / self.peak_flops

    def _progress_bar(self) -> Any:
        if not (self.progress and self.main):
            return None
        # Plain text, not tqdm.auto: a rank is a forked process and can't drive the kernel's widgets; its
        # stderr still reaches the notebook through the kernel's captured file descriptors.
        from tqdm import tqdm

        return tqdm(total=self.cfg.max_steps, initial=self.state.step, desc=f"{self.cfg.task} x{self.world}",
                    unit="step", dynamic_ncols=True)

    def _resume(self) -> str:
        self.state, ckpt = self.checkpoints.resume()
        self.prior_time = self.state.train_time_s
        self.log.info("resumed from %s at step %d", ckpt, self.state.step)
        return str(ckpt)


def train(cfg: RunConfig, task: Task, run_dir: Path, *, progress: bool = False) -> dict[str, Any]:
    """Run one rank of `cfg` (call on every rank). Returns the summary fields."""
    return Trainer(cfg, task, run_dir, progress=progress).fit()
