"""precision='fp8': the model's Linear layers swapped to torchao's Float8Linear, torchtitan's way.

What is swapped: each nn.Linear inside the model's repeated blocks (the shard units FSDP2 and
compile use) whose input and output features are multiples of 16, which the fp8 matmul
(torch._scaled_mm) needs. Linear layers outside the blocks stay as they are: the output head
(torchtitan leaves out 'output' too: the logits and the loss keep their precision) and input
projections. The swap comes first, on the plain model, before tensor parallelism, activation
checkpointing, compile and FSDP2 (torchtitan's order: float8, TP, AC, compile, FSDP).

Everything that isn't a swapped matmul computes in bf16, as precision='bf16' does (autocast, or
FSDP2's param_dtype: strategy.DTYPES maps 'fp8' to bf16), with fp32 master weights and fp32 gradient
reduction. With FSDP2 and the tensorwise recipe the swapped weights are all-gathered in fp8 (half of
bf16's bytes), and after each optimizer step their scales are computed together, one all-reduce for
all of them (precompute_float8_dynamic_scale_for_fsdp, where torchao says to call it). Rowwise
scaling all-gathers bf16 weights.

For tests only: WORKBENCH_FP8_EMULATE=1 makes the ranks run torchao's emulation (emulate=True: the
casts to fp8 and the scaling as on a GPU, the matmul itself in high precision), which needs no fp8
tensor cores, so CPU tests can prove the swap and the training. No RunConfig field sets it, and
preflight still refuses fp8 anywhere but on a GPU of compute capability 8.9+.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from workbench.config import SHARDED
from workbench.config.precision import FP8_INSTALL
from workbench.tasks.blocks import shard_units

if TYPE_CHECKING:
    from workbench.config import RunConfig
    from workbench.tasks import Task
    from workbench.training.parallel.apply import ParallelPlan

log = logging.getLogger("workbench")

EMULATE_ENV = "WORKBENCH_FP8_EMULATE"
"""'1': torchao's emulation instead of fp8 tensor cores. For workbench's CPU tests only."""


def emulating() -> bool:
    """True when the tests asked for torchao's emulation (EMULATE_ENV)."""
    return os.environ.get(EMULATE_ENV) == "1"


@dataclass
class Float8Swap:
    """What the swap did: the swapped modules' names, the recipe, whether FSDP2 all-gathers their
    weights in fp8, and whether the matmuls are emulated (tests)."""

    names: list[str]
    recipe: str
    fsdp_fp8_all_gather: bool
    emulated: bool

    def after_update(self, module: torch.nn.Module) -> None:
        """After each optimizer step: the fp8 all-gather's weight scales, all in one all-reduce
        (left to the all-gather, each weight would all-reduce its own amax)."""
        if self.fsdp_fp8_all_gather:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(module)


def check_device(device: torch.device, emulate: bool) -> None:
    """fp8 matmuls need a CUDA GPU of compute capability 8.9+ (unless the tests emulate them)."""
    if emulate:
        return
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if capability is None or capability < (8, 9):
        where = (
            f"a GPU of compute capability {capability[0]}.{capability[1]}" if capability else "CPU"
        )
        raise ValueError(
            f"precision='fp8' on {where}: fp8 matmuls need a CUDA GPU of compute "
            "capability 8.9+ (H100/L40/4090, fp8 tensor cores); use precision='bf16'"
        )


def float8_config(cfg: RunConfig, emulate: bool) -> Any:
    """torchao's Float8LinearConfig for cfg.fp8_recipe (tensorwise under FSDP2: fp8 all-gather)."""
    try:
        from torchao.float8 import Float8LinearConfig
    except ImportError as e:
        raise ImportError(
            f"precision='fp8' trains with torchao's Float8, which doesn't import "
            f"here ({e}); `{FP8_INSTALL}`"
        ) from e
    base = Float8LinearConfig.from_recipe_name(cfg.fp8_recipe)
    all_gather = cfg.fp8_recipe == "tensorwise" and cfg.parallelism in SHARDED
    return replace(base, emulate=emulate, enable_fsdp_float8_all_gather=all_gather)


