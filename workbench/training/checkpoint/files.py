"""A checkpoint's files against its manifest: what the ranks hash when saving, and what both a
resume and `load_model(step=N)` verify before they trust a single byte of it."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

from workbench.rundir import COMPLETE_MARKER
from workbench.storage.remote import configure
from workbench.storage.store_path import Location, StorePath


def sha256(path: Location) -> str:
    h = hashlib.sha256()
    with path.open("rb") if isinstance(path, StorePath) else open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def files_in(root: Location) -> list[str]:
    """Every file under `root` but the manifest, as relative paths in a fixed order (the ranks split
    them)."""
    if isinstance(root, StorePath):
        return [f for f in root.files() if f.rsplit("/", 1)[-1] != COMPLETE_MARKER]
    return sorted(
        str(p.relative_to(root))
        for p in root.rglob("*")
        if p.is_file() and p.name != COMPLETE_MARKER
    )


def read_manifest(ckpt: Location) -> dict[str, dict[str, Any]]:
    """The manifest's files ({relative path: {size, sha256}}); ValueError saying why when it can't
    be read."""
    path = ckpt / COMPLETE_MARKER
    try:
        files = json.loads(path.read_bytes())["files"]
        if not isinstance(files, dict):
            raise TypeError(f"'files' is a {type(files).__name__}")
        return files
    except FileNotFoundError:
        raise ValueError(
            f"{COMPLETE_MARKER} is missing (the checkpoint is incomplete or was damaged)"
        ) from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{COMPLETE_MARKER} is unreadable ({type(e).__name__}: {e})") from None


def file_problems(
    ckpt: Location, manifest: dict[str, dict[str, Any]], names: Iterable[str]
) -> list[str]:
    """What is wrong with the files `names` of `ckpt` against `manifest` ([] when they all
    verify)."""
    found = []
    for name in names:
        path, want = ckpt / name, manifest[name]
        if not path.is_file():
            found.append(f"{name} is missing")
        elif path.stat().st_size != want.get("size"):
            found.append(
                f"{name} is {path.stat().st_size} bytes, the manifest says {want.get('size')} "
                "(truncated?)"
            )
        elif sha256(path) != want.get("sha256"):
            found.append(f"{name} does not match its sha256 (damaged)")
    return found


def verify_part(ckpt: Location, part: str) -> None:
    """Raise ValueError naming the damage when the files under `ckpt/part` don't match the manifest,
    or when the manifest lists none there."""
    try:
        manifest = read_manifest(ckpt)
    except ValueError as e:
        raise ValueError(
            f"checkpoint {ckpt}: {e}; load another step, or the final weights"
        ) from None
    names = sorted(n for n in manifest if n.startswith(f"{part}/"))
    found = (
        file_problems(ckpt, manifest, names) if names else [f"the manifest lists no {part}/ files"]
    )
    if found:
        raise ValueError(
            f"checkpoint {ckpt} is damaged: {'; '.join(found)}; load another step, or the final "
            "weights"
        )


class CheckpointLoadError(RuntimeError):
    """A checkpoint that verifies but that this model or optimizer can't take: torch's
    CheckpointException (a BaseException, which `except Exception` lets through) made an ordinary
    error saying what each rank met."""


class ModelMismatchError(ValueError):
    """Saved weights whose parameter names or shapes are not those of the task's model as its code
    builds it now (the task's code or options changed since): every difference named, with its
    shapes."""


Shapes = dict[str, "tuple[int, ...] | None"]
"""Parameter (or buffer) name -> its full shape; None for a saved value that isn't a tensor."""
SHOWN = 8
"""Names listed per kind of difference; the rest are counted."""


def trained_state(module: Any) -> dict[str, Any]:
    """`module.state_dict()` without its frozen parameters: what a checkpoint holds of the model
    (strategy.TRAINED, for the modules DCP's state-dict API doesn't handle, and load_model)."""
    frozen = {n for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in module.state_dict().items() if k not in frozen}


def shapes_of(state: Mapping[str, Any]) -> Shapes:
    """The full shape of every tensor in a model state dict (a DTensor's global shape, not its local
    shard)."""
    return {
        name: tuple(value.shape) if hasattr(value, "shape") else None
        for name, value in state.items()
    }


def metadata_reader(where: Location) -> Any:
    """DCP's reader for the checkpoint part at `where`: its fsspec reader on a store (the URL as
    is), its file reader on a local folder."""
    import torch.distributed.checkpoint as dcp

    if isinstance(where, StorePath) or "://" in str(where):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        configure(str(where))
        return FsspecReader(str(where))
    return dcp.FileSystemReader(str(where))


def saved_model_shapes(model_dir: Location) -> Shapes:
    """The model entries of a DCP checkpoint (checkpoints/step_<N>/model), read from its metadata
    alone."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = metadata_reader(model_dir).read_metadata().state_dict_metadata
    return {
        key.removeprefix("model."): tuple(meta.size)
        if isinstance(meta, TensorStorageMetadata)
        else None
        for key, meta in metadata.items()
    }


def _shape(shape: tuple[int, ...] | None) -> str:
    return "(not a tensor)" if shape is None else f"[{', '.join(map(str, shape))}]"


def _some(items: list[str]) -> str:
    return ", ".join(items[:SHOWN]) + (f", ... ({len(items)} in all)" if len(items) > SHOWN else "")


def model_differences(saved: Shapes, model: Shapes) -> str | None:
    """How the saved entries differ from the model's ('missing ...; unexpected ...; shape mismatch
    ...'), or None when every name and shape agrees."""
    missing = sorted(set(model) - set(saved))
    unexpected = sorted(set(saved) - set(model))
    mismatched = sorted(
        n
        for n in set(model) & set(saved)
        if saved[n] is not None and model[n] is not None and saved[n] != model[n]
    )
    parts = []
    if missing:
        parts.append(
            f"missing from the saved weights (the model has them): "
            f"{_some([f'{n} {_shape(model[n])}' for n in missing])}"
        )
    if unexpected:
        parts.append(
            f"unexpected (saved, the model has no such entry): "
            f"{_some([f'{n} {_shape(saved[n])}' for n in unexpected])}"
        )
    if mismatched:
        shapes = [f"{n} saved {_shape(saved[n])}, model {_shape(model[n])}" for n in mismatched]
        parts.append(f"shape mismatch: {_some(shapes)}")
    return "; ".join(parts) or None


def is_checkpoint_exception(error: BaseException) -> bool:
    """torch's CheckpointException (DCP's failure on any rank) derives from BaseException, so
    `except Exception` lets it through; an interrupt or exit is not one."""
    return not isinstance(error, (Exception, KeyboardInterrupt, SystemExit, GeneratorExit))


def failure_summary(error: BaseException) -> str:
    """One line per failure of a DCP CheckpointException (its message lists only the ranks), else
    the error's."""
    failures = getattr(error, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return (
            f"{type(error).__name__}: "
            f"{str(error).strip().splitlines()[0] if str(error).strip() else ''}"
        )
    lines = []
    for rank, failure in sorted(failures.items()):
        cause = failure[0] if isinstance(failure, tuple) and failure else failure
        lines.append(f"rank {rank}: {type(cause).__name__}: {str(cause).strip()}")
    return "; ".join(dict.fromkeys(lines))
