"""The per-rank training loop. Every rank runs `Trainer.fit()`; `Trainer.__init__` builds what a run
needs, in order, and the loop only sequences a step (micro-batches with gradient sync held back
until the last one, clipping, the stop vote, the update; then logging, evaluation and checkpoints
when due, after_step.py). How the model is parallel (parallel/), the stop vote (stop_vote.py), the
rank's watch (rank_watch.py), metrics rows (logger.py), checkpoints (checkpoint.py), the session's
start and finish (session_start_end.py), the summary (session_summary.py), the endings (endings.py)
and the first step's checks of the task (first_step.py) live in their own modules."""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import set_seed

from workbench import data
from workbench.config import ParallelDims, RunConfig
from workbench.rundir import RunDir, Status, lock
from workbench.tasks import Task
from workbench.tasks.base import dataset_pair
from workbench.training import autobatch, monitor
from workbench.training.accelerator import build_accelerator
from workbench.training.after_step import after_step
from workbench.training.batches import ShardedBatches
from workbench.training.breakdown import StepBreakdown, phase_of
from workbench.training.checkpoint import Checkpointer
from workbench.training.compiling import CompileWatch, compiled_module, said_compiled
from workbench.training.endings import diverged
from workbench.training.first_step import FirstStep, check_trainable
from workbench.training.logger import MetricsLogger
from workbench.training.memory import method as tracking_method
from workbench.training.memory import tracked
from workbench.training.model_flops import ModelFlops
from workbench.training.nonfinite import Divergence, NonFiniteWatch
from workbench.training.optim import build_optimizer, set_lr
from workbench.training.parallel import parallelize
from workbench.training.profiling import StepProfiler
from workbench.training.rank_watch import RankWatch
from workbench.training.session_start_end import announce, finish, progress_bar
from workbench.training.session_summary import first_leaf_dtype
from workbench.training.stage_memory import METHOD as LIVE_METHOD
from workbench.training.stage_memory import live_tracked
from workbench.training.step import accumulate
from workbench.training.stop_vote import StopVote, VoteResult
from workbench.training.tracker_log import RunTrackers
from workbench.training.train_state import TrainerState

_log = logging.getLogger("workbench")


class _RankLog(logging.LoggerAdapter):
    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        return f"[rank {self.extra['rank']}] {msg}", kwargs


