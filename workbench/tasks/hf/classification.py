"""`hf-sequence-classification`: a transformers model with a classification head, a label per text.

Texts are tokenized to seq_len tokens (truncated, padded), with their attention mask; labels are the
`label_field` column's values: integers 0..K-1 kept as they are, anything else (strings, other
integers) numbered in sorted order, with the names in the model's id2label. A sample is ((input
ids, attention mask), label).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.nn import functional as F
from torch.utils.data import Dataset

from workbench.tasks.hf.task import OPTIONS, HFTask
from workbench.tasks.options import TaskOption

if TYPE_CHECKING:
    from workbench.config import RunConfig

CLASSIFICATION_OPTIONS: tuple[TaskOption, ...] = (
    *(
        TaskOption(
            "dataset",
            str,
            None,
            "local files (a path, glob or folder) of json/jsonl/parquet/csv, or a data-manifests "
            "name, with a text and a label column",
            unset="none: name the labelled data",
        )
        if spec.name == "dataset"
        else TaskOption("seq_len", int, 128, "tokens per text (truncated, padded)", min=2)
        if spec.name == "seq_len"
        else spec
        for spec in OPTIONS
    ),
    TaskOption("label_field", str, "label", "the column holding each text's label"),
)


class LabelledTexts(Dataset):
    """Tokenized texts and their label ids: ((input_ids, attention_mask), label)."""

    def __init__(self, data: Any) -> None:
        with_torch = data.with_format("torch")
        self.ids = with_torch["input_ids"]
        self.mask = with_torch["attention_mask"]
        self.labels = with_torch["label"]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        return (self.ids[i], self.mask[i]), self.labels[i]


class SequenceClassificationTask(HFTask):
    name = "hf-sequence-classification"
    option_specs = CLASSIFICATION_OPTIONS
    auto_class = "AutoModelForSequenceClassification"
    peft_task_type = "SEQ_CLS"

    def check_options(self, cfg: RunConfig) -> None:
        if self.options(cfg)["dataset"] is None:
            raise ValueError(
                "task_options.dataset: hf-sequence-classification needs labelled data: local "
                "json/jsonl/csv/parquet files with a text and a label column, e.g. "
                "dataset='data/reviews.jsonl', text_field='text', label_field='label'"
            )
        super().check_options(cfg)
        if cfg.pp > 1:
            raise ValueError(
                f"pp={cfg.pp}: hf-sequence-classification has no pipeline stages (its head "
                "reads the attention mask, which a pipeline doesn't carry between stages); set "
                "pp=1 and shard with parallelism='zero3' or split with tp"
            )

    def labels(self, cfg: RunConfig) -> list[Any]:
        """The label values of the training rows, in the order of their ids."""
        field = self.options(cfg)["label_field"]
        train, _ = self.rows(cfg)
        from workbench.tasks.hf.text import TextSource, check_field

        check_field(train, field, "label_field", TextSource.of(self.options(cfg)["dataset"]))
        values = train.unique(field)
        if len(values) < 2:
            raise ValueError(
                f"task_options.label_field={field!r}: the training rows have "
                f"{len(values)} label value(s) ({values}); a classifier needs at least two"
            )
        ints = all(isinstance(v, int) and not isinstance(v, bool) for v in values)
        if ints and sorted(values) == list(range(len(values))):
            return sorted(values)
        return sorted(values, key=lambda v: (type(v).__name__, v))

    def adjust_config(self, cfg: RunConfig, config: Any) -> None:
        labels = self.labels(cfg)
        config.num_labels = len(labels)
        config.id2label = {i: str(v) for i, v in enumerate(labels)}
        config.label2id = {str(v): i for i, v in enumerate(labels)}

    def build_datasets(self, cfg: RunConfig) -> tuple[LabelledTexts, LabelledTexts | None]:
        from workbench.tasks.hf.text import tokenized

        o = self.options(cfg)
        tokenizer = self.tokenizer(cfg)
        labels = self.labels(cfg)
        index = {v: i for i, v in enumerate(labels)}
        field, label_field, seq_len = o["text_field"], o["label_field"], o["seq_len"]
        train_rows, eval_rows = self.rows(cfg)
        self.save_tokenizer(cfg)
        key = self.tokenize_key(cfg, "classification", label_field, seq_len, labels)

        def work(batch: dict[str, list[Any]]) -> dict[str, Any]:
            unknown = sorted({str(v) for v in batch[label_field] if v not in index})
            if unknown:
                raise ValueError(
                    f"task_options.label_field={label_field!r}: label(s) {unknown} in the "
                    f"evaluation rows never occur in the training rows ({labels}); give the "
                    "training rows every label"
                )
            out = tokenizer(batch[field], truncation=True, max_length=seq_len, padding="max_length")
            return {
                "input_ids": out["input_ids"],
                "attention_mask": out["attention_mask"],
                "label": [index[v] for v in batch[label_field]],
            }

        columns = ["input_ids", "attention_mask", "label"]
        train = LabelledTexts(tokenized(train_rows, key, "train", work, columns))
        evaluation = (
            LabelledTexts(tokenized(eval_rows, key, "eval", work, columns))
            if eval_rows is not None
            else None
        )
        return train, evaluation

    def loss(
        self, model: torch.nn.Module, batch: Any
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        (ids, mask), labels = batch
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
        accuracy = (logits.argmax(-1) == labels).float().mean()
        return F.cross_entropy(logits, labels), {"accuracy": accuracy}
