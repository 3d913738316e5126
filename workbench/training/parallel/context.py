"""Context parallelism (PyTorch's torch.distributed.tensor.experimental.context_parallel),
torchtitan's way.

The ranks of a CP group see the same batch; inside `batch_context(batch)` (forward and backward)
each keeps its slices of every sequence (the task's `context_parallel_buffers`: inputs, targets,
position buffers, sharded in place; with load balancing each rank holds a chunk from the head and
one from the tail of the sequence, 2 x cp chunks in all) and F.scaled_dot_product_attention becomes
ring attention: each rank's queries meet every rank's keys and values, passed around the group.
Everything else in the model is per token, so the rest of the forward and the loss run on the local
slice: each rank's loss is the mean over its tokens, the same number on every rank, and FSDP2
averages the gradients over dp_shard x cp (flattened into 'dp_shard_cp', apply.py), which makes
them the gradients of the mean over the whole sequence. The logged loss is the mean over ranks, so
over the whole sequence too.

The recipe (apply.py) lays the model out as for TensorParallel (TP over 'tp' when tp > 1, then
FSDP2), so clipping, fp16 scaling and checkpoints are the same. PyTorch runs ring attention through
the CUDA kernels only (flash, efficient, cuDNN): preflight refuses cp > 1 on CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor.experimental import context_parallel

from workbench.training.parallel.tensor import TensorParallel

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from workbench.config import RunConfig
    from workbench.tasks import Task
    from workbench.training.parallel.apply import ParallelModel
    from workbench.training.parallel.placement import Placement


class ContextParallel(TensorParallel):
    """Sequences split over the 'cp' dimension of the mesh, parameters sharded over dp_shard x cp
    (and TP'd)."""

    @classmethod
    def around(
        cls,
        cfg: RunConfig,
        where: Placement,
        parallel: ParallelModel,
        task: Task,
        make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
    ) -> ContextParallel:
        """The task names the sequence tensors to split (Task.context_parallel_buffers)."""
        return cls(cfg, where, parallel.model, task, make_optimizer)

    def __init__(
        self,
        cfg: RunConfig,
        where: Placement,
        model: torch.nn.Module,
        task: Task,
        make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
    ) -> None:
        super().__init__(cfg, where, model, make_optimizer)
        self.task = task
        self.name = " x ".join([cfg.parallelism, f"cp{cfg.cp}", *([f"tp{cfg.tp}"] * (cfg.tp > 1))])
        self.split = SequenceSplit(self.mesh["cp"], task, cfg.cp)

    def batch_context(self, batch: Any) -> AbstractContextManager[None]:
        """The batch's sequences sharded over the CP group and attention made ring attention, for
        the forward and the backward (whose ring attention passes gradients around the group the
        same way)."""
        return self.split(self.module, batch)

    def facts(self) -> dict[str, Any]:
        return {**super().facts(), "cp_sequence": dict(self.split.sequence)}


class SequenceSplit:
    """PyTorch's context_parallel over `mesh` around a forward and backward, on the sequence tensors
    the task names (Task.context_parallel_buffers); ContextParallel's and a pipeline's with cp >
    1."""

    def __init__(self, mesh: DeviceMesh, task: Task, cp: int, *, pipelined: bool = False) -> None:
        self.mesh, self.task, self.cp, self.pipelined = mesh, task, cp, pipelined
        self.sequence: dict[str, int] = {}
        """The last forward's sequence length, whole and as this rank held it: the proof the split
        happened."""

    @contextmanager
    def __call__(self, module: torch.nn.Module, batch: Any) -> Iterator[None]:
        pairs = self.task.context_parallel_buffers(module, batch) or []
        # A pipeline's middle stages hold no sequence tensor (their activations arrive split) and
        # still attend.
        if not pairs and not self.pipelined:
            raise ValueError(
                f"cp={self.cp}: task {self.task.name!r} names no sequence tensors "
                "(context_parallel_buffers returned nothing); set cp=1"
            )
        buffers, dims = [t for t, _ in pairs], [d for _, d in pairs]
        if not buffers:
            # context_parallel takes its device and load balancing from a first buffer: a stand-in
            buffers, dims = [torch.zeros(2 * self.cp, device=self.mesh.device_type)], [0]
        whole = buffers[0].shape[dims[0]]
        with context_parallel(self.mesh, buffers=buffers, buffer_seq_dims=dims):
            if pairs:
                self.sequence = {"length": whole, "local_length": buffers[0].shape[dims[0]]}
            yield