class Trainer:
    """One rank's run. Construct on every rank inside the launched process, then call `fit()`."""

    def __init__(
        self, cfg: RunConfig, task: Task, run_dir: Path, *, progress: bool = False
    ) -> None:
        self.cfg, self.task, self.run, self.progress = cfg, task, RunDir(run_dir), progress
        # The process group, and where this rank sits in the mesh.
        self._init_distributed()
        # What this session counts (a resumed run's counters come from its checkpoint, in fit()).
        self._init_counters()
        # Preemption signals, heartbeat, hang watchdog (collective: if any rank was preempted before
        # it got here, every rank leaves now); then the run directory's lock.
        self.rank_watch = RankWatch(self.run, self.rank, cfg).start()
        self.lock_token = self._hold_lock()
        # The model (one seed on every rank), the data, then the model made parallel with its
        # optimizer. A forked rank inherits the kernel's list: record only this run's data.
        data.reset_used_datasets()
        model = self._build_model()
        train_ds, self.eval_ds = dataset_pair(task, task.build_datasets(cfg))
        self.collate_fn = task.collate_fn(cfg)
        self._parallelize(model)
        # The batch (probed when "auto"), over all ranks of all machines: cfg.global_batch_size
        # counts this machine's num_processes only; then this rank's share of the data.
        if cfg.micro_batch_size == "auto":
            self.cfg = cfg = autobatch.choose(
                cfg, self.parallel, task, train_ds, self.run, self.dims, self.collate_fn
            )
        self._shard_data(train_ds)
        # Dropout masks should differ between data-parallel ranks, yet be reproducible; the ranks of
        # one TP group must draw the same ones (their replicated parameters would drift apart
        # otherwise).
        torch.manual_seed(cfg.seed + 1000 * (self.dp_rank + 1))
        # What a step needs: checkpoints, the stop vote, the non-finite flags, the first step's
        # checks.
        self.checkpoints = Checkpointer(self.accelerator, self.run, cfg, self.parallel)
        self.stop_vote = StopVote(
            self.accelerator, self.run, self.rank_watch, timeout_s=cfg.dist_timeout_s
        )
        self.nonfinite = NonFiniteWatch(self.device)
        self.first_step: FirstStep | None = FirstStep(task, self.parallel, self.accelerator, cfg)
        # What reports on the steps: the step-time breakdown, the device monitor, the trackers, the
        # profiler and the metrics rows.
        self._build_reporting()

    # ---- what __init__ builds --------------------------------------------------------------------
    def _init_distributed(self) -> None:
        """The process group (accelerate's), this rank's place in it and its data-parallel
        coordinate."""
        self.accelerator = build_accelerator(self.cfg, self.run.path)
        self.rank, self.world = self.accelerator.process_index, self.accelerator.num_processes
        self.main, self.device = self.accelerator.is_main_process, self.accelerator.device
        self.log = _RankLog(_log, {"rank": self.rank})
        # Data-parallel coordinate: the ranks of one tensor-parallel group (neighbours) share
        # batches and seed, and so do the stages of one pipeline (pp outermost, so the coordinate
        # wraps every dp_size x tp ranks).
        self.dims = ParallelDims.of(self.cfg, self.world)
        self.dp_world, self.dp_rank = self.dims.dp, self.dims.dp_rank(self.rank)

    def _init_counters(self) -> None:
        """The session's counters and what it keeps for the summary, all empty."""
        self.state = TrainerState()
        self.step_times: list[float] = []
        self.prior_time = 0.0  # training time of earlier sessions of a resumed run
        self.eval_row: dict[str, float] | None = None
        # track_memory: one step's bytes by category, its method
        self.tracked_memory: dict[str, Any] | None = None
        self.ending: dict[str, Any] | None = None  # how a preempted, stopped or diverged run ended
        self.consecutive_skips = 0
        self.lr = 0.0  # the learning rate the last step used (the first param group's)

    def _build_model(self) -> torch.nn.Module:
        """The task's model, identical on every rank (one seed), and what it tells about itself."""
        cfg, task = self.cfg, self.task
        set_seed(cfg.seed)
        model = task.build_model(cfg)
        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"{type(task).__name__}.build_model returned {type(model).__name__}, not a "
                "torch.nn.Module"
            )
        check_trainable(task, model)
        self.n_params = sum(p.numel() for p in model.parameters())
        # before the dtype probe's hook
        self.flops = ModelFlops.of(task, cfg, model, self.device, self.world)
        self.tokens_per_sample = task.tokens_per_sample(cfg)
        if cfg.pp == 1:  # a pipeline rank probes its own chunks once they exist (_parallelize)
            self.compute_dtype = first_leaf_dtype(model, compiled=cfg.compile != "off")
        return model

    def _parallelize(self, model: torch.nn.Module) -> None:
        """The model made parallel by the run's layout, with its optimizer."""
        cfg, task = self.cfg, self.task
        # named before FSDP renames its class
        self.compiled = CompileWatch(cfg, compiled_module(cfg, model))
        self.parallel = parallelize(
            cfg, self.accelerator, model, task, lambda m: build_optimizer(m, cfg, task)
        )
        if self.parallel.pipelined:  # the probe in what this rank runs, not stage 0's part
            self.compute_dtype = first_leaf_dtype(
                self.parallel.module, compiled=cfg.compile != "off"
            )
        self.model = self.parallel.model

    def _shard_data(self, train_ds: Any) -> None:
        """The global batch over all data-parallel ranks, and this rank's share of the data."""
        cfg = self.cfg
        self.global_batch = self.dims.global_batch(cfg.micro_batch_size, cfg.grad_accum_steps)
        self.batches = ShardedBatches(
            train_ds, cfg, self.dp_rank, self.dp_world, self.collate_fn, self.device.type
        )

    def _build_reporting(self) -> None:
        """What reports on the steps. The breakdown is started by fit() and stopped by close():
        model building and data loading are not idle training time."""
        cfg = self.cfg
        self.breakdown = StepBreakdown(self.device, self.parallel.comm_stats)
        self.monitor = monitor.for_rank(
            cfg, self.device, self.rank, self.run.event, self.rank_watch.current_step
        )
        self.trackers = RunTrackers(self.accelerator, self.run)
        self.profiler = StepProfiler(cfg, self.run, self.rank, self.device)
        self.metrics = MetricsLogger(
            self.accelerator,
            self.run,
            cfg,
            global_batch=self.global_batch,
            tokens_per_sample=self.tokens_per_sample,
            flops=self.flops,
            batches=self.batches,
            parallel=self.parallel,
            monitor=self.monitor,
            trackers=self.trackers,
            breakdown=self.breakdown,
            loss_ranks=self.parallel.loss_ranks,
            watch=self.nonfinite,
        )

    def _hold_lock(self) -> str | None:
        """A run launched by workbench is locked by its launcher; one started by hand (multi-node,
        --prepare-only) is locked by rank 0 for as long as it runs."""
        if not self.main or lock.held_by(self.run, os.environ.get("WORKBENCH_LOCK_TOKEN")):
            return None
        return lock.acquire(self.run)

    # ---- the run ---------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        resumed_from = self._resume() if self.cfg.resume else None
        announce(self, resumed_from)
        self.trackers.start(self.cfg, world_size=self.world, global_batch_size=self.global_batch)
        start = (self.state.step, self.state.samples, self.state.tokens)
        if self.monitor is not None:
            self.monitor.start()
        status = self._train()
        return finish(self, status, *start)

    def close(self) -> None:
        """Whatever happened: stop the heartbeat and the device monitor, restore signal handlers,
        close the trackers, give back a lock rank 0 took."""
        if self.monitor is not None:
            self.monitor.stop()
        self.rank_watch.close()
        self.trackers.end()
        if self.lock_token is not None:
            lock.release(self.run, self.lock_token)

    def _train(self) -> Status:
        """Steps until max_steps or an agreed ending; step time runs from one step's start to the
        next, so logging, eval and checkpoints count too."""
        batches = self.batches.iterate(self.state.micro_batches)
        self.model.train()
        bar = progress_bar(self)
        self.compiled.session_starts_at(self.state.step)
        if self.compiled.on and self.main:
            self.run.event("compiling", step=self.state.step + 1, **self.compiled.what())
            if bar is not None:
                bar.set_postfix_str(f"compiling ({self.cfg.compile}, {self.cfg.compile_backend})…")
        # the first window starts with the first step, not when the logger was made
        self.metrics.restart_clock()
        step_start = time.perf_counter()
        try:
            while self.state.step < self.cfg.max_steps:
                with (
                    self.profiler.step(self.state.step + 1),
                    self.compiled.step(self.state.step + 1),
                ):
                    grad_norm, verdict = (
                        self._tracked_step(batches)
                        if self._track_this_step()
                        else self._step(batches)
                    )
                self.breakdown.step_done()
                if self.ending is not None:  # fp16 scaling skipped too many steps in a row
                    return Status.DIVERGED
                if bar is not None:
                    bar.update(1)
                status = after_step(self, grad_norm, verdict, bar)
                if self.compiled.compiled_now:
                    said_compiled(self, bar)
                now = time.perf_counter()
                self.step_times.append(now - step_start)
                step_start = now
                if status is not None:
                    return status
            return Status.COMPLETED
        finally:
            # a run that ends inside profile_steps keeps the steps it recorded
            self.profiler.close()
            if bar is not None:
                bar.close()

    def at(self, step: int, where: str) -> None:
        """Where the rank is: for the hang watchdog, and the step-time breakdown's phase."""
        self.rank_watch.at(step, where)
        self.breakdown.mark(phase_of(where))

    def _tracked_step(self, batches: Iterator[Any]) -> tuple[torch.Tensor | None, VoteResult]:
        """track_memory's step: fetched outside the tracker, as a batch sliced from an in-memory
        dataset would be counted with the whole dataset's storage."""
        self.breakdown.mark("data")
        micro = [next(batches) for _ in range(self.cfg.grad_accum_steps)]
        if self.parallel.split_backward:
            result, report = live_tracked(self.parallel, lambda: self._step(iter(micro)))
            self.tracked_memory = {**report, "method": LIVE_METHOD}
        else:
            result, report = tracked(self.parallel, lambda: self._step(iter(micro)), tuple(micro))
            self.tracked_memory = {**report, "method": tracking_method(self.parallel)}
        return result

    def _step(self, batches: Iterator[Any]) -> tuple[torch.Tensor | None, VoteResult]:
        """One optimizer step: accumulate micro-batches, clip, agree, update; nothing in it reads
        the device. A non-finite loss or gradient norm is noted on the device, for the next read
        point (nonfinite.py)."""
        cfg, parallel, step = self.cfg, self.parallel, self.state.step
        self.lr = set_lr(parallel.optimizer, self.task.lr_scale(step, cfg))
        first, self.first_step = self.first_step, None  # its checks, once per session
        step_loss = accumulate(
            parallel,
            first.task if first else self.task,
            batches,
            cfg.grad_accum_steps,
            self.device,
            at=lambda where: self.at(step, where),
            before_last_backward=self.stop_vote.start,
        )
        self.at(step, "optimizer")
        grad_norm = None
        if cfg.grad_clip > 0 or parallel.scaler is None:
            # With clipping off the norm is still taken (max_norm inf scales nothing): it is what
            # tells an inf gradient under a finite loss.
            grad_norm = parallel.clip_grad_norm(cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
        verdict = self.stop_vote.finish()
        # With fp16 loss scaling an inf gradient is an overflow the scaler skips, not divergence.
        self.nonfinite.note(step + 1, step_loss, grad_norm if parallel.scaler is None else None)
        if first is not None:
            first.check()
        if parallel.step():
            # fp16 overflow: the scaler skipped the update and lowered the scale
            self.state.skipped_steps += 1
            self.consecutive_skips += 1
            if self.consecutive_skips >= cfg.max_skipped_steps:
                why = (
                    f"fp16 loss scaling skipped {self.consecutive_skips} steps in a row "
                    f"(max_skipped_steps={cfg.max_skipped_steps})"
                )
                diverged(self, Divergence(step + 1, why))
                return grad_norm, verdict
        else:
            self.consecutive_skips = 0
        self.state.step += 1
        self.state.micro_batches += cfg.grad_accum_steps
        self.state.samples += self.global_batch
        self.state.tokens += self.global_batch * (self.tokens_per_sample or 0)
        self.metrics.step_done(step_loss)
        return grad_norm, verdict

    # ---- pieces ----------------------------------------------------------------------------------
    def _track_this_step(self) -> bool:
        """track_memory watches the session's second step (steady state), or its only one."""
        if not self.cfg.track_memory or self.tracked_memory is not None:
            return False
        done = len(self.step_times)
        return done == 1 or (done == 0 and self.cfg.max_steps - self.state.step == 1)

    def elapsed_s(self) -> float:
        """Training time over all sessions of the run."""
        return self.prior_time + sum(self.step_times)

    def _resume(self) -> str:
        self.state, ckpt = self.checkpoints.resume()
        self.prior_time = self.state.train_time_s
        self.log.info("resumed from %s at step %d", ckpt, self.state.step)
        return str(ckpt)


def train(cfg: RunConfig, task: Task, run_dir: Path, *, progress: bool = False) -> dict[str, Any]:
    """Run one rank of `cfg` (call on every rank). Returns the summary fields."""
    trainer = Trainer(cfg, task, run_dir, progress=progress)
    try:
        return trainer.fit()
    finally:
        trainer.close()
