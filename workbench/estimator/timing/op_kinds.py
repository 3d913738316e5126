"""How an ATen op of a traced step is classed for pricing (`op_kind`): free, a view, FLOP-bound, an
elementwise kind (machine/probe.py's KINDS), or an op on DTensors. A machine profile's per-op
figures (machine/probe.py) are defined by the same classes, and cpu.py and gpu.py price a traced
step's ops by them.
"""

from __future__ import annotations

FREE = ("prim.", "profiler.")
VIEWS = frozenset(
    {
        "t",
        "view",
        "_unsafe_view",
        "transpose",
        "permute",
        "expand",
        "as_strided",
        "slice",
        "select",
        "unsqueeze",
        "squeeze",
        "detach",
        "alias",
        "split",
        "split_with_sizes",
        "chunk",
        "unbind",
        "narrow",
        "_reshape_alias",
        "diagonal",
        "unfold",
        "view_as_real",
        "view_as_complex",
        "lift_fresh",
        "_local_scalar_dense",
        "expand_as",
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "set_",
        "resize_",
    }
)
"""Ops that write no data (views, fresh allocations, reading a scalar out): they cost their dispatch
only."""
FLOP_OPS = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "addbmm",
    "matmul",
    "linear",
    "convolution",
    "_convolution",
    "_scaled_dot_product",
    "_flash_attention",
    "_efficient_attention",
)
RANDOM = frozenset(
    {
        "bernoulli",
        "bernoulli_",
        "uniform_",
        "normal_",
        "random_",
        "native_dropout",
        "rand",
        "randn",
        "rand_like",
        "randn_like",
        "randint",
        "randperm",
        "exponential_",
        "multinomial",
    }
)
MATH = (
    "gelu",
    "exp",
    "log",
    "tanh",
    "sigmoid",
    "erf",
    "silu",
    "softplus",
    "mish",
    "_softmax",
    "_log_softmax",
    "native_layer_norm",
    "native_group_norm",
    "native_batch_norm",
    "_fused_rms_norm",
    "pow",
    "sin",
    "cos",
)


def op_kind(name: str) -> str:
    """'free' (no kernel: prim.device, profiler ranges), 'view', 'flop', an elementwise kind
    (KINDS), or 'dtensor' (an op on DTensors, 'dtensor.aten.add_': the sharding bookkeeping around
    the local op, which is counted on its own), for an op named as StepTrace.ops names it
    ('aten.mm')."""
    if name.startswith(FREE):
        return "free"
    if name.startswith("dtensor."):
        return "dtensor"
    op = name.split(".", 1)[-1]
    if op in VIEWS:
        return "view"
    if op.startswith(FLOP_OPS) and not op.endswith("_"):
        return "flop"
    if op in RANDOM:
        return "random"
    if op.startswith(MATH):
        return "math"
    return "inplace" if op.endswith("_") else "copy"
