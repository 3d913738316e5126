"""The per-rank training loop: the Trainer, in one place. Every rank runs `train()`, which builds a
`Trainer` and calls `fit()`.

`Trainer.__init__` is the recipe: it builds what a run needs, in order, one named step each (the
process group, the counters, the rank's watch and lock, the model, the data, the model made
parallel, the batch decided, this rank's share of the data, what a step needs, what reports on the
steps). `fit()` announces the session, runs the steps and finishes it. A step is micro-batches
with gradient sync held back until the last one, clipping, the stop vote and the update (`_step`);
after it (`_after_step`) come the metrics row, an evaluation and a checkpoint when due, then the
ending the ranks agreed on. The session's finish gathers the summary fields, checks the replicas
and exports the weights.

The module stays whole because all of it is the Trainer's own behaviour over the Trainer's own
state (its counters, its ending, its step times): split into modules, each part would take the
whole Trainer as a parameter again. What needs no Trainer lives beside it: how the model is made
parallel (parallel/), the step's micro-batches (step.py), the stop vote (stop_vote.py), the rank's
watch (rank_watch.py), checkpoints (checkpoint/), what reports on the steps (observe/), the Task's
checks (task_checks.py), the batch probe (autobatch.py) and the weights (weights.py).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import gather_object, set_seed

from workbench import data
from workbench.config import ParallelDims, RunConfig
from workbench.rundir import MetricsRow, RunDir, Status, lock
from workbench.tasks import Task
from workbench.tasks.base import dataset_pair
from workbench.training import autobatch
from workbench.training.accelerator import build_accelerator
from workbench.training.batches import ShardedBatches
from workbench.training.checkpoint import Checkpointer, TrainerState
from workbench.training.compiling import CompileWatch, compile_line, compiled_module
from workbench.training.evaluation import evaluate
from workbench.training.nonfinite import Divergence, NonFiniteWatch
from workbench.training.observe import monitor
from workbench.training.observe.breakdown import StepBreakdown, phase_of
from workbench.training.observe.dtype_probe import first_leaf_dtype
from workbench.training.observe.memory import method as tracking_method
from workbench.training.observe.memory import peak_memory_bytes, tracked
from workbench.training.observe.metrics_log import MetricsLogger
from workbench.training.observe.model_flops import ModelFlops
from workbench.training.observe.profiling import StepProfiler
from workbench.training.observe.stage_memory import METHOD as LIVE_METHOD
from workbench.training.observe.stage_memory import live_tracked
from workbench.training.observe.trackers import RunTrackers
from workbench.training.optim import build_optimizer, set_lr
from workbench.training.parallel import parallelize
from workbench.training.parallel.float8 import facts as float8_facts
from workbench.training.rank_watch import RankWatch
from workbench.training.step import accumulate
from workbench.training.stop_vote import StopVote, VoteResult
from workbench.training.task_checks import FirstStep, UnsyncedReplicas, check_trainable
from workbench.training.weights import safetensors_ready, save_rank_value, state_digest
from workbench.utils.hardware import detect

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
        # The process group, and where this rank sits in the mesh. The rank's device is resolved
        # here, once (build_accelerator); everything below is handed self.device.
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
        # The batch, decided once. It sits here because micro_batch_size='auto' is probed with real
        # steps of the parallel model on the training data, so it comes after both; nothing above
        # reads the batch sizes, and from here on self.cfg is the config every later step reads.
        cfg = self.cfg = self._decide_batch(train_ds)
        # This rank's share of the data (and the global batch over all ranks of all machines:
        # cfg.global_batch_size counts this machine's num_processes only).
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

    def _decide_batch(self, train_ds: Any) -> RunConfig:
        """The run's config with its batch sizes settled: as given, or micro_batch_size='auto'
        probed on every rank from the caller's proposal (collective; autobatch.py)."""
        if self.cfg.micro_batch_size != "auto":
            return self.cfg
        return autobatch.choose(
            self.cfg, self.parallel, self.task, train_ds, self.run, self.dims, self.collate_fn
        )

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
        self._announce(resumed_from)
        self.trackers.start(self.cfg, world_size=self.world, global_batch_size=self.global_batch)
        start = (self.state.step, self.state.samples, self.state.tokens)
        if self.monitor is not None:
            self.monitor.start()
        status = self._train()
        return self._finish(status, *start)

    def close(self) -> None:
        """Whatever happened: stop the heartbeat and the device monitor, restore signal handlers,
        close the trackers, give back a lock rank 0 took."""
        if self.monitor is not None:
            self.monitor.stop()
        self.rank_watch.close()
        self.trackers.end()
        if self.lock_token is not None:
            lock.release(self.run, self.lock_token)

    def _announce(self, resumed_from: str | None) -> None:
        """Rank 0 says the session started (or resumed from a checkpoint): the event, the running
        status and one log line."""
        if not self.main:
            return
        cfg = self.cfg
        self.run.event(
            "resumed" if resumed_from else "started",
            step=self.state.step,
            world_size=self.world,
            device=str(self.device),
            checkpoint=resumed_from,
        )
        # The weights an earlier session exported describe that session only: removed before the
        # summary drops their hash, so a crash between leaves the hash beside the newest checkpoint
        # (what load_model() then loads), never weights beside another session's steps.
        if self.run.drop_exports():
            self.log.info(
                "removed the earlier session's exported weights: this session replaces them"
            )
        self.run.set_status(Status.RUNNING, **self._running_fields(), weights_sha256=None)
        self.log.info(
            "training %s: %d ranks on %s, %s, global batch %d, %d params",
            cfg.task,
            self.world,
            self.device.type,
            cfg.precision,
            self.global_batch,
            self.n_params,
        )

    def _progress_bar(self) -> Any:
        """Rank 0's progress bar over the run's steps, when asked for; None otherwise."""
        if not (self.progress and self.main):
            return None
        # Plain text, not tqdm.auto: a rank is a forked process and can't drive the kernel's
        # widgets; its stderr still reaches the notebook through the kernel's captured file
        # descriptors.
        from tqdm import tqdm

        return tqdm(
            total=self.cfg.max_steps,
            initial=self.state.step,
            desc=f"{self.cfg.task} x{self.world}",
            unit="step",
            dynamic_ncols=True,
        )

    def _train(self) -> Status:
        """Steps until max_steps or an agreed ending; step time runs from one step's start to the
        next, so logging, eval and checkpoints count too."""
        batches = self.batches.iterate(self.state.micro_batches)
        self.model.train()
        bar = self._progress_bar()
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
                status = self._after_step(grad_norm, verdict, bar)
                if self.compiled.compiled_now:
                    self._said_compiled(bar)
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
                self._diverged(Divergence(step + 1, why))
                return grad_norm, verdict
        else:
            self.consecutive_skips = 0
        self.state.step += 1
        self.state.micro_batches += cfg.grad_accum_steps
        self.state.samples += self.global_batch
        self.state.tokens += self.global_batch * (self.tokens_per_sample or 0)
        self.metrics.step_done(step_loss)
        return grad_norm, verdict

    # ---- after a step ----------------------------------------------------------------------------
    def _after_step(
        self, grad_norm: torch.Tensor | None, verdict: VoteResult, bar: Any
    ) -> Status | None:
        """Log, evaluate and checkpoint when due, each after a read of the non-finite flags
        (nonfinite.py), so a diverged state is never logged, evaluated or saved; the status the run
        ends with, if it ends now."""
        cfg, step = self.cfg, self.state.step
        final = step == cfg.max_steps
        # A preempted rank has a grace period to save its state: no eval then.
        evaluate_now = (
            self.eval_ds is not None
            and not verdict.signal
            and bool(final or verdict.stop or (cfg.eval_every and step % cfg.eval_every == 0))
        )
        checkpoint_now = self.checkpoints.due(step, final, verdict.ends)
        if self.metrics.due(step, final) or verdict.ends:
            row = self.metrics.log(self.state, grad_norm, self.elapsed_s(), self.lr)
            if isinstance(row, Divergence):
                return self._diverged(row)
            if bar is not None:
                bar.set_postfix(loss=f"{row.loss:.4f}", samples_s=f"{row.samples_per_s:.0f}")
        elif evaluate_now or checkpoint_now:  # a read point of its own
            found = self.nonfinite.read(self.accelerator)
            if found is not None:
                return self._diverged(found)
        if evaluate_now:
            self._evaluate(step)
        if checkpoint_now:
            self.at(step, "checkpoint")
            self.state.train_time_s = self.elapsed_s()
            with self.metrics.paused():
                self.checkpoints.save(self.state)
            if len(self.checkpoints.stalls) == 1:
                self._check_grace_fits(self.checkpoints.stalls[0])
            if not (final or verdict.ends):
                # A checkpoint is the long pause the vote schedule can't foresee: a stop request or
                # a signal that came while it was written ends the run on it, now, rather than
                # after more steps and another checkpoint (which would not fit preempt_grace_s).
                late = self.stop_vote.after_checkpoint()
                if late.ends:
                    return self._ended_on_checkpoint(late, grad_norm, bar, evaluated=evaluate_now)
        return self._agreed_ending(verdict, final)

    def _check_grace_fits(self, checkpoint_s: float) -> None:
        """Rank 0, after the session's first checkpoint (a fresh run has no earlier times for
        preflight to judge by): a preemption needs a checkpoint and a step or two within
        preempt_grace_s, or it ends as a hang; said once (logged, and an event) when this one didn't
        fit. Synchronous checkpoints only: a background write's time is not known here."""
        if not self.main or self.checkpoints.background is not None:
            return
        step_s = self.step_times[-1] if self.step_times else 0.0
        need = checkpoint_s + 2 * step_s
        if need > self.cfg.preempt_grace_s:
            self.run.event(
                "preempt_grace_short",
                step=self.state.step,
                checkpoint_s=round(checkpoint_s, 3),
                needed_s=round(need, 3),
                preempt_grace_s=self.cfg.preempt_grace_s,
            )
            self.log.warning(
                "the checkpoint of step %d took %.1f s: with preempt_grace_s=%g a preemption "
                "would end as a hang (it needs a checkpoint and a step or two, about %.0f s); "
                "raise preempt_grace_s, or make checkpoints faster",
                self.state.step,
                checkpoint_s,
                self.cfg.preempt_grace_s,
                need,
            )

    def _ended_on_checkpoint(
        self, verdict: VoteResult, grad_norm: torch.Tensor | None, bar: Any, *, evaluated: bool
    ) -> Status:
        """The vote after the step's checkpoint ended the run: it ends on that checkpoint (waited
        for when written in the background, so the ending names it sealed), with the metrics row
        and, for a stop, the evaluation an ending at a voted step has."""
        step = self.state.step
        self.checkpoints.wait()
        if not self.metrics.due(step, False):
            row = self.metrics.log(self.state, grad_norm, self.elapsed_s(), self.lr)
            # the flags were read before the checkpoint and no step ran since
            assert not isinstance(row, Divergence), row
            if bar is not None:
                bar.set_postfix(loss=f"{row.loss:.4f}", samples_s=f"{row.samples_per_s:.0f}")
        if verdict.stop and not verdict.signal and self.eval_ds is not None and not evaluated:
            self._evaluate(step)
        status = self._agreed_ending(verdict, False)
        assert status is not None  # the vote ended the run
        return status

    def _evaluate(self, step: int) -> None:
        """Evaluate this rank's shard of the eval set under the strategy's contexts, and write the
        reduced means as the step's eval row."""
        self.at(step, "evaluation")
        self.eval_row = evaluate(
            self.model,
            self.task,
            self.eval_ds,
            self.cfg,
            self.accelerator,
            self.collate_fn,
            self.parallel.forward_context,
            shard=(self.dp_rank, self.dp_world),
            eval_loss=self.parallel.eval_loss,
            batch_context=self.parallel.batch_context,
        )
        self.metrics.write(MetricsRow.for_eval(step, self.eval_row))
        self.metrics.restart_clock()

    def _agreed_ending(self, verdict: VoteResult, final: bool) -> Status | None:
        """The ending the stop vote agreed on (a preemption, then a stop), else completed at the
        last step, else None: the run goes on."""
        step = self.state.step
        if verdict.signal:
            name = signal.Signals(verdict.signal).name
            return self._ended(
                Status.PREEMPTED,
                signal=name,
                message=f"{name} at step {step}: the ranks checkpointed and exited",
            )
        if verdict.stop:
            return self._ended(Status.STOPPED)
        return Status.COMPLETED if final else None

    def _said_compiled(self, bar: Any) -> None:
        """A step that compiled: said once (the first), and left out of the pace its window
        reports."""
        self.metrics.untime_steps_so_far()
        step, seconds = self.compiled.compiling_steps[-1]
        if len(self.compiled.compiling_steps) == 1 and self.main:
            self.run.event("compiled", step=step, seconds=round(seconds, 3))
            self.log.info(
                "compiled (%s, %s) in the first step: %.1f s",
                self.cfg.compile,
                self.cfg.compile_backend,
                seconds,
            )
            if bar is not None:
                bar.set_postfix_str(f"compiled in {seconds:.1f} s")

    # ---- endings other than completing: stopped, preempted, diverged ----------------------------
    def _ended(self, status: Status, **details: Any) -> Status:
        """A stop or a preemption, at the step the ranks agreed on (its checkpoint already saved).
        Every rank keeps the `ending` the summary records; rank 0 records the event."""
        step, ckpt = self.state.step, self.run.latest_checkpoint()
        self.ending = {"step": step, "checkpoint": str(ckpt) if ckpt else None, **details}
        if self.main:
            self.run.event(status.value, **self.ending)
        return status

    def _diverged(self, found: Divergence) -> Status:
        """The run diverged at `found.step`: record it, nothing more saved. The steps from it on
        (read at a later read point, nonfinite.py) trained on a spoilt state: the counters go back
        to the last good step, which is what the summary reports as trained. A checkpoint still
        being written in the background holds a state from before the bad step (read points come
        before every save): it is waited for first, so the ending names the last sealed checkpoint,
        or says what became of that write. Nothing is exported (_finish); the weights of an
        earlier session were removed when this one started (_announce), so load_model() loads
        the last good checkpoint."""
        cfg, state = self.cfg, self.state
        if self.checkpoints.pending is not None:
            self.at(state.step, "checkpoint")
        unsealed = self.checkpoints.settle()
        spoilt = max(0, state.step - (found.step - 1))
        state.step -= spoilt
        state.micro_batches -= spoilt * cfg.grad_accum_steps
        state.samples -= spoilt * self.global_batch
        state.tokens -= spoilt * self.global_batch * (self.tokens_per_sample or 0)
        ckpt = self.run.latest_checkpoint()
        where = f"last good checkpoint: {ckpt}" if ckpt else "no checkpoint was saved before it"
        if unsealed:
            where += f" ({unsealed})"
        self.ending = {
            "step": found.step,
            "reason": found.reason,
            "last_checkpoint": str(ckpt) if ckpt else None,
            "message": f"diverged at step {found.step}: {found.reason}; {where}",
            **({"unsealed_checkpoint": unsealed} if unsealed else {}),
        }
        if self.main:
            self.run.event("diverged", **self.ending)
        return Status.DIVERGED

    # ---- the session's finish: the summary, the replica check, the weights -----------------------
    def _finish(self, status: Status, steps0: int, samples0: int, tokens0: int) -> dict[str, Any]:
        """The session's summary fields (rates over this session's steps, from the counters it
        started with); unless it diverged, the replica check, the exported weights and the task's
        rank value. Rank 0 writes the final status and the step times. Returns the fields."""
        self.at(self.state.step, "finishing")
        session_time = sum(self.step_times) or 1e-9
        tokens = self.state.tokens - tokens0
        fields = self._summary_fields(
            samples_per_s=(self.state.samples - samples0) / session_time,
            tokens_per_s=tokens / session_time if tokens else None,
            steps_run=self.state.step - steps0,
        )
        if status is not Status.DIVERGED:
            self._check_replicas(fields)
            fields["weights_sha256"] = self._export_weights()
            value = self.task.rank_value(self.parallel.model, self.cfg)
            if value is not None:
                save_rank_value(self.run, self.rank, value)
        fields["checkpoints"] = self.checkpoints.finish()  # waits for a write still in flight
        if self.compiled.on:
            fields["compile"] = self._compile_report()
        if self.main:
            self.run.set_status(status, **self._running_fields(), **fields, ending=self.ending)
            self.run.write_timings(self.step_times)
            if status is Status.COMPLETED:
                self.run.event("completed", step=self.state.step)
        self.accelerator.wait_for_everyone()
        return fields

    def _running_fields(self) -> dict[str, Any]:
        """Summary fields known once the ranks are up: what runs where."""
        hw = detect()  # the machine's description; the device itself is self.device
        cuda = self.device.type == "cuda"
        return {
            "run_name": self.cfg.run_name,
            "task": self.cfg.task,
            "world_size": self.world,
            "parallelism": self.cfg.parallelism,
            "tp": self.cfg.tp,
            "mesh": self.dims.sizes,
            "precision": self.cfg.precision,
            "device": hw.device_line(self.device.type),
            "device_class": hw.device_class if cuda else "cpu",
            "global_batch_size": self.global_batch,
            "micro_batch_size": self.cfg.micro_batch_size,
            "grad_accum_steps": self.cfg.grad_accum_steps,
            "n_params": self.n_params,
            "data": data.used_datasets(),
        }

    def _rank_info(self) -> list[dict[str, Any]]:
        """Every rank's pid, device, compute dtype, threads, peak memory and weights digest, in rank
        order (collective)."""
        parallel = self.parallel
        mine = {
            "rank": self.rank,
            "pid": os.getpid(),
            "device": str(self.device),
            "compute_dtype": self.compute_dtype.get("dtype"),
            "mixed_precision": self.accelerator.mixed_precision,
            "distributed_type": str(self.accelerator.distributed_type).split(".")[-1],
            "world_size": self.world,
            "torch_threads": torch.get_num_threads(),
            "peak_memory_bytes": peak_memory_bytes(self.device),
            "parallelism": parallel.name,
            "sharded": parallel.sharded,
            **parallel.facts(),
            **float8_facts(parallel.module, parallel.float8),
            # fp16: the loss scale the run ended with (it halves at each overflow the scaler
            # skipped)
            "loss_scale": parallel.scaler.get_scale() if parallel.scaler is not None else None,
            "agreement_votes": self.stop_vote.votes,
            "fused_optimizer": bool(parallel.local_optimizer().defaults.get("fused")),
            "tf32": self.device.type == "cuda"
            and torch.get_float32_matmul_precision() != "highest",
            **{f"{kind}_bytes": n for kind, n in parallel.held_bytes.items()},
            "weights_sha256": parallel.weights_digest(),
            "tracked_memory": self.tracked_memory,
            "profile_trace": str(self.profiler.trace) if self.profiler.trace else None,
        }
        return gather_object([mine]) if self.world > 1 else [mine]

    def _summary_fields(
        self, *, samples_per_s: float, tokens_per_s: float | None, steps_run: int
    ) -> dict[str, Any]:
        """Summary fields at the end of a session (collective: every rank calls it)."""
        ranks = self._rank_info()
        last_row = self.metrics.last_row
        return {
            "steps": self.state.step,
            "steps_this_session": steps_run,
            "final_loss": last_row.loss if last_row else None,
            "samples_per_s": samples_per_s,
            "tokens_per_s": tokens_per_s,
            "peak_memory_bytes": max(r["peak_memory_bytes"] for r in ranks),
            "peak_memory_bytes_per_rank": [r["peak_memory_bytes"] for r in ranks],
            "skipped_steps": self.state.skipped_steps,
            "train_time_s": self.elapsed_s(),
            "ranks": ranks,
            "eval": dict(self.eval_row or {}),
            "mfu": self.flops.mfu(samples_per_s),
        }

    def _check_replicas(self, fields: dict[str, Any]) -> None:
        """Collective, at the end: the replicas of a replicated layout (every rank holds the whole
        model) end with the same parameters, or every rank raises UnsyncedReplicas, rank 0 first
        recording what the ranks reported (their digests and gradient syncs). Buffers are left out:
        DDP broadcasts them at each forward, and a last forward in training mode updates each
        rank's running statistics from its own batch."""
        if (
            self.world == 1
            or self.parallel.sharded
            or len({r["weights_sha256"] for r in fields["ranks"]}) == 1
        ):
            # the whole states are equal (their digests are taken anyway): nothing more to compare
            return
        digests = gather_object([state_digest(dict(self.parallel.module.named_parameters()))])
        if len(set(digests)) == 1:
            return
        if self.main:
            self.run.set_status(Status.RUNNING, **self._running_fields(), **fields)
        syncs = [r.get("gradient_syncs") for r in fields["ranks"]]
        raise UnsyncedReplicas.at_end(self.cfg.parallelism, digests, syncs)

    def _export_weights(self) -> str | None:
        """Write the full weights once, as model.safetensors (loadable without torch.distributed),
        whatever the parallelism; returns their sha256 on rank 0. Collective: every rank calls
        it."""
        from safetensors.torch import save

        full = self.parallel.full_weights()
        if not self.main:
            return None
        tensors = safetensors_ready(full)
        metadata = {
            "task": str(self.cfg.task),
            "step": str(self.state.step),
            "parallelism": self.cfg.parallelism,
            "world_size": str(self.world),
        }
        self.run.write_weights(save(tensors, metadata=metadata))
        return state_digest(tensors)

    def _compile_report(self) -> dict[str, Any]:
        """Once per run (rank 0 tells): what compiling cost and found; graph breaks and
        recompilations warned."""
        report = self.compiled.report()
        if self.main:
            self.run.event("compile_report", **report)
            if report["graph_breaks"] or report["recompiles"]:
                breaks = "; ".join(f"{n} x {why}" for why, n in report["graph_breaks"].items())
                self.log.warning(
                    "compile: %s (graph breaks: %s)", compile_line(report), breaks or "none"
                )
        return report

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
    except Exception as e:
        # On a full disk, the ending names the checkpoint being written in the background (what
        # filled it), not whichever write of this rank's loop met the full disk first.
        write = trainer.checkpoints.filled_the_disk(e)
        if write is None:
            raise
        raise write from e
    finally:
        trainer.close()
