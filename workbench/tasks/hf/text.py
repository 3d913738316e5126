"""Text the `datasets` way: the files a task trains on, the tokenizer, and the tokenization cache.

`task_options.dataset` is a data-manifests name (resolved from the cache or a mirror, verified by
sha256) or local files: one path, a glob, or a folder, of json / jsonl / parquet / csv / text. They
are read with `datasets.load_dataset` (its arrow cache reused across runs); the last
`eval_fraction` of the rows (documents, before any packing) is held out for evaluation.

Tokenized once per dataset, tokenizer and settings, by whichever process gets there first (the
caller's checks before launch, usually; else one of the ranks) into the workbench data cache, as
arrow files written by `Dataset.map` under a fingerprint of its own (the files' sizes and times, the
tokenizer's content, the fields, the task's settings): later runs and the other ranks memory-map
them. The others wait on a file lock, up to WAIT_S.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench.tasks.hf.sources import ModelSource

log = logging.getLogger("workbench")

BUILDERS = {
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".txt": "text",
    ".text": "text",
    ".md": "text",
}
"""File suffixes `datasets` reads, by its builder's name."""
WAIT_S = 1800.0
"""How long a process waits for another one tokenizing the same data before giving up."""
EOS = "<|endoftext|>"
PAD = "<pad>"
TRAIN_PREFIX = "train:"
MIN_TRAINED_VOCAB = 300
"""A trained byte-level BPE starts from 256 byte symbols and two special tokens."""


def cache_root() -> Path:
    """Where tokenizers and tokenized data are kept: beside the data-manifests cache."""
    from workbench.data import cache_dir

    return cache_dir() / "hf"


@dataclass(frozen=True)
class TextSource:
    """The files `task_options.dataset` names and the `datasets` builder that reads them."""

    value: str
    files: tuple[Path, ...]
    builder: str
    manifest: str | None = None
    """The data-manifests name, when the dataset is one (checked offline before launch)."""

    @classmethod
    def of(cls, value: str) -> TextSource:
        """The dataset's files, or ValueError saying why they can't be read and what would."""
        files = _local_files(value)
        manifest = None
        if not files:
            from workbench import data

            try:
                data.load_manifest(value)
            except data.ManifestError:
                raise ValueError(_not_found(value)) from None
            files = tuple(sorted(data.resolve(value, progress=False).files.values()))
            manifest = value
        kinds = {BUILDERS.get(f.suffix.lower()) for f in files}
        if None in kinds or len(kinds) != 1:
            suffixes = sorted({f.suffix or "(none)" for f in files})
            raise ValueError(
                f"task_options.dataset={value!r}: files of kind {', '.join(suffixes)}; give "
                f"files of one kind, one of {', '.join(sorted(BUILDERS))}"
            )
        return cls(value, files, kinds.pop() or "text", manifest)

    def fingerprint(self) -> str:
        """The files as they are now: a changed file is tokenized again."""
        stats = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in self.files]
        return digest({"files": stats, "builder": self.builder})

    def rows(self) -> Any:
        """The rows, read by `datasets` (a text file: one row per paragraph, line breaks kept)."""
        import datasets

        datasets.disable_progress_bars()  # a bar per split in the cell says nothing
        options: dict[str, Any] = {}
        if self.builder == "text":
            options = {"sample_by": "paragraph", "keep_linebreaks": True}
        return datasets.load_dataset(
            self.builder,
            data_files=[str(f) for f in self.files],
            split="train",
            cache_dir=str(cache_root() / "datasets"),
            **options,
        )


def _local_files(value: str) -> tuple[Path, ...]:
    path = Path(value).expanduser()
    if path.is_file():
        return (path,)
    if path.is_dir():
        return tuple(sorted(p for p in path.iterdir() if p.suffix.lower() in BUILDERS))
    if any(c in value for c in "*?["):
        return tuple(sorted(Path(p) for p in glob.glob(str(path)) if Path(p).is_file()))
    return ()


def _not_found(value: str) -> str:
    from workbench import data

    hub = "/" in value and not value.startswith(("/", ".", "~"))
    names = ", ".join(m.name for m in data.list_manifests())
    why = (
        "looks like a Hugging Face Hub dataset, and workbench downloads nothing at run time; "
        "save it once as files (`datasets.load_dataset(...).to_json('data/train.jsonl')`) and "
        "pass dataset='data/train.jsonl'"
        if hub
        else "is neither local files (a path, a glob or a folder of json/jsonl/parquet/csv/text) "
        f"nor a data manifest (known: {names or 'none'})"
    )
    return f"task_options.dataset={value!r} {why}"


def split_rows(rows: Any, eval_fraction: float) -> tuple[Any, Any | None]:
    """The first rows for training, the last `eval_fraction` of them for evaluation (None: no
    evaluation)."""
    n = len(rows)
    held = int(n * eval_fraction)
    if eval_fraction > 0 and held == 0 and n > 1:
        held = 1
    if n - held < 1:
        raise ValueError(
            f"the dataset has {n} row(s): too few to hold out eval_fraction={eval_fraction}; "
            "give more rows or task_options.eval_fraction=0"
        )
    train = rows.select(range(n - held))
    return train, (rows.select(range(n - held, n)) if held else None)


