"""`workbench bench hf-overhead`: a transformers model stepped by workbench against the plain
Accelerate loop from accelerate's own docs, side by side in one run.

The model is a small random-init Llama-shaped `AutoModelForCausalLM` (built from a config, nothing
downloaded, the hub offline) on random token windows. One side is `wb.launch` (ddp, fp32); the other
is the loop accelerate documents: `Accelerator()`, `accelerator.prepare(model, optimizer,
dataloader)`, forward, `accelerator.backward(loss)`, `optimizer.step()`, `optimizer.zero_grad()`.
Both run on the same number of forked CPU ranks, interleaved in pairs, as `bench overhead` runs its
own (overhead.py: the pairs, the medians, the verdict; hand_loops.py: the forked ranks).

So that the two can be compared bit for bit, the run is one both trivially agree on: a constant
learning rate (no warm-up, min_lr_ratio 1), no weight decay, no clipping, one micro-batch per step,
and the plain loop's dataloader reads the samples in the trainer's order (its DistributedSampler
order, dealt the way accelerate deals batches to ranks). Verdict: workbench within 1% + 1 ms per
step of the plain loop, the final weights and the final losses equal.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import math
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from workbench.commands.bench.hand_loops import HAND_RESULT, HAND_WEIGHTS
from workbench.commands.bench.overhead import (
    WARMUP_STEPS,
    OverheadReport,
    bench_config,
    pairs_report,
    run_pairs,
)
from workbench.commands.bench.results import write_result
from workbench.config import RunConfig
from workbench.config.preflight import preflight
from workbench.tasks.base import Task
from workbench.tasks.options import TaskOption
from workbench.utils.hardware import detect, resolve_device

if TYPE_CHECKING:
    from torch.utils.data import Dataset

log = logging.getLogger("workbench")

TASK = "workbench.commands.bench.hf_overhead:LlamaOverheadTask"
"""The workbench side's task, by import path: the trainer's ranks import it from here."""
DATA_SEED = 1234
"""The random token windows are the same whatever cfg.seed is."""

HF_BENCH = RunConfig(
    task=TASK,
    num_processes=2,
    device="cpu",
    precision="fp32",
    micro_batch_size=4,
    grad_accum_steps=1,
    max_steps=60,
    lr=1e-3,
    warmup_steps=0,
    min_lr_ratio=1.0,
    weight_decay=0.0,
    grad_clip=0.0,
    log_every=10,
    seed=0,
)
"""The run both sides train: settings the plain loop from accelerate's docs has without writing
anything (a constant learning rate, AdamW without weight decay, no clipping, no accumulation)."""
PLAIN_LOOP_SETTINGS = {
    "warmup_steps": 0,
    "min_lr_ratio": 1.0,
    "weight_decay": 0.0,
    "grad_clip": 0.0,
    "grad_accum_steps": 1,
}
"""What the plain loop does without a line for it; a run must leave these as they are."""


class LlamaOverheadTask(Task):
    """A random-init Llama-shaped causal LM (grouped-query attention, SwiGLU, RMSNorm, untied head)
    on random token windows: a step takes tens of ms on a CPU core, so 1 ms is measurable."""

    name = "hf-overhead-llama"
    option_specs = (
        TaskOption("hidden", int, 128, "model width", min=32, max=4096),
        TaskOption("layers", int, 4, "decoder layers", min=1, max=64),
        TaskOption("heads", int, 4, "attention heads (key/value heads: half)", min=2, max=64),
        TaskOption("vocab", int, 1024, "vocabulary size", min=16, max=65536),
        TaskOption("seq_len", int, 128, "tokens per sample", min=2, max=8192),
        TaskOption("samples", int, 512, "random token windows in the training set", min=1),
    )

    def build_model(self, cfg: RunConfig) -> torch.nn.Module:
        return build_llama(self.options(cfg))

    def build_datasets(self, cfg: RunConfig) -> tuple[Any, Any]:
        return token_windows(self.options(cfg)), None

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        (ids,) = batch
        return model(input_ids=ids, labels=ids).loss

    def tokens_per_sample(self, cfg: RunConfig) -> int:
        return int(self.options(cfg)["seq_len"])


def build_llama(options: dict[str, Any]) -> torch.nn.Module:
    """`AutoModelForCausalLM.from_config` of a LlamaConfig of these options (random init: the global
    RNG, seeded by the caller)."""
    import transformers

    hidden, heads = options["hidden"], options["heads"]
    config = transformers.LlamaConfig(
        hidden_size=hidden,
        # Llama's SwiGLU width: about 8/3 of the model's, in multiples of 32
        intermediate_size=32 * math.ceil(8 * hidden / 3 / 32),
        num_hidden_layers=options["layers"],
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        vocab_size=options["vocab"],
        max_position_embeddings=options["seq_len"],
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def token_windows(options: dict[str, Any]) -> Dataset:
    from torch.utils.data import TensorDataset

    tokens = torch.randint(
        3,  # past the special tokens
        options["vocab"],
        (options["samples"], options["seq_len"]),
        generator=torch.Generator().manual_seed(DATA_SEED),
    )
    return TensorDataset(tokens)


def trainer_order(dataset: Dataset, cfg: RunConfig, world: int) -> list[int]:
    """The training set's indices for cfg.max_steps steps of `world` ranks, in the order the
    trainer's ranks read them (training/batches.py: DistributedSampler, seeded, reshuffled each
    epoch, a rank's last partial micro-batch dropped), laid out the way accelerate's prepared
    dataloader deals batches: batch k goes to rank k % world. Read in this order, the plain loop's
    ranks see the trainer's batches, step by step."""
    from torch.utils.data import DistributedSampler

    mbs, need = cfg.micro_batch_size, cfg.max_steps * world * cfg.micro_batch_size
    order: list[int] = []
    for epoch in range(need):  # ends long before: each epoch adds at least a batch per rank
        ranks = []
        for rank in range(world):
            sampler = DistributedSampler(
                dataset, num_replicas=world, rank=rank, shuffle=True, seed=cfg.seed, drop_last=True
            )
            sampler.set_epoch(epoch)
            ranks.append(list(sampler))
        per_epoch = len(ranks[0]) // mbs
        if per_epoch == 0:
            raise ValueError(
                f"micro_batch_size={mbs}: the training set has {len(ranks[0])} samples per rank, "
                "fewer than one micro-batch; raise task_options.samples"
            )
        for k in range(per_epoch):
            for indices in ranks:
                order += indices[k * mbs : (k + 1) * mbs]
        if len(order) >= need:
            break
    return order[:need]


