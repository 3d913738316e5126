"""Replicated modes: every rank holds the full model. 'ddp' all-reduces gradients (DDP, which the
recipe wraps the model in, optionally with a compression hook registered here); 'zero1' also shards
the optimizer state (ZeroRedundancyOptimizer); 'none' is one process."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.nn.parallel import DistributedDataParallel

from workbench.training.checkpoint.files import metadata_reader, trained_state
from workbench.training.observe.breakdown import DDPCommStats
from workbench.training.parallel.strategy import DTYPES, Strategy

if TYPE_CHECKING:
    from pathlib import Path

    from workbench.config import RunConfig
    from workbench.training.parallel.placement import Placement

log = logging.getLogger("workbench")


class Replicated(Strategy):
    """The model whole on every rank, in the DistributedDataParallel the recipe wrapped it in when
    there is more than one rank (apply.apply_ddp); autocast for bf16/fp16."""

    name = "ddp"

    def __init__(
        self,
        cfg: RunConfig,
        where: Placement,
        model: torch.nn.Module,
        make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
    ) -> None:
        super().__init__(cfg, where)
        self.model = model
        ddp = isinstance(model, DistributedDataParallel)
        self.module = model.module if ddp else model
        if ddp:
            self.comm_stats = DDPCommStats(self.model)
            if cfg.grad_compression != "none":
                self._register_hook(cfg)
        elif cfg.find_unused_parameters and not self.accelerator.tracing:  # one rank: no DDP
            log.warning(
                "find_unused_parameters=True: this run has one rank, hence no "
                "DistributedDataParallel to pass it to; the setting does nothing here"
            )
        self.optimizer = make_optimizer(self.module)
        if cfg.precision == "fp16":
            self.scaler = torch.amp.GradScaler(self.device.type)

    def _register_hook(self, cfg: RunConfig) -> None:
        """The gradient compression asked for, as a comm hook (without one, DDP all-reduces in
        C++)."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        state: Any = None
        hook: Any = None
        if cfg.grad_compression == "fp16":
            hook = default_hooks.fp16_compress_hook
        elif cfg.grad_compression == "bf16":
            hook = default_hooks.bf16_compress_hook
        elif cfg.grad_compression == "powersgd":
            # PyTorch's advice: a few steps of exact all-reduce first (the hook counts optimizer
            # steps here, as accumulation steps don't communicate).
            start = max(2, min(1000, cfg.max_steps // 10))
            state = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=start
            )
            hook = powerSGD_hook.powerSGD_hook
        self.model.register_comm_hook(state, hook)

    def facts(self) -> dict[str, Any]:
        if not isinstance(self.model, DistributedDataParallel):
            return {}
        # DDP's own record of the hook it calls, not just the one we asked for.
        return {
            "comm_hook": self.model._get_ddp_logging_data().get("comm_hook") or "builtin allreduce",
            "gradient_syncs": self.comm_stats.syncs if self.comm_stats is not None else None,
        }

    def checkpoint_parts(self) -> tuple[dict[str, Any], bool]:
        """Every rank holds the same weights and optimizer state: rank 0 writes the model and the
        last rank the optimizer (rank 0 both, alone), side by side and without DCP's planning
        collectives (a checkpoint any mode and rank count loads, as from the sharded modes)."""
        rank, last = self.accelerator.process_index, self.accelerator.num_processes - 1
        mine = [key for key, writer in (("model", 0), ("optim", last)) if writer == rank]
        if not mine:
            return {}, True
        state = self.state_dict()
        return {key: state[key] for key in mine}, True

    def forward_context(self) -> AbstractContextManager[Any]:
        dtype = DTYPES.get(self.cfg.precision)
        return nullcontext() if dtype is None else torch.autocast(self.device.type, dtype=dtype)

    def sync_gradients(self, last_micro_batch: bool) -> AbstractContextManager[Any]:
        """Gradients are all-reduced only on the micro-batch that ends the step."""
        if last_micro_batch or not isinstance(self.model, DistributedDataParallel):
            return nullcontext()
        return self.model.no_sync()


class ZeroOne(Replicated):
    """ZeRO stage 1: replicas and all-reduced gradients as in DDP; each rank keeps the optimizer
    state of its own partition of the parameters, updates them, and broadcasts them to the
    others."""

    name = "zero1"

    def __init__(
        self,
        cfg: RunConfig,
        where: Placement,
        model: torch.nn.Module,
        make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
    ) -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        def zero(module: torch.nn.Module) -> torch.optim.Optimizer:
            plain = make_optimizer(module)  # whatever optimizer the run uses, partitioned by ZeRO
            accepted = inspect.signature(type(plain).__init__).parameters
            defaults = {k: v for k, v in plain.defaults.items() if k in accepted}
            return ZeroRedundancyOptimizer(
                [{k: v for k, v in g.items() if k != "initial_lr"} for g in plain.param_groups],
                optimizer_class=type(plain),
                **defaults,
            )

        super().__init__(cfg, where, model, zero)
        self._names = {p: n for n, p in self.module.named_parameters()}

    def local_optimizer(self) -> torch.optim.Optimizer:
        return self.optimizer.optim  # type: ignore[attr-defined]

    def checkpoint_parts(self) -> tuple[dict[str, Any], bool]:
        # each rank contributes its own partition of the optimizer state
        return Strategy.checkpoint_parts(self)

    def state_dict(self) -> dict[str, Any]:
        """Model and optimizer state keyed by parameter name, like DDP's: each rank contributes the
        optimizer state of the parameters it owns, so a zero1 checkpoint loads under any mode and
        vice versa."""
        local = self.local_optimizer()
        state = {
            self._names[p]: dict(local.state[p])
            for g in local.param_groups
            for p in g["params"]
            if p in local.state
        }
        groups = [
            {
                **{k: v for k, v in local_group.items() if k != "params"},
                "params": [self._names[p] for p in group["params"]],
            }
            for group, local_group in zip(self.optimizer.param_groups, local.param_groups)
        ]
        return {
            "model": trained_state(self.module),
            "optim": {"state": state, "param_groups": groups},
        }

    def load(self, path: Path) -> None:
        """Read the whole model and, of the optimizer state, only this rank's partition.

        Why not Strategy.load: DCP's get_state_dict/set_state_dict don't know
        ZeroRedundancyOptimizer, whose state each rank holds for its own partition only, indexed
        by position in that partition."""
        # `path` may be a StorePath (checkpoint_url): its str() is the URL DCP's readers take
        metadata = metadata_reader(path / "optim").read_metadata().state_dict_metadata
        local = self.local_optimizer()
        owned = [p for g in local.param_groups for p in g["params"]]
        model = {"model": trained_state(self.module)}
        dcp.load(model, checkpoint_id=str(path / "model"))
        state: dict[str, Any] = {"optim": {"state": {}}}
        for p in owned:
            prefix = f"optim.state.{self._names[p]}."
            entries = {
                key[len(prefix) :]: meta for key, meta in metadata.items() if key.startswith(prefix)
            }
            state["optim"]["state"][self._names[p]] = {
                k: torch.empty(m.size, dtype=m.properties.dtype)
                if isinstance(m, TensorStorageMetadata)
                else None
                for k, m in entries.items()
            }
        dcp.load(state, checkpoint_id=str(path / "optim"))
        # frozen parameters (not checkpointed: TRAINED) stay as built
        self.module.load_state_dict(model["model"], strict=False)
        index = {p: i for i, p in enumerate(owned)}
        local.load_state_dict(
            {
                "state": {
                    index[p]: state["optim"]["state"][self._names[p]]
                    for p in owned
                    if state["optim"]["state"][self._names[p]]
                },
                "param_groups": [
                    {
                        **{k: v for k, v in g.items() if k != "params"},
                        "params": [index[p] for p in g["params"]],
                    }
                    for g in local.param_groups
                ],
            }
        )
