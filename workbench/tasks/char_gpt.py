"""char-gpt: a GPT-style character model (causal self-attention via scaled_dot_product_attention).

Sizes go from a CPU smoke run ('tiny') to GPT-2 small ('gpt2-small', 124M-class with a char
vocabulary); any of n_layer, n_head, n_embd, block_size given in task_options overrides the preset's
value for that size alone, whichever preset is chosen; left out (None), the preset's value is used.
The network itself (GPT, its blocks and pipeline stages) is gpt_model.py's.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from workbench.config.mesh import virtual_stages
from workbench.tasks.base import Task
from workbench.tasks.gpt_model import GPT, GPTStage
from workbench.tasks.options import TaskOption

if TYPE_CHECKING:
    from workbench.config import RunConfig

PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64},
    "small": {"n_layer": 6, "n_head": 6, "n_embd": 384, "block_size": 256},
    "gpt2-small": {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024},
}

_FROM_PRESET = "the preset's value"


def _size(name: str, what: str, high: int) -> TaskOption:
    """A size the preset sets unless given: None (blank in the panel) takes the preset's value."""
    by_preset = ", ".join(f"{preset} {sizes[name]}" for preset, sizes in PRESETS.items())
    return TaskOption(
        name,
        int,
        None,
        f"{what}; overrides the preset's ({by_preset})",
        min=1,
        max=high,
        unset=_FROM_PRESET,
    )


OPTIONS: tuple[TaskOption, ...] = (
    TaskOption(
        "preset",
        str,
        "tiny",
        "model size: "
        + "; ".join(
            f"{p} {s['n_layer']} layers x {s['n_embd']} wide, {s['block_size']} tokens"
            for p, s in PRESETS.items()
        )
        + ". n_layer, n_head, n_embd and block_size, when given, override its values one by one",
        choices=tuple(PRESETS),
    ),
    _size("n_layer", "transformer blocks", 96),
    _size(
        "n_head", "attention heads; n_embd must be a multiple of it, and it a multiple of tp", 128
    ),
    _size("n_embd", "embedding width, a multiple of n_head", 16384),
    _size("block_size", "context length in characters (tokens per sample)", 32768),
    TaskOption(
        "dropout",
        float,
        0.0,
        "dropout on embeddings, attention and MLP outputs",
        min=0.0,
        max=1.0,
        max_exclusive=True,
    ),
    TaskOption("bias", bool, False, "biases in the Linear and LayerNorm layers, as GPT-2 has them"),
    TaskOption("dataset", str, "tinyshakespeare", "data-manifests dataset of the text to train on"),
    TaskOption(
        "eval_fraction",
        float,
        0.1,
        "share of the text, from its end, held out for evaluation",
        min=0.0,
        max=1.0,
        min_exclusive=True,
        max_exclusive=True,
    ),
    TaskOption(
        "train_stride",
        int,
        1,
        "characters between the starts of training windows (1: every position)",
        min=1,
    ),
)
"""char-gpt's options; the sizes are None by default so an explicit one wins over any preset."""


