"""The trained model back in the caller's process: weights from a run directory, whatever trained
them.

The final weights are model.safetensors (written once by rank 0 from the full state, for every
mode), and a chosen step's are the model part of its DCP checkpoint, resharded on load into one
process. Neither path unpickles anything from the run directory but DCP's own metadata; rank values
are read with `torch.load(weights_only=True)`. The rank side's half: a rank's value stored, the
weights digest (`state_digest`), and the tensors model.safetensors is written from.
"""

from __future__ import annotations

import hashlib
import io
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from workbench.training.checkpoint.files import (
    CheckpointLoadError,
    ModelMismatchError,
    failure_summary,
    is_checkpoint_exception,
    model_differences,
    saved_model_shapes,
    shapes_of,
    trained_state,
    verify_part,
)
from workbench.utils.distributed import single_process_dcp

if TYPE_CHECKING:
    from workbench.config import RunConfig
    from workbench.rundir import RunDir
    from workbench.tasks import Task

log = logging.getLogger("workbench")


def load_model(
    run: RunDir,
    cfg: RunConfig,
    task: Task,
    *,
    step: int | None = None,
    device: str | torch.device = "cpu",
) -> torch.nn.Module:
    """`task`'s model with the run's final weights (step=None) or those of the checkpoint at `step`,
    on `device`, in eval mode.

    The final weights are model.safetensors, which only the session that wrote the summary exports
    (its sha256 is the summary's weights_sha256). A session that ends without exporting (diverged,
    failed, killed) leaves neither: each session removes an earlier one's export as it starts. Then
    the final weights are the newest complete checkpoint, which after a divergence is the last good
    one (nothing is saved after a bad step); the warning names the divergence."""
    # seeded as the ranks build it: what a checkpoint leaves out (frozen parameters: a LoRA run's
    # base) is the same here
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = task.build_model(cfg)
    if step is None and run.weights_path.exists():
        _load_final(run, model.state_dict())
    else:
        _load_checkpoint(run, trained_state(model), step)
    return model.to(device).eval()


