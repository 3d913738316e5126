"""What every parallelism strategy does the same way: precision, backward, clipping, the update, the
bytes each rank holds, and checkpoints through torch.distributed.checkpoint (DCP).

A checkpoint holds the model and optimizer state keyed by parameter name, in DCP's format: a run can
resume with another number of ranks or another mode (saved by zero3 on 2 ranks, resumed by ddp on
1), and DCP reshards. The portable copy at the end of a run is one safetensors file of the full
weights.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from workbench.training.parallel.param_groups import merge_split_groups, resplit_groups
from workbench.training.parallel.placement import Placement
from workbench.training.weights import state_digest
from workbench.utils.distributed import single_process_dcp

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from workbench.config import RunConfig
    from workbench.tasks import Task
    from workbench.training.observe.breakdown import DDPCommStats
    from workbench.training.parallel.apply import ParallelModel
    from workbench.training.parallel.float8 import Float8Swap

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}
"""The dtype each precision computes in: fp8 is bf16 but for Float8Linear's matmuls (float8.py)."""


def local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank holds for `t`: its local shard for a DTensor."""
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        local_bytes(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)
    )


TRAINED = StateDictOptions(ignore_frozen_params=True)
"""A checkpoint holds what trains: frozen parameters (a LoRA run's base) are rebuilt by the task's
build_model (one seed on every rank, in a resume and in load_model), not written at every
checkpoint."""
LOAD_TRAINED = StateDictOptions(ignore_frozen_params=True, strict=False)
"""Loading such a checkpoint: the frozen parameters stay as built. DCP has already refused a
checkpoint that lacks a trained one."""


class Strategy:
    """The training-step operations that depend on how the model is parallel; subclasses receive
    the model already parallel (apply.py's recipe) and build the optimizer and contexts around it.
    What a strategy can do is declared here, as attributes every strategy has: callers read them,
    never probe for them."""

    name = "base"
    sharded = False
    """Parameters are sharded at rest: no rank holds the full weights."""
    pipelined = False
    """The strategy runs a step's micro-batches itself (pipeline_step), forward and backward
    together."""
    split_backward = False
    """Backward runs as autograd.grad calls PyTorch's MemTracker can't follow (the zero-bubble
    schedule)."""
    _origin: list[int] | None = None
    """Where the layout split the optimizer's param groups by mesh: the task's group each came from
    (param_groups.py); checkpoints hold the task's grouping."""
    loss_ranks: range | None = None
    """The ranks whose loss is the run's (a pipeline's last stage); None: every rank's."""
    eval_loss: Callable[[Any], tuple[torch.Tensor, dict[str, Any]] | None] | None = None
    """An evaluation forward of the strategy's own (a pipeline's, through its stages); None: the
    model's."""

    @classmethod
    def around(
        cls,
        cfg: RunConfig,
        where: Placement,
        parallel: ParallelModel,
        task: Task,
        make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
    ) -> Strategy:
        """The strategy around the recipe's parallel model (apply.apply_parallelism), taking of it
        what it needs: the model the loop calls, here; a subclass that needs the task or the
        pipeline's stages says so."""
        return cls(cfg, where, parallel.model, make_optimizer)  # type: ignore[call-arg]

    def __init__(self, cfg: RunConfig, where: Placement) -> None:
        self.cfg = cfg
        # A Placement as it is; anything with an Accelerator's device and num_processes as one.
        self.accelerator = Placement.of(where)
        """Where this rank sits (named for accelerate's Accelerator, which it stands for)."""
        self.device = self.accelerator.device
        # The one mesh of the run, the one the recipe made the model parallel over (parallelize
        # builds it; a traced estimate's is built beforehand, outside fake mode).
        self.mesh: DeviceMesh | None = self.accelerator.mesh
        self.model: torch.nn.Module
        # the model without a DDP wrapper (FSDP2 modules are their own)
        self.module: torch.nn.Module
        self.optimizer: torch.optim.Optimizer
        self.scaler: Any = None
        self.held_bytes: dict[str, int] = {}
        """Parameter, gradient and optimizer-state bytes this rank holds, measured at the first
        update."""
        self.comm_stats: DDPCommStats | None = None
        """The gradient all-reduce not hidden by compute, where DDP measures it."""
        self.float8: Float8Swap | None = None
        """precision='fp8': the Linears swapped to Float8Linear (float8.py), run after updates."""

    # ---- the step --------------------------------------------------------------------------------
    def forward_context(self) -> AbstractContextManager[Any]:
        """Autocast for replicated modes; sharded modes cast parameters instead
        (MixedPrecisionPolicy)."""
        return nullcontext()

    def batch_context(self, batch: Any) -> AbstractContextManager[Any]:
        """What the forward and the backward of `batch` run in together, around forward_context:
        context parallel shards the batch's sequences over its group there (ring attention's
        backward needs it too)."""
        return nullcontext()

    def sync_gradients(self, last_micro_batch: bool) -> AbstractContextManager[Any]:
        return nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def step(self) -> bool:
        """Apply the update and clear the gradients; True when fp16 loss scaling skipped it
        (overflow)."""
        skipped = False
        if self.scaler is not None:
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            skipped = self.scaler.get_scale() < scale
        else:
            self.optimizer.step()
        if self.float8 is not None:
            self.float8.after_update(self.module)
        if not self.held_bytes:
            self.held_bytes = self.measure_held_bytes()
        self.optimizer.zero_grad(set_to_none=True)
        return skipped

    def pipeline_step(
        self,
        batches: Iterator[Any],
        accum: int,
        at: Callable[[str], None] | None = None,
        before_last_backward: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """A pipelined strategy's step over `accum` micro-batches (step.accumulate runs the
        others')."""
        raise NotImplementedError(f"{self.name}: not pipelined (Strategy.pipelined is False)")

    def fresh_schedule(self) -> None:
        """New pipeline stages, to infer other micro-batch shapes (micro_batch_size='auto');
        nothing else
        keeps shapes."""

    # ---- what this rank holds --------------------------------------------------------------------
    def receive_buffers(self) -> list[torch.Tensor]:
        """Communication buffers the strategy keeps across steps (a pipeline's), for the memory
        tracker."""
        return []

    def facts(self) -> dict[str, Any]:
        """What this rank can show about its parallel setup (hooks, mesh), for the summary."""
        return {}

    def local_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer whose state lives on this rank (ZeRO-1: the rank's partition)."""
        return self.optimizer

    def measure_held_bytes(self) -> dict[str, int]:
        params = list(self.module.parameters())
        return {
            "params": sum(local_bytes(p) for p in params),
            "grads": sum(local_bytes(p.grad) for p in params if p.grad is not None),
            "optimizer": optimizer_state_bytes(self.local_optimizer()),
        }

    def weights_digest(self) -> str | None:
        """sha256 of this rank's full weights (replicated modes); None where ranks hold shards."""
        return None if self.sharded else state_digest(self.module.state_dict())

    # ---- checkpoints (collective: every rank calls) ----------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """{'model': ..., 'optim': ...} keyed by parameter name, as DCP saves and loads it (DCP's
        state-dict
        API: plain, DDP, FSDP2 and tensor-parallel modules alike), with the task's own param
        groups."""
        model, optim = get_state_dict(self.module, self.optimizer, options=TRAINED)
        groups = merge_split_groups(optim["param_groups"], self._origin)
        return {"model": model, "optim": {**optim, "param_groups": groups}}

    def checkpoint_parts(self) -> tuple[dict[str, Any], bool]:
        """What this rank writes into a checkpoint, {'model': ..., 'optim': ...} (each part its own
        DCP folder), and whether it writes them alone (no planning collectives: ranks that hold the
        same state). Collective."""
        return self.state_dict(), False

    def save(self, path: Path) -> None:
        """The model into path/model and the optimizer into path/optim (DCP, sharded as the ranks
        hold it)."""
        parts, alone = self.checkpoint_parts()
        with single_process_dcp(alone=alone):
            for key, state in parts.items():
                dcp.save({key: state}, checkpoint_id=str(path / key), no_dist=alone)

    def load(self, path: Path) -> None:
        """Load a checkpoint saved by any mode and number of ranks; DCP reshards it into this
        layout, its
        param groups split again where this optimizer's are split by mesh."""
        model, optim = get_state_dict(self.module, self.optimizer, options=TRAINED)
        split = copy.deepcopy(optim["param_groups"])  # DCP fills the merged groups' lists in place
        optim = {**optim, "param_groups": merge_split_groups(optim["param_groups"], self._origin)}
        with single_process_dcp():
            dcp.load({"model": model}, checkpoint_id=str(path / "model"))
            dcp.load({"optim": optim}, checkpoint_id=str(path / "optim"))
        if self._origin is not None:
            groups = resplit_groups(split, optim["param_groups"], self._origin)
            optim = {**optim, "param_groups": groups}
        set_state_dict(
            self.module,
            self.optimizer,
            model_state_dict=model,
            optim_state_dict=optim,
            options=LOAD_TRAINED,
        )

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The full weights on CPU, on rank 0 (other ranks get {})."""
        if not dist.is_initialized():  # one process, no group: nothing to gather
            return {k: v.detach().cpu() for k, v in self.module.state_dict().items()}
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.module, options=options)
