"""The per-rank training loop, on Hugging Face Accelerate.

Every rank runs `train()`. Accelerate owns the process group, DDP wrapping, autocast, loss scaling and
checkpoint state; this module adds what a run needs around it: a data order that can resume at any
micro-batch, the LR schedule, accumulation without needless all-reduces, metrics, stop requests and
atomic checkpoints.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator

import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs, gather_object, send_to_device, set_seed
from torch.utils.data import DataLoader, DistributedSampler

from . import data, rundir
from .config import RunConfig
from .hardware import detect
from .metrics import lr_at, peak_flops, peak_memory_bytes, weights_digest
from .tasks import Task

_log = logging.getLogger("workbench")
STOP_CHECK_EVERY = 5
"""Steps between stop-request checks: a tiny all-reduce, amortised so it stays out of step time."""


class _RankLog(logging.LoggerAdapter):
    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        return f"[rank {self.extra['rank']}] {msg}", kwargs


@dataclasses.dataclass
class TrainerState:
    """Progress saved with every checkpoint (trainer_state.json); enough to continue bit for bit."""

    step: int = 0
    micro_batches: int = 0
    """Micro-batches each rank has consumed: the position in the deterministic data order."""
    samples: int = 0
    tokens: int = 0
    skipped_steps: int = 0
    train_time_s: float = 0.0


class ShardedBatches:
    """This rank's micro-batches in a fixed order (DistributedSampler: seed, new shuffle each epoch),
    startable at any micro-batch so a resumed run sees exactly the data an uninterrupted one would."""

    def __init__(self, dataset: Any, cfg: RunConfig, rank: int, world: int, collate_fn: Any) -> None:
        self.dataset, self.cfg, self.collate_fn = dataset, cfg, collate_fn
        self.sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True,
                                          seed=cfg.seed, drop_last=True)
        self.per_epoch = len(self.sampler) // cfg.micro_batch_size
        if self.per_epoch == 0:
            raise ValueError(f"micro_batch_size={cfg.micro_batch_size}: the training set has {len(dataset)} "
                             f"samples, {len(self.sampler)} per rank over {world} rank(s), fewer than one "
                             "micro-batch; lower micro_batch_size or num_processes")

    def epoch_of(self, micro_batch: int) -> int:
        return micro_batch // self.per_epoch

    def iterate(self, start: int) -> Iterator[Any]:
        epoch, offset = divmod(start, self.per_epoch)
        mbs = self.cfg.micro_batch_size
        while True:
            self.sampler.set_epoch(epoch)
            indices = list(self.sampler)[offset * mbs:self.per_epoch * mbs]
            # A DataLoader draws its workers' base seed from the global RNG unless given a generator; that
            # draw would shift dropout after a resume, which starts a fresh iterator mid-epoch.
            yield from DataLoader(self.dataset, batch_size=mbs, sampler=indices, drop_last=True,
                                  collate_fn=self.collate_fn, num_workers=self.cfg.num_workers,
                                  generator=torch.Generator().manual_seed(self.cfg.seed + epoch))
            epoch, offset = epoch + 1, 0


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices and embeddings, not biases or norm gains (GPT-2/nanoGPT convention)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_accelerator(cfg: RunConfig) -> Accelerator:
    """An Accelerator that really is what cfg asks for.

    Two accelerate behaviours are corrected here: without cpu=True, forked CPU ranks never form a process
    group (N separate copies), and the precision is passed explicitly rather than through notebook_launcher,
    whose mixed_precision argument never reaches the workers.
    """
    device = cfg.resolved_device()
    if device == "cpu":
        # A forked rank inherits the parent's intra-op thread pool; N ranks x all cores of OpenMP threads
        # oversubscribe the machine several times over. Each rank gets its share of the cores.
        torch.set_num_threads(detect().threads_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", cfg.num_processes))))
    accelerator = Accelerator(
        cpu=device == "cpu",
        mixed_precision="no" if cfg.precision == "fp32" else cfg.precision,
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.dist_timeout_s))],
    )
    # A launcher that sets WORLD_SIZE (torchrun, elastic, multi-node) knows the real size; else it's ours.
    expected = int(os.environ.get("WORLD_SIZE", cfg.num_processes))
    if accelerator.num_processes != expected:
        raise RuntimeError(f"expected {expected} ranks but accelerate formed a group of "
                           f"{accelerator.num_processes}: the processes would train as separate copies, "
                           "not one distributed job")
    return accelerator


def _first_leaf_dtype(model: torch.nn.Module) -> dict[str, str]:
    """Record the dtype the first Linear/Conv actually computes in: proof that autocast is on."""
    seen: dict[str, str] = {}
    leaf = next((m for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d))),
                None)
    if leaf is None:
        return seen

    def hook(_m: Any, _i: Any, out: Any) -> None:
        if isinstance(out, torch.Tensor) and "dtype" not in seen:
            seen["dtype"] = str(out.dtype).removeprefix("torch.")
            handle.remove()

    handle = leaf.register_forward_hook(hook)
    return seen


def _split_loss(out: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    loss, extras = out if isinstance(out, tuple) else (out, {})
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise TypeError(f"Task.loss must return a scalar tensor (or (tensor, dict)), got {type(loss).__name__}"
                        + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else ""))
    return loss, extras


class Trainer:
    """One rank's run. Construct on every rank inside the launched process, then call `fit()`."""

    def __init__(self, cfg: RunConfig, task: Task, run_dir: Path, *, progress: bool = False) -> None:
        self.cfg, self.task, self.run_dir, self.progress = cfg, task, Path(run_dir), progress
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
        self.compute_dtype = _first_leaf_dtype(model)
        train_ds, self.eval_ds = task.build_datasets(cfg)
        self.collate_fn = task.collate_fn(cfg)
        self.batches = ShardedBatches(train_ds, cfg, self.rank, self.world, self.collate_fn)
        optimizer = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr)
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        # Dropout masks should differ between ranks, yet be reproducible.
        torch.manual_seed(cfg.seed + 1000 * (self.rank + 1))

    # ---- the loop -------------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        cfg, acc = self.cfg, self.accelerator
        resumed_from = self._resume() if cfg.resume else None
        if self.main:
            rundir.event(self.run_dir, "resumed" if resumed_from else "started", step=self.state.step,
                         world_size=self.world, device=str(self.device), checkpoint=resumed_from)
            self._write_summary("running")
            self.log.info("training %s: %d ranks on %s, %s, global batch %d, %d params", cfg.task, self.world,
                          self.device.type, cfg.precision, self.global_batch, self.n_params)

        batches = self.batches.iterate(self.state.micro_batches)
        self.model.train()
        bar = self._progress_bar()
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        window_steps, window_start = 0, time.perf_counter()
        grad_norm: torch.Tensor | None = None
        session_samples, session_tokens = 0, 0
        self.prior_time = self.state.train_time_s  # training time of earlier sessions of a resumed run
        status, eval_row, last_row = "completed", None, None
        steps_at_start = self.state.step

        step_start = time.perf_counter()
        while self.state.step < cfg.max_steps:
            for group in self.optimizer.param_groups:
                group["lr"] = lr_at(self.state.step, cfg)
            for micro in range(cfg.grad_accum_steps):
                batch = send_to_device(next(batches), self.device)
                last = micro == cfg.grad_accum_steps - 1
                # Gradients are all-reduced only on the micro-batch that ends the step.
                with nullcontext() if last else acc.no_sync(self.model):
                    loss, _ = _split_loss(self.task.loss(self.model, batch))
                    acc.backward(loss / cfg.grad_accum_steps)
                loss_sum += loss.detach().double() / cfg.grad_accum_steps
            if cfg.grad_clip > 0:
                grad_norm = acc.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
            self.optimizer.step()
            if acc.scaler is not None and acc.optimizer_step_was_skipped:
                self.state.skipped_steps += 1  # fp16 overflow: the scaler skipped the update and lowered the scale
            self.optimizer.zero_grad(set_to_none=True)
            self.state.step += 1
            self.state.micro_batches += cfg.grad_accum_steps
            self.state.samples += self.global_batch
            session_samples += self.global_batch
            if self.tokens_per_sample:
                self.state.tokens += self.global_batch * self.tokens_per_sample
                session_tokens += self.global_batch * self.tokens_per_sample
            window_steps += 1
            if bar is not None:
                bar.update(1)

            step, final = self.state.step, self.state.step == cfg.max_steps
            stop = False
            if step % cfg.log_every == 0 or final:
                row, stop = self._sync_metrics(loss_sum / window_steps, window_steps, window_start, grad_norm)
                last_row = row
                loss_sum.zero_()
                window_steps, window_start = 0, time.perf_counter()
                if bar is not None:
                    bar.set_postfix(loss=f"{row['loss']:.4f}", samples_s=f"{row['samples_per_s']:.0f}")
            elif step % STOP_CHECK_EVERY == 0:
                stop = self._stop_agreed()
            if self.eval_ds is not None and (final or stop or (cfg.eval_every and step % cfg.eval_every == 0)):
                eval_row = self.evaluate()
                if self.main:
                    rundir.append_jsonl(self.run_dir / rundir.METRICS, {"step": step, **eval_row})
                window_start = time.perf_counter()  # eval time is not step time
            if final or stop or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0):
                self.state.train_time_s = self.prior_time + sum(self.step_times)
                self.save_checkpoint()
                window_start = time.perf_counter()
            # Step time runs from one step's start to the next: logging, eval and checkpoints count too.
            now = time.perf_counter()
            self.step_times.append(now - step_start)
            step_start = now
            if stop:
                status = "stopped"
                if self.main:
                    rundir.event(self.run_dir, "stopped", step=step)
                break
        if bar is not None:
            bar.close()

        session_time = sum(self.step_times) or 1e-9
        summary = self._final_summary(last_row, eval_row, session_samples / session_time,
                                      session_tokens / session_time if session_tokens else None,
                                      self.state.step - steps_at_start)
        if self.main:
            self._write_summary(status, summary)
            rundir.write_json(self.run_dir / rundir.TIMINGS, {"step_time_s": self.step_times})
            if status == "completed":
                rundir.event(self.run_dir, "completed", step=self.state.step)
        acc.wait_for_everyone()
        return summary

    # ---- pieces ---------------------------------------------------------------------------------------
    def _progress_bar(self) -> Any:
        if not (self.progress and self.main):
            return None
        # Plain text, not tqdm.auto: a rank is a forked process and can't drive the kernel's widgets; its
        # stderr still reaches the notebook through the kernel's captured file descriptors.
        from tqdm import tqdm

        return tqdm(total=self.cfg.max_steps, initial=self.state.step, desc=f"{self.cfg.task} x{self.world}",
                    unit="step", dynamic_ncols=True)

    def _stop_agreed(self) -> bool:
        flag = torch.tensor([float(self.main and rundir.stop_requested(self.run_dir))], device=self.device)
        return bool(self.accelerator.reduce(flag, "sum").item() > 0)

    def _sync_metrics(self, mean_loss: torch.Tensor, steps: int, window_start: float,
                      grad_norm: torch.Tensor | None) -> tuple[dict[str, Any], bool]:
        """One all-gather per log step: loss, peak memory, skipped steps and the stop flag of every rank."""
        cfg = self.cfg
        local = torch.tensor([mean_loss.item(), peak_memory_bytes(self.device), self.state.skipped_steps,
                              float(self.main and rundir.stop_requested(self.run_dir))],
                             device=self.device, dtype=torch.float64)
        everyone = self.accelerator.gather(local.unsqueeze(0)).cpu()
        elapsed = time.perf_counter() - window_start
        step_time = elapsed / steps
        row: dict[str, Any] = {
            "step": self.state.step,
            "epoch": self.batches.epoch_of(max(0, self.state.micro_batches - 1)),
            "loss": float(everyone[:, 0].mean()),
            "lr": lr_at(self.state.step - 1, cfg),
            "step_time_s": step_time,
            "samples_per_s": self.global_batch / step_time,
            "peak_memory_bytes": int(everyone[:, 1].max()),
            "peak_memory_bytes_per_rank": [int(v) for v in everyone[:, 1]],
            "skipped_steps": int(everyone[:, 2].max()),
            "samples": self.state.samples,
            "elapsed_s": self.prior_time + sum(self.step_times),
            "eta_s": step_time * (cfg.max_steps - self.state.step),
        }
        if grad_norm is not None:
            row["grad_norm"] = float(grad_norm)
        if self.tokens_per_sample:
            row["tokens_per_s"] = row["samples_per_s"] * self.tokens_per_sample
        mfu = self._mfu(row["samples_per_s"])
        if mfu is not None:
            row["mfu"] = mfu
        if self.main:
            rundir.append_jsonl(self.run_dir / rundir.METRICS, row)
        return row, bool(everyone[:, 3].max() > 0)

    def _mfu(self, samples_per_s: float) -> float | None:
        if not (self.peak_flops and self.flops_per_sample):
            return None
        return self.flops_per_sample * samples_per_s / self.world / self.peak_flops

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Mean loss (and task metrics) over the eval set, every rank evaluating its shard."""
        cfg = self.cfg
        sampler = DistributedSampler(self.eval_ds, num_replicas=self.world, rank=self.rank, shuffle=False)
        loader = DataLoader(self.eval_ds, batch_size=cfg.micro_batch_size, sampler=sampler,
                            collate_fn=self.collate_fn)
        self.model.eval()
        totals: dict[str, torch.Tensor] = {}
        count = torch.zeros((), device=self.device, dtype=torch.float64)
        for i, batch in enumerate(loader):
            if cfg.eval_batches and i >= cfg.eval_batches:
                break
            batch = send_to_device(batch, self.device)
            loss, extras = _split_loss(self.task.loss(self.model, batch))
            n = len(batch[0]) if isinstance(batch, (tuple, list)) else cfg.micro_batch_size
            for name, value in {"loss": loss, **extras}.items():
                value = torch.as_tensor(value, device=self.device, dtype=torch.float64)
                totals[name] = totals.get(name, torch.zeros((), device=self.device, dtype=torch.float64)) + value * n
            count += n
        self.model.train()
        names = sorted(totals)
        stacked = torch.stack([totals[k] for k in names] + [count])
        summed = self.accelerator.reduce(stacked, "sum").cpu()
        return {f"eval_{k}": float(summed[i] / summed[-1]) for i, k in enumerate(names)}

    def save_checkpoint(self) -> Path:
        """Accelerate's full state into checkpoints/.tmp-step_N, then renamed: a crash leaves the last good one."""
        acc, step = self.accelerator, self.state.step
        root = self.run_dir / rundir.CHECKPOINTS
        tmp, final = root / f".tmp-step_{step}", root / f"step_{step}"
        if self.main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        acc.save_state(str(tmp))
        acc.wait_for_everyone()
        if self.main:
            rundir.write_json(tmp / rundir.COMPLETE_MARKER, dataclasses.asdict(self.state))
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            for _, old in rundir.checkpoint_dirs(self.run_dir)[:-self.cfg.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
            rundir.event(self.run_dir, "checkpoint_saved", step=step, path=str(final))
        acc.wait_for_everyone()
        return final

    def _resume(self) -> str:
        ckpt = rundir.latest_checkpoint(self.run_dir)
        if ckpt is None:
            raise FileNotFoundError(f"resume=True but {self.run_dir} has no complete checkpoint")
        self.accelerator.load_state(str(ckpt))
        saved = rundir.read_json(ckpt / rundir.COMPLETE_MARKER) or {}
        self.state = TrainerState(**{k: v for k, v in saved.items() if k in TrainerState.__dataclass_fields__})
        if self.main:
            rundir.set_aside_metrics_after(self.run_dir, self.state.step)
        self.log.info("resumed from %s at step %d", ckpt, self.state.step)
        return str(ckpt)

    def _rank_info(self) -> list[dict[str, Any]]:
        mine = {"rank": self.rank, "pid": os.getpid(), "device": str(self.device),
                "compute_dtype": self.compute_dtype.get("dtype"),
                "mixed_precision": self.accelerator.mixed_precision,
                "distributed_type": str(self.accelerator.distributed_type).split(".")[-1],
                "world_size": self.world, "torch_threads": torch.get_num_threads(),
                "peak_memory_bytes": peak_memory_bytes(self.device),
                "weights_sha256": weights_digest(self.accelerator.unwrap_model(self.model))}
        return gather_object([mine]) if self.world > 1 else [mine]

    def _final_summary(self, last_row: dict[str, Any] | None, eval_row: dict[str, Any] | None,
                       samples_per_s: float, tokens_per_s: float | None, steps_run: int) -> dict[str, Any]:
        ranks = self._rank_info()
        summary: dict[str, Any] = {
            "steps": self.state.step,
            "steps_this_session": steps_run,
            "final_loss": last_row["loss"] if last_row else None,
            "samples_per_s": samples_per_s,
            "tokens_per_s": tokens_per_s,
            "peak_memory_bytes": max(r["peak_memory_bytes"] for r in ranks),
            "peak_memory_bytes_per_rank": [r["peak_memory_bytes"] for r in ranks],
            "skipped_steps": self.state.skipped_steps,
            "train_time_s": self.prior_time + sum(self.step_times),
            "ranks": ranks,
        }
        if eval_row:
            summary.update(eval_row)
        mfu = self._mfu(samples_per_s)
        if mfu is not None:
            summary["mfu"] = mfu
        return summary

    def _write_summary(self, status: str, extra: dict[str, Any] | None = None) -> None:
        hw = detect()
        previous = rundir.read_json(self.run_dir / rundir.SUMMARY) or {}
        started = previous.get("started_at", time.time())
        rundir.write_json(self.run_dir / rundir.SUMMARY, {
            "status": status, "run_name": self.cfg.run_name, "task": self.cfg.task,
            "world_size": self.world, "parallelism": self.cfg.parallelism, "precision": self.cfg.precision,
            "device": hw.describe(self.device.type), "device_class": hw.device_class if self.device.type == "cuda"
            else "cpu", "global_batch_size": self.global_batch, "n_params": self.n_params,
            "started_at": started, "wall_time_s": time.time() - started,
            "data": data.used_datasets(), **(extra or {}),
        })


def train(cfg: RunConfig, task: Task, run_dir: Path, *, progress: bool = False) -> dict[str, Any]:
    """Run one rank of `cfg` (call on every rank). Returns the summary."""
    return Trainer(cfg, task, run_dir, progress=progress).fit()