def fp8_shaped(module: torch.nn.Module) -> bool:
    """A Linear the fp8 matmul takes: input and output features multiples of 16."""
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def fp8_linears(model: torch.nn.Module, plan: ParallelPlan) -> list[str]:
    """The names of the Linear layers the swap takes: inside the model's blocks (the plan's shard
    units), and fp8-shaped."""
    inside = {id(m) for unit in shard_units(model, plan) for m in unit.modules()}
    return [
        name
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and id(m) in inside and fp8_shaped(m)
    ]


def check_task(cfg: RunConfig, task: Task) -> None:
    """preflight: the task's model (built on the meta device) has Linear layers fp8 can train."""
    try:
        with torch.device("meta"):
            model = task.build_model(cfg)
    except Exception:  # noqa: BLE001  (a model that can't be built on meta is checked in the ranks)
        return
    if not fp8_linears(model, task):
        raise ValueError(_nothing_to_swap(model, task))


def _nothing_to_swap(model: torch.nn.Module, plan: ParallelPlan) -> str:
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    return (
        f"precision='fp8': task {plan.name!r} has no Linear layer fp8 can train (those inside "
        "the model's repeated blocks, Task.shard_units, with input and output features "
        f"multiples of 16); its Linear layers: {linears or 'none'}; use precision='bf16'"
    )


def swap_linears(
    cfg: RunConfig, model: torch.nn.Module, plan: ParallelPlan, device: torch.device
) -> Float8Swap:
    """Swap the Linear layers fp8_linears names to torchao's Float8Linear, in place (the recipe's
    first step, apply.apply_fp8)."""
    emulate = emulating()
    check_device(device, emulate)
    config = float8_config(cfg, emulate)
    from torchao.float8 import convert_to_float8_training

    names = fp8_linears(model, plan)
    if not names:
        raise ValueError(_nothing_to_swap(model, plan))
    before = dict(model.named_modules())
    chosen = set(names)
    convert_to_float8_training(
        model, module_filter_fn=lambda _m, name: name in chosen, config=config
    )
    for name in names:
        _adopt_hooks(model.get_submodule(name), before[name])
    kept = [n for n, m in before.items() if isinstance(m, torch.nn.Linear) and n not in chosen]
    log.info(
        "fp8 (%s%s): %d Linear layers swapped to Float8Linear; kept in bf16: %s",
        cfg.fp8_recipe,
        ", emulated" if emulate else "",
        len(names),
        ", ".join(kept) or "none",
    )
    return Float8Swap(names, cfg.fp8_recipe, config.enable_fsdp_float8_all_gather, emulate)


def _adopt_hooks(new: torch.nn.Module, old: torch.nn.Module) -> None:
    """The new module takes over the old one's forward hooks (the trainer's compute-dtype probe
    sits on the first Linear): the dicts themselves, so a hook's handle still removes it."""
    new._forward_hooks = old._forward_hooks
    new._forward_pre_hooks = old._forward_pre_hooks


def facts(module: torch.nn.Module, swap: Float8Swap | None) -> dict[str, Any]:
    """What a rank shows of its fp8 training, read from its (parallel) model as it is now: the
    Float8Linear modules, and how many of their weights FSDP2 all-gathers in fp8."""
    if swap is None:
        return {}
    from torch.distributed.tensor import DTensor
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    held = [m for m in module.modules() if isinstance(m, Float8Linear)]
    # torchao's weight subclass inside FSDP2's sharded DTensor is what all-gathers in fp8.
    gathered = sum(
        isinstance(m.weight, DTensor)
        and isinstance(m.weight._local_tensor, WeightWithDynamicFloat8CastTensor)
        for m in held
    )
    return {
        "fp8": {
            "float8_linears": len(held),
            "fp8_all_gather_weights": gathered,
            "recipe": swap.recipe,
            "emulated": swap.emulated,
        }
    }