class CharWindows(Dataset):
    """Every window of block_size + 1 characters starting at a multiple of `stride`: (input,
    next-char target)."""

    def __init__(self, ids: torch.Tensor, block_size: int, stride: int) -> None:
        self.ids, self.block_size, self.stride = ids, block_size, stride
        self.n = max(0, (len(ids) - block_size - 1) // stride + 1)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.stride
        chunk = self.ids[start : start + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


@dataclasses.dataclass(frozen=True)
class _Corpus:
    """A text dataset as characters: its sorted vocabulary and each character's index in it."""

    dataset: str
    path: Path
    vocab: tuple[str, ...]
    ids: torch.Tensor

    @classmethod
    def of(cls, dataset: str, path: Path, text: str) -> _Corpus:
        vocab = tuple(sorted(set(text)))
        dtype = torch.int16 if len(vocab) > 255 else torch.uint8
        if not text:
            return cls(dataset, path, vocab, torch.zeros(0, dtype=dtype))
        points = torch.frombuffer(bytearray(text.encode("utf-32-le")), dtype=torch.int32).long()
        # code point -> its place in the vocabulary
        index = torch.zeros(ord(vocab[-1]) + 1, dtype=torch.int16)
        index[[ord(c) for c in vocab]] = torch.arange(len(vocab), dtype=torch.int16)
        return cls(dataset, path, vocab, index[points].to(dtype))


_LAST: _Corpus | None = None


class CharGPTTask(Task):
    name = "char-gpt"
    option_specs = OPTIONS

    def model_options(self, cfg: RunConfig) -> dict[str, Any]:
        o = self.options(cfg)
        size = dict(PRESETS[o["preset"]])
        size.update({k: o[k] for k in size if o[k] is not None})
        return {**size, "dropout": o["dropout"], "bias": o["bias"]}

    def resolved_options(self, cfg: RunConfig) -> dict[str, Any]:
        return {**self.options(cfg), **self.model_options(cfg)}

    def _read(self, cfg: RunConfig) -> _Corpus:
        """The dataset's text, vocabulary and ids, encoded once per process for the file the dataset
        resolves to: the caller's checks read it before the ranks fork, and forked ranks inherit it
        (encoding 1 M characters took each rank 0.1 s a launch)."""
        global _LAST
        from workbench import data

        dataset = self.options(cfg)["dataset"]
        path = next(iter(data.resolve(dataset, progress=False).files.values()))
        if _LAST is None or (_LAST.dataset, _LAST.path) != (dataset, path):
            # on the CPU whatever device context the caller is in: the panel counts parameters by
            # building the model under torch.device("meta"), and a corpus made there would be kept
            # on meta for every later use
            with torch.device("cpu"):
                # one kept: it can be large
                _LAST = _Corpus.of(dataset, path, path.read_text(encoding="utf-8"))
        return _LAST

    def datasets(self, cfg: RunConfig) -> list[str]:
        return [self.options(cfg)["dataset"]]

    def vocab(self, cfg: RunConfig) -> list[str]:
        return list(self._read(cfg).vocab)

    def build_model(self, cfg: RunConfig) -> GPT:
        return GPT(vocab_size=len(self._read(cfg).vocab), **self.model_options(cfg))

    def build_datasets(self, cfg: RunConfig) -> tuple[CharWindows, CharWindows]:
        ids = self._read(cfg).ids
        o, block = self.options(cfg), self.model_options(cfg)["block_size"]
        split = int(len(ids) * (1 - o["eval_fraction"]))
        return (
            CharWindows(ids[:split], block, o["train_stride"]),
            CharWindows(ids[split:], block, block),
        )

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        logits = model(x)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))

    def context_parallel_buffers(
        self, model: nn.Module, batch: Any
    ) -> list[tuple[torch.Tensor, int]]:
        """Inputs and targets along dimension 1, and the model's positions along 0: sharded
        together, each rank's tokens keep their own positions. Under a pipeline `model` is the
        rank's stages and the batch holds what the rank's stages take (inputs on the first, targets
        on the last, None elsewhere)."""
        x, y = batch
        positions = [
            b for name, b in model.named_buffers() if name.rsplit(".", 1)[-1] == "positions"
        ]
        if x is not None and positions and x.shape[1] != len(positions[0]):
            # the buffer is sharded whole: a shorter window would get wrong positions
            raise ValueError(
                f"cp: char-gpt windows of {x.shape[1]} characters, block_size={len(positions[0])}; "
                "context parallel needs full windows"
            )
        return [(t, 1) for t in (x, y) if t is not None] + [(b, 0) for b in positions]

    def tokens_per_sample(self, cfg: RunConfig) -> int:
        return self.model_options(cfg)["block_size"]

    def flops_per_sample(self, cfg: RunConfig, model: nn.Module) -> float:
        # PaLM appendix B / nanoGPT: 6N per token for the weights plus 12*L*H*Q*T for attention.
        m = self.model_options(cfg)
        n_params = sum(p.numel() for p in model.parameters()) - m["block_size"] * m["n_embd"]
        t = m["block_size"]
        per_token = (
            6 * n_params + 12 * m["n_layer"] * m["n_head"] * (m["n_embd"] // m["n_head"]) * t
        )
        return float(per_token * t)

    def tensor_parallel_plan(self, model: nn.Module, cfg: RunConfig) -> dict[str, Any]:
        """Megatron's split per block: q, k, v and the MLP's up projection column-wise (each rank
        its heads and its slice of the hidden units), the attention and MLP output projections
        row-wise (partial sums all-reduced). Embeddings, layer norms and the tied head stay
        replicated, which keeps the tie as it is."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        plan: dict[str, Any] = {}
        for i in range(len(model.blocks)):  # type: ignore[arg-type]
            for name in ("attn.q", "attn.k", "attn.v", "mlp.0"):
                plan[f"blocks.{i}.{name}"] = ColwiseParallel()
            for name in ("attn.proj", "mlp.2"):
                plan[f"blocks.{i}.{name}"] = RowwiseParallel()
        return plan

    def pipeline_stages(
        self, model: nn.Module, cfg: RunConfig, stage: int, stages: int
    ) -> nn.Module:
        """Blocks balanced by parameter count over the stages (embeddings on the first, ln_f and the
        tied head on the last); each stage keeps the full model's parameter names."""
        from workbench.tasks.stages import balanced_split

        assert isinstance(model, GPT)
        costs = [float(sum(p.numel() for p in b.parameters())) for b in model.blocks]
        parts = balanced_split(costs, stages)
        return GPTStage(model, parts[stage], first=stage == 0, last=stage == stages - 1)

    def check_options(self, cfg: RunConfig) -> None:
        # types and ranges, from OPTIONS; what follows relates options to each other
        super().check_options(cfg)
        m = self.model_options(cfg)
        if m["n_embd"] % m["n_head"]:
            raise ValueError(
                f"task_options.n_embd={m['n_embd']} is not divisible by n_head={m['n_head']}; "
                f"use a multiple, e.g. n_embd={m['n_head'] * 64}"
            )
        if m["n_head"] % cfg.tp:
            ok = [
                d
                for d in range(1, m["n_head"] + 1)
                if m["n_head"] % d == 0 and cfg.num_processes % d == 0
            ]
            raise ValueError(
                f"tp={cfg.tp}: task 'char-gpt' has n_head={m['n_head']} attention heads, which "
                f"tensor parallelism can't split over {cfg.tp} ranks; use "
                f"tp={' or '.join(map(str, ok))}, or "
                f"task_options.n_head={cfg.tp * max(1, m['n_head'] // cfg.tp)} (a multiple of tp)"
            )
        stages = cfg.pp * virtual_stages(cfg) if cfg.pp > 1 else 1
        if stages > m["n_layer"]:
            what = f"pp={cfg.pp}" + (
                f" x {stages // cfg.pp} chunks per rank" if stages > cfg.pp else ""
            )
            raise ValueError(
                f"{what}: task 'char-gpt' has n_layer={m['n_layer']} blocks, fewer than the "
                f"{stages} pipeline stages; use fewer stages, or task_options.n_layer={stages}"
            )
