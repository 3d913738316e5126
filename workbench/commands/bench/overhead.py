"""`workbench bench overhead`: the trainer against a hand-written Accelerate loop, side by side in one run.

Both train the same model on the same data with the same seed, on the same number of forked ranks, and
are interleaved in pairs, which goes first alternating (A B, B A, ...), so machine noise hits both alike.
Reported: median step time of each after warm-up, the ratio, the overhead per step (the median over the
back-to-back pairs of their difference, so a machine that speeds up or slows down between pairs doesn't
count), and whether the final weights are bitwise equal. The verdict is on that median: a typical step. The
mean step times are reported beside it: they also carry what the trainer does every log_every steps (one
all-gather, a metrics row, the trackers).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import multiprocessing
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from workbench.config import RunConfig
from workbench.config.precision import accelerate_mixed_precision
from workbench.config.preflight import preflight
from workbench.launcher.launch import launch
from workbench.launcher.processes import free_port
from workbench.tasks import Task, get_task
from workbench.tasks.schedule import lr_at
from workbench.training.measures import weights_digest
from workbench.training.optim import build_optimizer
from workbench.utils.files import read_json
from workbench.utils.hardware import detect, resolve_device

log = logging.getLogger("workbench")
WARMUP_STEPS = 10

BENCH = RunConfig(task="digits", num_processes=2, device="cpu", precision="fp32", micro_batch_size=64,
                  max_steps=200, lr=1e-3, warmup_steps=10, weight_decay=0.01, log_every=10, seed=0,
                  task_options={"hidden": 512})


def hand_loop(cfg: RunConfig, task: Task, out_dir: str) -> None:
    """The loop a careful user would write by hand with Accelerate: no run directory, no metrics, no stop
    checks. It mirrors the trainer's numerics exactly (init seed, data order, LR, clipping, AdamW) so the
    weights can be compared bit for bit."""
    from accelerate import Accelerator
    from accelerate.utils import send_to_device, set_seed
    from torch.utils.data import DataLoader, DistributedSampler

    if resolve_device(cfg) == "cpu":  # the same thread share the trainer gives each rank
        torch.set_num_threads(detect().threads_per_rank(cfg.num_processes))
    acc = Accelerator(cpu=resolve_device(cfg) == "cpu",
                      mixed_precision=accelerate_mixed_precision(cfg.precision))
    set_seed(cfg.seed)
    model = task.build_model(cfg)
    train_ds, _ = task.build_datasets(cfg)
    optimizer = build_optimizer(model, cfg, task)
    model, optimizer = acc.prepare(model, optimizer)
    torch.manual_seed(cfg.seed + 1000 * (acc.process_index + 1))
    sampler = DistributedSampler(train_ds, num_replicas=acc.num_processes, rank=acc.process_index,
                                 shuffle=True, seed=cfg.seed, drop_last=True)
    times, step, epoch = [], 0, 0
    start = time.perf_counter()
    while step < cfg.max_steps:
        sampler.set_epoch(epoch)
        loader = DataLoader(train_ds, batch_size=cfg.micro_batch_size, sampler=sampler, drop_last=True,
                            generator=torch.Generator().manual_seed(cfg.seed + epoch))
        for batch in loader:
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, cfg)
            loss = task.loss(model, send_to_device(batch, acc.device))
            loss = loss[0] if isinstance(loss, tuple) else loss
            acc.backward(loss)
            acc.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            now = time.perf_counter()
            times.append(now - start)
            start = now
            if step == cfg.max_steps:
                break
        epoch += 1
    digest = weights_digest(acc.unwrap_model(model))
    if acc.is_main_process:
        Path(out_dir, "hand.json").write_text(json.dumps({"step_time_s": times, "weights_sha256": digest}))
    acc.wait_for_everyone()


def _run_hand_loop(cfg: RunConfig, out_dir: str) -> dict:
    def target() -> None:
        from accelerate import notebook_launcher

        with contextlib.redirect_stdout(io.StringIO()):  # accelerate says "2 CUDAs" even on a CPU box
            notebook_launcher(hand_loop, args=(cfg, get_task(cfg.task), out_dir), num_processes=cfg.num_processes,
                              use_port=str(free_port()))

    proc = multiprocessing.get_context("fork").Process(target=target)
    proc.start()
    proc.join()
    if proc.exitcode != 0:
        raise RuntimeError(f"hand-written loop failed (exit code {proc.exitcode})")
    return json.loads(Path(out_dir, "hand.json").read_text())


@dataclass
class OverheadReport:
    steps: int
    num_processes: int
    repeats: int
    trainer_median_s: float
    hand_median_s: float
    trainer_mean_s: float
    hand_mean_s: float
    ratio: float
    overhead_ms: float
    budget_ms: float
    weights_equal: bool
    device: str
    log_every: int

    @property
    def passed(self) -> bool:
        return self.weights_equal and self.overhead_ms <= self.budget_ms

    def table(self) -> str:
        return "\n".join([
            f"workbench bench overhead: {self.num_processes} ranks on {self.device}, {self.steps} steps x "
            f"{self.repeats} repeats, median after {WARMUP_STEPS} warm-up steps",
            f"  hand-written loop   {self.hand_median_s * 1e3:8.3f} ms/step",
            f"  workbench trainer   {self.trainer_median_s * 1e3:8.3f} ms/step",
            f"  ratio               {self.ratio:8.4f}",
            f"  means               {self.hand_mean_s * 1e3:8.3f} / {self.trainer_mean_s * 1e3:.3f} ms/step (hand / "
            f"trainer; the trainer's include its logging steps, every {self.log_every})",
            f"  overhead            {self.overhead_ms:8.3f} ms/step, median of the {self.repeats} back-to-back pairs' "
            f"differences (budget 1% + 1 ms = {self.budget_ms:.3f} ms)",
            f"  weights bitwise equal: {self.weights_equal}",
            f"  verdict: {'PASS' if self.passed else 'FAIL'}",
        ])


def overhead(steps: int = 200, repeats: int = 9, num_processes: int = 2, cfg: RunConfig | None = None,
             json_path: Path | None = None) -> OverheadReport:
    """Measure the trainer's per-step overhead over a hand-written loop (see module docstring)."""
    cfg = (cfg or BENCH).replace(max_steps=steps, num_processes=num_processes)
    preflight(cfg)
    if steps <= WARMUP_STEPS:
        raise ValueError(f"steps={steps}: must exceed the {WARMUP_STEPS} warm-up steps")
    trainer_times: list[float] = []
    hand_times: list[float] = []
    paired: list[float] = []
    equal = True
    with tempfile.TemporaryDirectory(prefix="workbench-bench-") as tmp:

        def trainer(i: int) -> tuple[list[float], set[str]]:
            result = launch(cfg.replace(runs_dir=tmp, run_name=f"trainer-{i}"))
            times = read_json(result.dir.timings_path)["step_time_s"][WARMUP_STEPS:]
            return times, {r["weights_sha256"] for r in result.summary["ranks"]}

        def hand(i: int) -> tuple[list[float], set[str]]:
            hand_dir = Path(tmp, f"hand-{i}")
            hand_dir.mkdir()
            out = _run_hand_loop(cfg, str(hand_dir))
            return out["step_time_s"][WARMUP_STEPS:], {out["weights_sha256"]}

        for i in range(repeats):
            # Alternate which goes first: the second of a pair may find the machine warmer (or busier).
            if i % 2 == 0:
                (t_times, t_digests), (h_times, h_digests) = trainer(i), hand(i)
            else:
                (h_times, h_digests), (t_times, t_digests) = hand(i), trainer(i)
            trainer_times += t_times
            hand_times += h_times
            # Each pair ran back to back: their difference is free of the machine's drift between pairs.
            paired.append(statistics.median(t_times) - statistics.median(h_times))
            log.debug("pair %d (%s first): %+.3f ms", i, "hand" if i % 2 else "trainer", 1e3 * paired[-1])
            equal = equal and len(t_digests | h_digests) == 1
    t, h = statistics.median(trainer_times), statistics.median(hand_times)
    report = OverheadReport(steps=steps, num_processes=num_processes, repeats=repeats, trainer_median_s=t,
                            hand_median_s=h, trainer_mean_s=statistics.fmean(trainer_times),
                            hand_mean_s=statistics.fmean(hand_times), ratio=t / h,
                            overhead_ms=statistics.median(paired) * 1e3, budget_ms=0.01 * h * 1e3 + 1.0,
                            weights_equal=equal, device=resolve_device(cfg), log_every=cfg.log_every)
    if json_path is not None:
        Path(json_path).write_text(json.dumps({**asdict(report), "passed": report.passed}, indent=2))
    return report


