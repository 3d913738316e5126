"""The run's summary as the ranks build it at the end of a session: its fields, each rank's account
of what really ran, the replica check, and the exported weights."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
from accelerate.utils import gather_object

from workbench import data
from workbench.rundir import Status
from workbench.training.digests import state_digest
from workbench.training.first_step import BYPASS_FIX, UnsyncedReplicas
from workbench.training.parallel.float8 import facts as float8_facts
from workbench.training.peak_memory import peak_memory_bytes
from workbench.utils.files import atomic_write_bytes
from workbench.utils.hardware import detect

if TYPE_CHECKING:
    from workbench.training.loop import Trainer


def first_leaf_dtype(model: torch.nn.Module, *, compiled: bool = False) -> dict[str, str]:
    """Record the dtype the first Linear/Conv actually computes in: proof that autocast is on.

    Returns a dict that a forward hook fills with 'dtype' on the first forward pass. Under
    torch.compile the probe is the last Linear/Conv (a head, outside the compiled blocks), and the
    hook does nothing while dynamo traces: a side effect there would break the graph, or keep a
    checkpointed block from compiling at all. A probe inside a compiled region records nothing (the
    dtype stays unknown rather than guessed).
    """
    seen: dict[str, str] = {}
    leaves = [
        m
        for m in model.modules()
        if isinstance(m, (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d))
    ]
    if not leaves:
        return seen
    leaf = leaves[-1] if compiled else leaves[0]

    def hook(_m: Any, _i: Any, out: Any) -> None:
        if torch.compiler.is_compiling():
            return
        if isinstance(out, torch.Tensor) and "dtype" not in seen:
            seen["dtype"] = str(out.dtype).removeprefix("torch.")
            handle.remove()

    handle = leaf.register_forward_hook(hook)
    return seen


def running_fields(t: Trainer) -> dict[str, Any]:
    """Summary fields known once the ranks are up: what runs where."""
    hw = detect()
    cuda = t.device.type == "cuda"
    return {
        "run_name": t.cfg.run_name,
        "task": t.cfg.task,
        "world_size": t.world,
        "parallelism": t.cfg.parallelism,
        "tp": t.cfg.tp,
        "mesh": t.dims.sizes,
        "precision": t.cfg.precision,
        "device": hw.device_line(t.device.type),
        "device_class": hw.device_class if cuda else "cpu",
        "global_batch_size": t.global_batch,
        "micro_batch_size": t.cfg.micro_batch_size,
        "grad_accum_steps": t.cfg.grad_accum_steps,
        "n_params": t.n_params,
        "data": data.used_datasets(),
    }


def rank_info(t: Trainer) -> list[dict[str, Any]]:
    """Every rank's pid, device, compute dtype, threads, peak memory and weights digest, in rank
    order."""
    mine = {
        "rank": t.rank,
        "pid": os.getpid(),
        "device": str(t.device),
        "compute_dtype": t.compute_dtype.get("dtype"),
        "mixed_precision": t.accelerator.mixed_precision,
        "distributed_type": str(t.accelerator.distributed_type).split(".")[-1],
        "world_size": t.world,
        "torch_threads": torch.get_num_threads(),
        "peak_memory_bytes": peak_memory_bytes(t.device),
        "parallelism": t.parallel.name,
        "sharded": t.parallel.sharded,
        **t.parallel.facts(),
        **float8_facts(t.parallel.module, t.parallel.float8),
        # fp16: the loss scale the run ended with (it halves at each overflow the scaler skipped)
        "loss_scale": t.parallel.scaler.get_scale() if t.parallel.scaler is not None else None,
        "agreement_votes": t.stop_vote.votes,
        "fused_optimizer": bool(t.parallel.local_optimizer().defaults.get("fused")),
        "tf32": t.device.type == "cuda" and torch.get_float32_matmul_precision() != "highest",
        **{f"{kind}_bytes": n for kind, n in t.parallel.held_bytes.items()},
        "weights_sha256": t.parallel.weights_digest(),
        "tracked_memory": t.tracked_memory,
        "profile_trace": str(t.profiler.trace) if t.profiler.trace else None,
    }
    return gather_object([mine]) if t.world > 1 else [mine]


def summary_fields(
    t: Trainer, *, samples_per_s: float, tokens_per_s: float | None, steps_run: int
) -> dict[str, Any]:
    """Summary fields at the end of a session (collective: every rank calls it)."""
    ranks = rank_info(t)
    last_row = t.metrics.last_row
    fields: dict[str, Any] = {
        "steps": t.state.step,
        "steps_this_session": steps_run,
        "final_loss": last_row.loss if last_row else None,
        "samples_per_s": samples_per_s,
        "tokens_per_s": tokens_per_s,
        "peak_memory_bytes": max(r["peak_memory_bytes"] for r in ranks),
        "peak_memory_bytes_per_rank": [r["peak_memory_bytes"] for r in ranks],
        "skipped_steps": t.state.skipped_steps,
        "train_time_s": t.elapsed_s(),
        "ranks": ranks,
        "eval": dict(t.eval_row or {}),
        "mfu": t.flops.mfu(samples_per_s),
    }
    return fields


def check_replicas(t: Trainer, fields: dict[str, Any]) -> None:
    """Collective, at the end: the replicas of a replicated layout (every rank holds the whole
    model) end with the same parameters, or every rank raises UnsyncedReplicas, rank 0 first
    recording what the ranks reported (their digests and gradient syncs). Buffers are left out: DDP
    broadcasts them at each forward, and a last forward in training mode updates each rank's running
    statistics from its own batch."""
    if (
        t.world == 1
        or t.parallel.sharded
        or len({r["weights_sha256"] for r in fields["ranks"]}) == 1
    ):
        # the whole states are equal (their digests are taken anyway): nothing more to compare
        return
    digests = gather_object([state_digest(dict(t.parallel.module.named_parameters()))])
    if len(set(digests)) == 1:
        return
    if t.main:
        t.run.set_status(Status.RUNNING, **running_fields(t), **fields)
    syncs = [r.get("gradient_syncs") for r in fields["ranks"]]
    raise UnsyncedReplicas(
        "the replicas' parameters differ at the end of training "
        f"(parallelism={t.cfg.parallelism!r}; sha256 "
        + ", ".join(f"rank {r}: {d[:12]}" for r, d in enumerate(digests))
        + f"; gradient syncs per rank: {syncs}): there is no one trained model, and "
        f"model.safetensors was not written. {BYPASS_FIX[0].upper()}{BYPASS_FIX[1:]}; or code "
        "changed parameters on some ranks only (an in-place edit under torch.no_grad())"
    )


def export_weights(t: Trainer) -> str | None:
    """Write the full weights once, as model.safetensors (loadable without torch.distributed),
    whatever the parallelism; returns their sha256 on rank 0. Collective: every rank calls it."""
    from safetensors.torch import save

    full = t.parallel.full_weights()
    if not t.main:
        return None
    seen: set[int] = set()
    tensors = {}
    for name, tensor in full.items():
        tensor = tensor.detach().cpu().contiguous()
        # safetensors refuses tensors that share memory (tied weights): the copy keeps each name
        # loadable.
        tensors[name] = tensor.clone() if tensor.data_ptr() in seen else tensor
        seen.add(tensor.data_ptr())
    metadata = {
        "task": str(t.cfg.task),
        "step": str(t.state.step),
        "parallelism": t.cfg.parallelism,
        "world_size": str(t.world),
    }
    atomic_write_bytes(t.run.weights_path, save(tensors, metadata=metadata))
    return state_digest(tensors)