def _load_final(run: RunDir, state: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import load_file

    saved = load_file(str(run.weights_path))
    differences = model_differences(shapes_of(saved), shapes_of(state))
    if differences:
        raise ModelMismatchError(
            f"{run.weights_path} doesn't match the task's model: {differences}. {_CHANGED_CODE}"
        )
    summary = run.summary()
    _same_session(run, summary.steps, summary.status)
    want = summary.weights_sha256
    if want and state_digest(saved) != want:
        raise ValueError(
            f"{run.weights_path} does not match the sha256 in summary.json (damaged or replaced); "
            "load a checkpoint instead: load_model(step=N)"
        )
    with torch.no_grad():
        for name, tensor in state.items():
            tensor.copy_(saved[name])


def _same_session(run: RunDir, steps: int | None, status: Any) -> None:
    """Refuse model.safetensors written at another step than the summary's: an earlier session's
    export in a run directory from before sessions removed it (a resumed run that then diverged)."""
    from safetensors import safe_open

    with safe_open(str(run.weights_path), framework="pt") as f:
        written_at = (f.metadata() or {}).get("step")
    if steps is None or written_at is None or not written_at.isdigit() or int(written_at) == steps:
        return
    found = [s for s, _ in run.checkpoints() if s <= steps]
    hint = f"load_model(step={found[-1]})" if found else "load_model(step=N) with a kept step"
    raise ValueError(
        f"{run.weights_path} holds the weights of step {written_at}, but the run's summary says "
        f"{steps} steps ({status}): they are an earlier session's, not this run's final weights; "
        f"load a checkpoint instead: {hint}"
    )


def _load_checkpoint(run: RunDir, state: dict[str, torch.Tensor], step: int | None) -> None:
    import torch.distributed.checkpoint as dcp

    found = dict(run.checkpoints())
    if not found:
        raise FileNotFoundError(_no_weights_yet(run, step))
    if step is None:
        step = max(found)
        log.warning(
            "%s has no %s%s; loading the newest checkpoint (step %d)",
            run.name,
            run.weights_path.name,
            _why_no_weights(run),
            step,
        )
    if step not in found:
        raise ValueError(
            f"step={step}: {_not_complete(run, step)}{run.name} has complete "
            f"checkpoints at steps {sorted(found)} only (keep_checkpoints keeps the "
            "newest few)"
        )
    verify_part(found[step], "model")  # as a resume would: a damaged shard must not load as weights
    # Checked first: DCP would load a model that lost a layer without a word, and report a changed
    # one as a CheckpointException (a BaseException, past `except Exception`) without the
    # parameter's name.
    differences = model_differences(saved_model_shapes(found[step] / "model"), shapes_of(state))
    if differences:
        raise ModelMismatchError(
            f"checkpoint {found[step]} doesn't match the task's model: {differences}. "
            f"{_CHANGED_CODE}"
        )
    # DCP loads in place into the tensors of `state` (the model's own), resharding whatever layout
    # saved them; without a process group it loads in this one process, which is what is meant here.
    try:
        with single_process_dcp():
            dcp.load({"model": state}, checkpoint_id=str(found[step] / "model"))
    except BaseException as e:
        if not is_checkpoint_exception(e):
            raise
        raise CheckpointLoadError(
            f"checkpoint {found[step]}: the model could not be loaded: {failure_summary(e)}"
        ) from e


def _why_no_weights(run: RunDir) -> str:
    """Why a run that has checkpoints exported no weights, when its ending says ('' otherwise): a
    divergence is named, so the last good checkpoint is never taken for weights trained to the
    end."""
    try:
        summary = run.summary()
    except ValueError:  # a damaged summary: said where it is read
        return ""
    ending = summary.ending or {}
    if summary.status == "diverged" and ending.get("message"):
        return f" (the session {ending['message']}: it exported no weights)"
    return ""


def _not_complete(run: RunDir, step: int) -> str:
    """What there is of an incomplete checkpoint at `step` ('' when nothing): a write that never
    finished (the run stopped or was killed while writing it), or a folder without its manifest."""
    from workbench.rundir import COMPLETE_MARKER

    partial = run.checkpoints_path / f".tmp-step_{step}"
    if partial.is_dir():
        return (
            f"the checkpoint at step {step} is incomplete ({partial}: its write never "
            "finished, the run stopped while writing it) and is never loaded; "
        )
    named = run.checkpoints_path / f"step_{step}"
    if named.is_dir():
        return f"{named} has no {COMPLETE_MARKER} (incomplete or damaged) and is never loaded; "
    return ""


_CHANGED_CODE = (
    "The task's code changed since the run saved it (the config is the run's own): load it with "
    "the task as it was (wb.RunResult(run_dir, task=TheTaskAsItWas())), or build the model "
    "yourself and load what matches"
)


def _no_weights_yet(run: RunDir, step: int | None) -> str:
    """Why a run has no weights to load: still before its first checkpoint, or ended without one."""
    from workbench.rundir import Status

    try:
        status, _ = run.observed_status()
    except ValueError:  # a damaged summary: said where it is read
        status = None
    if status in (Status.STARTING, Status.RUNNING):
        row = run.last_train_row()
        at = f" (at step {row['step']})" if row and row.get("step") is not None else ""
        cfg = run.config()
        every = cfg.checkpoint_every if cfg is not None else 0
        when = (
            f"its first checkpoint comes at step {every}"
            if every
            else "with checkpoint_every=0 it saves only at the end (or when stopped)"
        )
        return (
            f"{run.name} is still {status.value}{at} and has saved no checkpoint yet: {when}. Wait "
            "for it, then call load_model() again, or load_model(step=N) with a step it has saved "
            "by then"
        )
    ended = (
        f"the run ended ({status.value}) before saving any weights"
        if status
        else "no weights were saved"
    )
    return f"{run.path} has neither {run.weights_path.name} nor a complete checkpoint: {ended}"


def save_rank_value(run: RunDir, rank: int, value: Any) -> None:
    """Store what a rank's Task.rank_value returned, refusing what the caller couldn't load
    safely."""
    buffer = io.BytesIO()
    try:
        # may already fail: pickle can't store everything (bound hooks, lambdas)
        torch.save(value, buffer)
        torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    except Exception as e:  # noqa: BLE001  (pickle's errors vary by what it met)
        raise TypeError(
            f"rank_value returned a {type(value).__name__} that can't be loaded safely "
            f"(saved and read back with torch.load(weights_only=True): {str(e).splitlines()[0]}); "
            "return tensors, numbers, "
            "strings, and lists/tuples/dicts of them"
        ) from e
    run.write_rank_value(rank, buffer.getvalue())


def rank_values(run: RunDir) -> list[Any]:
    """Every rank's value in rank order (None for a rank that returned none)."""
    world = int(run.summary().to_dict().get("world_size") or 0)
    values = []
    for rank in range(world):
        path = Path(run.rank_values_path) / f"rank_{rank}.pt"
        values.append(torch.load(path, weights_only=True) if path.exists() else None)
    return values


def state_digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 over the tensors of a state dict, by name, bit for bit: equal digests mean
    bit-identical tensors (the replica check, exported weights, benches)."""
    h = hashlib.sha256()
    for name, tensor in sorted(state.items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def safetensors_ready(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full weights as model.safetensors takes them: on the CPU, contiguous, and tied weights
    copied (safetensors refuses tensors that share memory; the copy keeps each name loadable)."""
    seen: set[int] = set()
    tensors = {}
    for name, tensor in full.items():
        tensor = tensor.detach().cpu().contiguous()
        tensors[name] = tensor.clone() if tensor.data_ptr() in seen else tensor
        seen.add(tensor.data_ptr())
    return tensors
