"""The GPT network char-gpt trains: causal self-attention through scaled_dot_product_attention,
pre-norm blocks, tied embeddings as in GPT-2, and GPTStage, a pipeline stage of its blocks under the
full model's parameter names. char_gpt.py builds it from the task's options."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


class CausalSelfAttention(nn.Module):
    """q, k and v are separate Linears (not one fused qkv) so tensor parallelism can give each rank
    its heads of all three; -1 in the head views is the local head count (n_head / tp under TP). The
    same seed draws the same weights as the fused layout did, and fused `qkv` checkpoints still load
    (split by a pre-hook)."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.n_head, self.head_dim, self.dropout = n_head, n_embd // n_head, dropout
        self.q = nn.Linear(n_embd, n_embd, bias=bias)
        self.k = nn.Linear(n_embd, n_embd, bias=bias)
        self.v = nn.Linear(n_embd, n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)
        self._register_load_state_dict_pre_hook(_split_fused_qkv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (
            lin(x).view(b, t, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.resid_dropout(self.proj(y.transpose(1, 2).contiguous().view(b, t, -1)))


def _split_fused_qkv(state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
    """A checkpoint of the fused layout (`attn.qkv.weight` [3C, C]) loads as q, k, v: its thirds in
    order."""
    for kind in ("weight", "bias"):
        key = f"{prefix}qkv.{kind}"
        if key in state_dict:
            for name, part in zip("qkv", state_dict.pop(key).chunk(3, dim=0)):
                state_dict[f"{prefix}{name}.{kind}"] = part


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd, bias=bias),
            nn.GELU(),
            nn.Linear(4 * n_embd, n_embd, bias=bias),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        n_layer: int,
        n_head: int,
        n_embd: int,
        block_size: int,
        dropout: float = 0.0,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.block_size = block_size
        self.tok = nn.Embedding(vocab_size, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout, bias) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.tok.weight  # weight tying, as in GPT-2
        # The positions a forward embeds, as a buffer context parallel can shard like the batch: a
        # rank of a CP group holds non-adjacent slices of each sequence (load balancing), so
        # arange(t) would be wrong there.
        self.register_buffer("positions", torch.arange(block_size), persistent=False)
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith(("proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.tok(idx) + self.pos(self.positions[: idx.shape[1]]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class GPTStage(nn.Module):
    """Pipeline stage: consecutive blocks of a GPT under the full model's attribute names (a
    ModuleDict keyed by the block's index), with the embeddings on the first stage and ln_f + head
    on the last."""

    def __init__(self, gpt: GPT, block_ids: list[int], first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.tok, self.pos, self.drop = gpt.tok, gpt.pos, gpt.drop
            # sharded under cp, as GPT's
            self.register_buffer("positions", gpt.positions, persistent=False)
        self.blocks = nn.ModuleDict({str(i): gpt.blocks[i] for i in block_ids})
        if last:
            self.ln_f, self.head = gpt.ln_f, gpt.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.drop(self.tok(x) + self.pos(self.positions[: x.shape[1]]))
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.ln_f(x)) if self.last else x