def check_field(rows: Any, field: str, option: str, source: TextSource) -> None:
    if field not in rows.column_names:
        raise ValueError(
            f"task_options.{option}={field!r}: dataset {source.value!r} has no such column; its "
            f"columns: {', '.join(rows.column_names)}"
        )


# ---- the tokenizer ---------------------------------------------------------------------------
def trained_vocab(spec: str | None) -> int | None:
    """N for 'train:N', None for anything else; ValueError for a malformed 'train:'."""
    if not spec or not spec.startswith(TRAIN_PREFIX):
        return None
    text = spec[len(TRAIN_PREFIX) :]
    if not text.isdigit() or int(text) < MIN_TRAINED_VOCAB:
        raise ValueError(
            f"task_options.tokenizer={spec!r}: train:<vocab size> with a vocabulary of at least "
            f"{MIN_TRAINED_VOCAB} tokens, e.g. 'train:8000'"
        )
    return int(text)


def load_tokenizer(spec: str | None, model: ModelSource, *, trust_remote_code: bool) -> Any:
    """The model folder's tokenizer (spec None) or a tokenizer folder's. ValueError when there is
    none."""
    from transformers import AutoTokenizer

    folder = Path(spec).expanduser() if spec else model.folder
    if folder is None:
        raise ValueError(
            f"task_options.model={model.value!r} is an architecture, which has no tokenizer; "
            "set task_options.tokenizer='train:8000' (trained on the dataset) or a tokenizer "
            "folder"
        )
    if not folder.is_dir():
        raise ValueError(
            f"task_options.tokenizer={spec!r} is not a folder; give a tokenizer folder "
            "(save_pretrained), or 'train:<vocab size>'"
        )
    try:
        return AutoTokenizer.from_pretrained(
            folder, local_files_only=True, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError) as e:
        what = "task_options.tokenizer" if spec else f"the model folder {folder}"
        raise ValueError(
            f"{what}: no tokenizer could be read there ({str(e).splitlines()[0]}); set "
            "task_options.tokenizer='train:8000' to train one on the dataset"
        ) from e


def trained_tokenizer(vocab: int, texts: Any, key: str) -> Any:
    """A byte-level BPE of `vocab` tokens trained with `tokenizers` on `texts`, kept in the cache
    under `key` (the text and the size): trained once, by one process."""
    from transformers import PreTrainedTokenizerFast

    folder = cache_root() / "tokenizers" / key
    with held_lock(folder.with_suffix(".lock"), f"training the tokenizer {folder.name}"):
        if not (folder / "tokenizer.json").is_file():
            started = time.monotonic()
            tokenizer = _train_bpe(vocab, texts)
            staging = folder.with_name(folder.name + ".tmp")
            tokenizer.save_pretrained(staging)
            staging.replace(folder)
            log.info(
                "trained a %d-token BPE tokenizer in %.1f s (%s)",
                vocab,
                time.monotonic() - started,
                folder,
            )
    return PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True)


def _train_bpe(vocab: int, texts: Any) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token=EOS, bos_token=EOS, pad_token=PAD
    )


def tokenizer_digest(tokenizer: Any) -> str:
    """The tokenizer's content: a different one tokenizes again."""
    return digest(json.loads(tokenizer.backend_tokenizer.to_str()))


# ---- the tokenization cache ------------------------------------------------------------------
def tokenized(rows: Any, key: str, split: str, work: Any, columns: list[str]) -> Any:
    """`rows` mapped through `work` (batched), cached under `key`: mapped once by whichever process
    holds the lock first, memory-mapped by the others and by later runs."""
    import datasets

    datasets.disable_progress_bars()
    folder = cache_root() / "tokenized" / key
    path = folder / f"{split}.arrow"
    with held_lock(folder.with_suffix(".lock"), f"tokenizing {split} ({folder.name})"):
        if not path.is_file():
            folder.mkdir(parents=True, exist_ok=True)
            started = time.monotonic()
            rows.map(
                work,
                batched=True,
                remove_columns=rows.column_names,
                cache_file_name=str(path),
                new_fingerprint=f"{key}-{split}",
                desc=None,
            )
            log.info(
                "tokenized %d %s rows in %.1f s (%s)",
                len(rows),
                split,
                time.monotonic() - started,
                path,
            )
    data = datasets.Dataset.from_file(str(path))
    missing = set(columns) - set(data.column_names)
    assert not missing, f"{path} lacks {missing}"
    return data


class held_lock:  # noqa: N801  (used as a context manager, like a function)
    """A file lock, waited for up to WAIT_S, saying who waits for what."""

    def __init__(self, path: Path, what: str) -> None:
        import filelock

        path.parent.mkdir(parents=True, exist_ok=True)
        self.lock, self.what = filelock.FileLock(str(path)), what

    def __enter__(self) -> None:
        import filelock

        try:
            self.lock.acquire(timeout=1.0)
        except filelock.Timeout:
            log.info("waiting for another process %s (lock %s)", self.what, self.lock.lock_file)
            try:
                self.lock.acquire(timeout=WAIT_S)
            except filelock.Timeout:
                raise TimeoutError(
                    f"another process has been {self.what} for {WAIT_S:.0f} s (lock "
                    f"{self.lock.lock_file}); if none is, it died holding the lock: delete the file"
                ) from None

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


def digest(value: Any) -> str:
    """A short, stable hash of `value` (JSON-able), for cache keys."""
    text = json.dumps(value, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
