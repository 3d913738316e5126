"""What the Hugging Face tasks share: their options, the model (a folder's weights or an
architecture at seeded random init, LoRA on request), the tokenizer, and the rows they read.

The model is built the same on every rank and in `load_model` (random init under the run's seed), so
a LoRA run's frozen base is the same wherever it is rebuilt. The parallel layout is the model's own
(tasks/model_plans.py): nothing here names an architecture.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from workbench.tasks.base import Task
from workbench.tasks.hf import lora, text
from workbench.tasks.hf.sources import ModelSource
from workbench.tasks.options import TaskOption

if TYPE_CHECKING:
    from workbench.config import RunConfig

log = logging.getLogger("workbench")

SMALL_SHAPE: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
"""The architecture's shape when model_config is left out: a model to try things with on a CPU
(transformers' own defaults are the 7B-class originals)."""
DEFAULT_TRAINED_VOCAB = 8000

OPTIONS: tuple[TaskOption, ...] = (
    TaskOption(
        "model",
        str,
        "llama",
        "a local model folder (config.json + safetensors, from save_pretrained), or an "
        "architecture name transformers knows (llama, qwen2, mistral, gpt2, ...) built at random "
        "init",
    ),
    TaskOption(
        "model_config",
        object,
        None,
        "config overrides, e.g. {num_hidden_layers: 2}: on an architecture, on top of "
        "transformers' defaults; on a folder, on top of its config.json",
        unset=f"an architecture's small shape ({SMALL_SHAPE['num_hidden_layers']} layers x "
        f"{SMALL_SHAPE['hidden_size']} wide); a folder's own config",
    ),
    TaskOption(
        "dataset",
        str,
        "tinyshakespeare",
        "a data-manifests name, or local files (a path, glob or folder) of "
        "json/jsonl/parquet/csv/text, read with datasets",
    ),
    TaskOption("text_field", str, "text", "the column holding the text"),
    TaskOption(
        "tokenizer",
        str,
        None,
        "a tokenizer folder, or train:<vocab size> to train a BPE on the training text",
        unset=f"the model folder's; {text.TRAIN_PREFIX}{DEFAULT_TRAINED_VOCAB} for an architecture",
    ),
    TaskOption("seq_len", int, 256, "tokens per sample", min=2, max=131072),
    TaskOption(
        "eval_fraction",
        float,
        0.05,
        "share of the rows, from the end, held out for evaluation (0: none)",
        min=0.0,
        max=1.0,
        max_exclusive=True,
    ),
    TaskOption(
        "lora",
        object,
        None,
        "LoRA adapters through peft: {r, alpha, dropout, target_modules}; only they train",
        unset="train every weight",
    ),
    TaskOption(
        "trust_remote_code",
        bool,
        False,
        "run Python code shipped in the model folder (auto_map); read it first",
    ),
    TaskOption(
        "allow_pickle",
        bool,
        False,
        "read pickled weights (pytorch_model.bin) with torch.load(weights_only=True)",
    ),
)

_TOKENIZERS: dict[tuple[Any, ...], Any] = {}
"""Tokenizers by what they were made from, kept for the process: the checks before launch make
them, forked ranks inherit them."""


_ROWS: dict[tuple[Any, ...], tuple[Any, Any | None]] = {}
"""The rows by the files' fingerprint and the split, kept for the process (memory-mapped arrow
tables: cheap to keep)."""


class HFTask(Task):
    """A built-in task around a transformers model; subclasses say which head and which data."""

    option_specs = OPTIONS
    auto_class: ClassVar[str] = "AutoModel"
    """transformers' Auto class whose from_config / from_pretrained builds the model."""
    peft_task_type: ClassVar[str] = ""

    # ---- options ---------------------------------------------------------------------------
    def source(self, cfg: RunConfig) -> ModelSource:
        return ModelSource.of(self.options(cfg)["model"])

    def model_overrides(self, cfg: RunConfig) -> dict[str, Any]:
        given = self.options(cfg)["model_config"]
        if given is None:
            return dict(SMALL_SHAPE) if self.source(cfg).architecture else {}
        return dict(given)

    def tokenizer_spec(self, cfg: RunConfig) -> str | None:
        spec = self.options(cfg)["tokenizer"]
        if spec is None and self.source(cfg).architecture:
            return f"{text.TRAIN_PREFIX}{DEFAULT_TRAINED_VOCAB}"
        return spec

    def resolved_options(self, cfg: RunConfig) -> dict[str, Any]:
        o = self.options(cfg)
        return {
            **o,
            "model_config": o["model_config"] or self.model_overrides(cfg) or None,
            "tokenizer": self.tokenizer_spec(cfg),
            "lora": lora.lora_settings(o["lora"]),
        }

    def check_options(self, cfg: RunConfig) -> None:
        super().check_options(cfg)
        o = self.options(cfg)
        source = self.source(cfg)
        source.check(trust_remote_code=o["trust_remote_code"], allow_pickle=o["allow_pickle"])
        if o["model_config"] is not None and not isinstance(o["model_config"], dict):
            raise ValueError(
                f"task_options.model_config={o['model_config']!r}: a dict of config overrides, "
                "e.g. {'num_hidden_layers': 2}, or None"
            )
        text.trained_vocab(self.tokenizer_spec(cfg))
        lora.lora_settings(o["lora"])
        text.TextSource.of(o["dataset"])
        self.check_shape(cfg, self.hf_config(cfg))

    def check_shape(self, cfg: RunConfig, config: Any) -> None:
        """The config against the run: the sequence fits the positions, the heads split over tp."""
        o = self.options(cfg)
        positions = getattr(config, "max_position_embeddings", None)
        if isinstance(positions, int) and o["seq_len"] > positions:
            raise ValueError(
                f"task_options.seq_len={o['seq_len']} is more than the model's "
                f"max_position_embeddings={positions}; use seq_len<={positions}, or "
                f"model_config={{'max_position_embeddings': {o['seq_len']}}} on an architecture"
            )
        heads = [getattr(config, n, None) for n in ("num_attention_heads", "num_key_value_heads")]
        for name, count in zip(("num_attention_heads", "num_key_value_heads"), heads):
            if isinstance(count, int) and count % cfg.tp:
                raise ValueError(
                    f"tp={cfg.tp}: the model's {name}={count} can't be split over {cfg.tp} "
                    f"ranks; use a tp that divides it, or model_config={{'{name}': "
                    f"{cfg.tp * max(1, count // cfg.tp)}}}"
                )

    def datasets(self, cfg: RunConfig) -> list[str]:
        source = text.TextSource.of(self.options(cfg)["dataset"])
        return [source.manifest] if source.manifest else []

    # ---- the model ---------------------------------------------------------------------------
    def hf_config(self, cfg: RunConfig) -> Any:
        """The model's transformers config, sized for the tokenizer."""
        o = self.options(cfg)
        config = self.source(cfg).config(
            self.model_overrides(cfg), trust_remote_code=o["trust_remote_code"]
        )
        tokenizer = self.tokenizer(cfg)
        vocab = len(tokenizer)
        if self.source(cfg).architecture and "vocab_size" not in (o["model_config"] or {}):
            config.vocab_size = vocab
        elif config.vocab_size < vocab:
            raise ValueError(
                f"the tokenizer has {vocab} tokens, the model's vocab_size is "
                f"{config.vocab_size}; use the model's own tokenizer, or a trained one of at most "
                f"{config.vocab_size} (task_options.tokenizer='train:{config.vocab_size}')"
            )
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            token_id = getattr(tokenizer, name, None)
            if token_id is not None and getattr(config, name, None) is None:
                setattr(config, name, token_id)
        if getattr(config, "pad_token_id", None) is None:
            config.pad_token_id = config.eos_token_id
        if self.source(cfg).architecture and o["model_config"] is None:
            # positions for the whole sequence, whatever the architecture calls them
            config.max_position_embeddings = max(o["seq_len"], 1024)
        self.adjust_config(cfg, config)
        return config

    def adjust_config(self, cfg: RunConfig, config: Any) -> None:
        """The head's settings on the config (the labels of a classifier)."""

    def build_model(self, cfg: RunConfig) -> torch.nn.Module:
        import transformers

        o = self.options(cfg)
        config = self.hf_config(cfg)
        auto = getattr(transformers, self.auto_class)
        # the same random init on every rank and in load_model: a LoRA run's frozen base is
        # rebuilt, not checkpointed
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            model = self.source(cfg).build(auto, config, trust_remote_code=o["trust_remote_code"])
            settings = lora.lora_settings(o["lora"])
            if settings is not None:
                model = lora.with_lora(model, settings, self.peft_task_type)
        return model

    # ---- the tokenizer and the rows ----------------------------------------------------------
    def tokenizer(self, cfg: RunConfig) -> Any:
        """The tokenizer: the model folder's, a folder's, or one trained on the training rows."""
        o = self.options(cfg)
        spec = self.tokenizer_spec(cfg)
        source = self.source(cfg)
        vocab = text.trained_vocab(spec)
        data = text.TextSource.of(o["dataset"])
        key = (
            spec,
            source.value,
            *((data.fingerprint(), o["text_field"], o["eval_fraction"]) if vocab else ()),
        )
        if key not in _TOKENIZERS:
            if vocab is None:
                made = text.load_tokenizer(spec, source, trust_remote_code=o["trust_remote_code"])
            else:
                train, _ = self.rows(cfg)
                digest = text.digest([data.fingerprint(), o["text_field"], o["eval_fraction"]])
                made = text.trained_tokenizer(vocab, train[o["text_field"]], f"bpe{vocab}-{digest}")
            if made.pad_token is None:
                made.pad_token = made.eos_token
            _TOKENIZERS[key] = made
        return _TOKENIZERS[key]

    def rows(self, cfg: RunConfig) -> tuple[Any, Any | None]:
        """The dataset's rows, split into training and evaluation rows: read once per process for
        the files as they are (the tokenizer, the labels and the datasets all ask for them)."""
        o = self.options(cfg)
        source = text.TextSource.of(o["dataset"])
        key = (source.fingerprint(), o["text_field"], o["eval_fraction"])
        if key not in _ROWS:
            rows = source.rows()
            text.check_field(rows, o["text_field"], "text_field", source)
            _ROWS[key] = text.split_rows(rows, o["eval_fraction"])
        return _ROWS[key]

    def tokenize_key(self, cfg: RunConfig, *settings: Any) -> str:
        """What a tokenized split depends on: the files, the tokenizer, the fields, `settings`."""
        o = self.options(cfg)
        data = text.TextSource.of(o["dataset"])
        return text.digest(
            [
                type(self).__name__,
                data.fingerprint(),
                text.tokenizer_digest(self.tokenizer(cfg)),
                o["text_field"],
                o["eval_fraction"],
                *settings,
            ]
        )

    def save_tokenizer(self, cfg: RunConfig) -> None:
        """The tokenizer into the run directory (once; any rank may get there first), so that
        save_pretrained and a later resume use the one this run trained with."""
        from workbench.rundir import RunDir

        if cfg.run_dir is not None and cfg.run_dir.is_dir():
            RunDir(cfg.run_dir).write_tokenizer(self.tokenizer(cfg))

    # ---- sizes -------------------------------------------------------------------------------
    def tokens_per_sample(self, cfg: RunConfig) -> int:
        return self.options(cfg)["seq_len"]

    def flops_per_sample(self, cfg: RunConfig, model: torch.nn.Module) -> float:
        """PaLM's count per token: 2 FLOPs per weight forward and 2 for the input's gradient
        backward, 2 more for the weight's gradient where it trains (a frozen LoRA base has none),
        plus attention's 12 x layers x width x sequence; the input embedding is a lookup."""
        config = self.hf_config(cfg)
        embedding = model.get_input_embeddings().weight  # type: ignore[operator]
        tied = bool(getattr(config, "tie_word_embeddings", False))
        matmul = trainable = 0
        for p in model.parameters():
            if p is embedding and not tied:
                continue
            matmul += p.numel()
            trainable += p.numel() if p.requires_grad else 0
        t = self.options(cfg)["seq_len"]
        layers = getattr(config, "num_hidden_layers", 0)
        width = getattr(config, "hidden_size", 0)
        per_token = 4 * matmul + 2 * trainable + 12 * layers * width * t
        return float(per_token * t)