def last_window(cfg: RunConfig) -> int:
    """Steps in the trainer's last metrics row: it logs every log_every steps and at the end."""
    return cfg.max_steps - (cfg.max_steps - 1) // cfg.log_every * cfg.log_every


def accelerate_loop(cfg: RunConfig, task: Task, out_dir: str, mode: str = "ddp") -> None:
    """One rank of the plain Accelerate training loop, as accelerate's docs write it (started by
    notebook_launcher); rank 0 writes the step times, the full weights, their sha256 and the mean
    loss of the last logging window (the trainer's last metrics row's: its steps' mean, averaged
    over the ranks) into out_dir."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader, Subset

    from workbench.training.weights import state_digest

    if resolve_device(cfg) == "cpu":  # the same thread share the trainer gives each rank
        torch.set_num_threads(detect().threads_per_rank(cfg.num_processes))
    accelerator = Accelerator(cpu=resolve_device(cfg) == "cpu")
    set_seed(cfg.seed)
    model = task.build_model(cfg)
    train_ds, _ = task.build_datasets(cfg)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=0.0
    )
    order = trainer_order(train_ds, cfg, accelerator.num_processes)
    dataloader = DataLoader(Subset(train_ds, order), batch_size=cfg.micro_batch_size)
    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)
    model.train()

    losses: list[torch.Tensor] = []
    times, start = [], time.perf_counter()
    for (ids,) in dataloader:
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())  # read after the loop: no per-step synchronisation
        now = time.perf_counter()
        times.append(now - start)
        start = now

    # The trainer's arithmetic for its last row: the window's losses summed in float64 on each
    # rank, divided by their count, then averaged over the ranks.
    window = last_window(cfg)
    mean = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    for loss in losses[-window:]:
        mean += loss.double()
    final_loss = float(accelerator.gather((mean / window).view(1)).mean())
    full = {k: v.detach().cpu() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    if accelerator.is_main_process:
        torch.save(full, Path(out_dir, HAND_WEIGHTS))
        Path(out_dir, HAND_RESULT).write_text(
            json.dumps(
                {
                    "step_time_s": times,
                    "weights_sha256": state_digest(full),
                    "final_loss": final_loss,
                }
            )
        )
    accelerator.wait_for_everyone()


@dataclass
class HFOverheadReport(OverheadReport):
    """`bench overhead`'s report, its hand-written loop the plain Accelerate loop, with the model
    and both final losses."""

    model: str = ""
    params: int = 0
    trainer_final_loss: float | None = None
    accelerate_final_loss: float | None = None
    losses_equal: bool = False
    """In every pair, the trainer's final loss is the plain loop's, bit for bit."""

    @property
    def passed(self) -> bool:
        return super().passed and self.losses_equal

    def table(self) -> str:
        return "\n".join(
            [
                (
                    f"workbench bench hf-overhead: {self.model} ({self.params / 1e6:.2f}M "
                    f"parameters), {self.num_processes} ranks on {self.device}, ddp fp32, "
                    f"{self.steps} steps x {self.repeats} pairs, median after {WARMUP_STEPS} "
                    "warm-up steps"
                ),
                f"  plain Accelerate loop {self.hand_median_s * 1e3:8.3f} ms/step",
                f"  workbench trainer     {self.trainer_median_s * 1e3:8.3f} ms/step",
                f"  ratio                 {self.ratio:8.4f}",
                (
                    f"  means                 {self.hand_mean_s * 1e3:8.3f} / "
                    f"{self.trainer_mean_s * 1e3:.3f} ms/step (accelerate / workbench; "
                    f"workbench's include its logging steps, every {self.log_every}, and its last)"
                ),
                (
                    f"  overhead              {self.overhead_ms:8.3f} ms/step, median of the "
                    f"{self.repeats} back-to-back pairs' differences (budget 1% + 1 ms = "
                    f"{self.budget_ms:.3f} ms)"
                ),
                (
                    f"  final loss            {_loss_text(self.accelerate_final_loss)} / "
                    f"{_loss_text(self.trainer_final_loss)} (accelerate / workbench; "
                    f"{'equal' if self.losses_equal else 'DIFFERENT'} in every pair)"
                ),
                self.weights_line(),
                f"  verdict: {'PASS' if self.passed else 'FAIL'}",
            ]
        )


def model_text(model: torch.nn.Module, options: dict[str, Any]) -> str:
    """'LlamaForCausalLM: 4 layers x 128 wide, 4 heads, vocab 1024, 128 tokens'."""
    return (
        f"{type(model).__name__}: {options['layers']} layers x {options['hidden']} wide, "
        f"{options['heads']} heads, vocab {options['vocab']}, {options['seq_len']} tokens"
    )


def _loss_text(loss: float | None) -> str:
    return "none" if loss is None else f"{loss:.9g}"


@contextlib.contextmanager
def _hub_offline() -> Iterator[None]:
    """HF_HUB_OFFLINE=1 for the runs (their ranks inherit it), the caller's value back after: the
    model is built from a config and must never reach for the hub."""
    before = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = before


def hf_overhead(
    steps: int = 60,
    pairs: int = 7,
    num_processes: int = 2,
    json_path: Path | None = None,
    cfg: RunConfig | None = None,
) -> HFOverheadReport:
    """Measure workbench's per-step overhead over the plain Accelerate loop on a transformers model
    (see module docstring); `cfg` (default HF_BENCH) may change the model's task_options."""
    if importlib.util.find_spec("transformers") is None:
        raise ModuleNotFoundError(
            "bench hf-overhead needs transformers: pip install 'workbench[hf]'"
        )
    if steps <= WARMUP_STEPS:
        raise ValueError(f"steps={steps}: must exceed the {WARMUP_STEPS} warm-up steps")
    if pairs < 1:
        raise ValueError(f"pairs={pairs}: at least 1 back-to-back pair")
    cfg = bench_config("ddp", num_processes, steps, cfg or HF_BENCH)
    differs = [
        f"{k}={getattr(cfg, k)!r}" for k, v in PLAIN_LOOP_SETTINGS.items() if getattr(cfg, k) != v
    ]
    if differs:
        raise ValueError(
            f"{', '.join(differs)}: the plain Accelerate loop has no schedule, weight decay, "
            f"clipping or accumulation; leave "
            f"{', '.join(f'{k}={v!r}' for k, v in PLAIN_LOOP_SETTINGS.items())}"
        )
    preflight(cfg)
    with _hub_offline():
        measured = run_pairs(cfg, pairs, "ddp", accelerate_loop)
        task = LlamaOverheadTask()
        with torch.device("meta"):  # its size only: no weights made
            model = task.build_model(cfg)
    base = pairs_report(measured, cfg, steps, pairs, num_processes, "ddp")
    trainer_loss, hand_loss = measured.final_losses[0]
    report = HFOverheadReport(
        **asdict(base),
        model=model_text(model, task.options(cfg)),
        params=sum(p.numel() for p in model.parameters()),
        trainer_final_loss=trainer_loss,
        accelerate_final_loss=hand_loss,
        losses_equal=all(t is not None and t == h for t, h in measured.final_losses),
    )
    if json_path is not None:
        write_result(json_path, {**asdict(report), "passed": report.passed})
    return report
