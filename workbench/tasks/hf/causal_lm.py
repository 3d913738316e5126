"""`hf-causal-lm`: a transformers causal language model trained on next-token prediction.

The dataset's texts are tokenized (an end-of-text token after each), concatenated and cut into
windows of seq_len + 1 tokens, one after the other: a sample is (input ids, the same shifted by
one), the form a pipeline's last stage computes its loss from (Task.loss with the stage's output
standing in for the model). The loss is transformers' own (cross-entropy of the logits against
the next token), in fp32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.nn import functional as F
from torch.utils.data import Dataset

from workbench.tasks.hf.task import HFTask
from workbench.tasks.hf.text import tokenized

if TYPE_CHECKING:
    from workbench.config import RunConfig


class PackedWindows(Dataset):
    """Consecutive windows of `seq_len` + 1 tokens of one long stream: (input, next-token target).
    A map-style dataset, so each rank's shard and a resumed run's position are the sampler's."""

    def __init__(self, ids: torch.Tensor, seq_len: int) -> None:
        self.ids, self.seq_len = ids, seq_len
        self.n = max(0, (len(ids) - 1) // seq_len)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.seq_len
        chunk = self.ids[start : start + self.seq_len + 1].long()
        return chunk[:-1], chunk[1:]


_STREAMS: dict[tuple[str, str], torch.Tensor] = {}
"""Token streams by tokenization key, kept for the process (forked ranks inherit them)."""


class CausalLMTask(HFTask):
    name = "hf-causal-lm"
    auto_class = "AutoModelForCausalLM"
    peft_task_type = "CAUSAL_LM"

    def stream(self, cfg: RunConfig, split: str, rows: Any) -> torch.Tensor:
        """The split's tokens, end to end, from the tokenization cache."""
        tokenizer = self.tokenizer(cfg)
        field = self.options(cfg)["text_field"]
        eos = tokenizer.eos_token_id
        key = self.tokenize_key(cfg, "causal", eos)
        if (key, split) not in _STREAMS:

            def work(batch: dict[str, list[Any]]) -> dict[str, list[list[int]]]:
                ids = tokenizer(batch[field], add_special_tokens=True)["input_ids"]
                return {"input_ids": [x + [eos] for x in ids]}

            data = tokenized(rows, key, split, work, ["input_ids"])
            flat = data.data.column("input_ids").combine_chunks().flatten()
            _STREAMS[(key, split)] = torch.from_numpy(flat.to_numpy().astype("int32"))
        return _STREAMS[(key, split)]

    def build_datasets(self, cfg: RunConfig) -> tuple[PackedWindows, PackedWindows | None]:
        seq_len = self.options(cfg)["seq_len"]
        train_rows, eval_rows = self.rows(cfg)
        self.save_tokenizer(cfg)
        train = PackedWindows(self.stream(cfg, "train", train_rows), seq_len)
        if len(train) == 0:
            raise ValueError(
                f"task_options.seq_len={seq_len}: the training text has "
                f"{len(train.ids):,} tokens, not one window of {seq_len + 1}; use a shorter "
                "seq_len or more text"
            )
        evaluation = (
            PackedWindows(self.stream(cfg, "eval", eval_rows), seq_len)
            if eval_rows is not None
            else None
        )
        return train, (evaluation if evaluation is not None and len(evaluation) else None)

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        out = model(x)
        # a transformers model returns its output; a pipeline's last stage (or the stand-in for
        # it) the logits
        logits = getattr(out, "logits", out)
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
