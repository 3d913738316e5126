"""Ring attention on the CPU, for the estimate's trace of context parallel (cp > 1).

PyTorch 2.13's context_parallel turns scaled_dot_product_attention into ring attention for the
flash, efficient and cuDNN ops, all CUDA; the estimate traces a step on CPU fake tensors, where the
same call dispatches `_scaled_dot_product_flash_attention_for_cpu`, which has no context-parallel
rule ('... does not have a sharding strategy registered'). `installed()` hands the CPU op and its
backward to PyTorch's own ring templates (private:
torch.distributed.tensor.experimental._context_parallel._attention), so the trace runs the exchanges
of keys and values a GPU run makes (all-gathered over the CP group, PyTorch's default rotation), the
attention FLOPs of each rank's queries against every key, and the buffers the ring holds. A run on
CPU ranks is still refused (preflight): the tests use this to run CP on gloo ranks, where it
computes what the CUDA kernels would.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.experimental._context_parallel import _attention as A

aten = torch.ops.aten


def _fwd(
    mesh: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    attn_mask: Any = None,
    *,
    scale: float | None = None,
) -> Any:
    return A._templated_ring_attention(
        mesh.get_group(),
        2,
        aten._scaled_dot_product_flash_attention_for_cpu,
        query=query,
        key=key,
        value=value,
        is_causal=is_causal,
        dropout_p=dropout_p,
        scale=scale,
    )


def _bwd(
    mesh: Any,
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    dropout_p: float,
    is_causal: bool,
    attn_mask: Any = None,
    *,
    scale: float | None = None,
) -> Any:
    return A._templated_ring_attention_backward(
        mesh.get_group(),
        2,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        grad_out=grad_out,
        grad_out_name="grad_out",
        query=query,
        key=key,
        value=value,
        out=out,
        logsumexp=logsumexp,
        is_causal=is_causal,
        dropout_p=dropout_p,
        scale=scale,
    )


def _handler(op_call: Any, args: Any, kwargs: Any) -> Any:
    """The local tensors through the ring, the results back as DTensors split along the sequence
    (dim 2)."""
    info = DTensor._op_dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    fn = _fwd if op_call == aten._scaled_dot_product_flash_attention_for_cpu.default else _bwd
    outs = fn(info.compute_mesh, *info.local_args, **info.local_kwargs)
    mesh = info.compute_mesh
    return tuple(
        DTensor.from_local(o, mesh, [Shard(2)], run_check=False)
        if isinstance(o, torch.Tensor)
        else o
        for o in outs
    )


@contextmanager
def installed() -> Iterator[None]:
    """The CPU ops routed through the ring while inside (ranks forked inside inherit it)."""
    ops = (
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    )
    for op in ops:
        A.custom_ops[op] = _handler
    try:
        yield
    finally:
        for op in ops:
            A.custom_ops.pop(op, None)
