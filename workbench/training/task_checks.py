"""One-off checks of what a Task gives the trainer, so that a wrong return fails at once, named,
instead of training wrong in silence or failing later in PyTorch's words (or hanging in a
collective).

- At build: the model has parameters to train (a frozen or parameter-less one has nothing for
  backward).
- The session's first optimizer step calls Task.loss through `CheckedTask`: each return is a scalar
  tensor that requires grad, with metrics that are named numbers. Then `FirstStep.check` takes one
  collective (every rank's metric keys, its unused parameters and a fingerprint of its gradients
  under DDP) and every rank raises the same error if the ranks disagree. Later steps call the task
  directly: none of this costs them anything.
- `explain_ddp_error`: DDP's error for a parameter left out of a later step's loss, with workbench's
  fix.
- At the end, `UnsyncedReplicas.at_end`: the replicas of a replicated layout ended with different
  parameters (the trainer compares their digests).
"""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING, Any

import torch
from accelerate.utils import gather_object
from torch.nn.parallel import DistributedDataParallel

if TYPE_CHECKING:
    from accelerate import Accelerator

    from workbench.config import RunConfig
    from workbench.tasks import Task
    from workbench.training.parallel import Strategy

BYPASS_FIX = (
    "the usual cause: Task.loss calls the wrapped module (`model.module(x)`, or the idiom "
    "`getattr(model, 'module', model)(x)`), which bypasses DistributedDataParallel's forward, the "
    "call that synchronises gradients; call the model you were given, `model(x)`"
)


class UnsyncedReplicas(RuntimeError):
    """The replicas of a replicated layout did not train as one model (gradients or weights
    differ)."""

    @classmethod
    def at_end(cls, parallelism: str, digests: list[str], syncs: list[Any]) -> UnsyncedReplicas:
        """The end-of-training check's error: the replicas' parameter digests and gradient syncs
        per rank, and the likely causes."""
        return cls(
            "the replicas' parameters differ at the end of training "
            f"(parallelism={parallelism!r}; sha256 "
            + ", ".join(f"rank {r}: {d[:12]}" for r, d in enumerate(digests))
            + f"; gradient syncs per rank: {syncs}): there is no one trained model, and "
            f"model.safetensors was not written. {BYPASS_FIX[0].upper()}{BYPASS_FIX[1:]}; or code "
            "changed parameters on some ranks only (an in-place edit under torch.no_grad())"
        )


def check_trainable(task: Task, model: torch.nn.Module) -> None:
    """At build: the model has parameters that require grad (every rank builds the same model, so
    all raise)."""
    params = list(model.parameters())
    if any(p.requires_grad for p in params):
        return
    what = (
        f"{type(model).__name__} with no parameters"
        if not params
        else f"{type(model).__name__} whose {len(params)} parameters all have requires_grad=False"
    )
    raise ValueError(
        f"{type(task).__name__}.build_model(cfg) returned a {what}: there is nothing to train "
        "(backward would fail with 'element 0 of tensors does not require grad'); return a model "
        "with trainable parameters (leave requires_grad=True on at least the ones to train)"
    )


def check_metrics(task: Task, metrics: Any) -> None:
    """Task.loss's metrics: a dict of named numbers (a Python number or a 0-dim real tensor)."""
    method = f"{type(task).__name__}.loss"
    if not isinstance(metrics, dict):
        raise TypeError(
            f"{method} returned (loss, {type(metrics).__name__}); the second item must be a dict "
            "of metrics, {name: number}"
        )
    for name, value in metrics.items():
        if not isinstance(name, str) or name == "loss":
            raise TypeError(
                f"{method} returned a metric named {name!r}: metric names must be strings other "
                "than 'loss' (the loss itself is reported as loss and eval_loss); rename it"
            )
        if isinstance(value, torch.Tensor):
            if value.dim() != 0 or value.is_complex():
                raise TypeError(
                    f"{method} returned metric {name!r} as a {value.dtype} tensor of shape "
                    f"{tuple(value.shape)}; a metric must be a scalar (a Python number or a 0-dim "
                    "real tensor): reduce it, e.g. `.mean()` or `.sum()`"
                )
        elif not isinstance(value, numbers.Real):
            raise TypeError(
                f"{method} returned metric {name!r} as {type(value).__name__} "
                f"({str(value)[:40]!r}); a metric must be a number (int, float or a 0-dim tensor); "
                "report text elsewhere (print, logging) and numbers here"
            )


def check_loss_return(task: Task, out: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    """Task.loss's return in training: a scalar tensor that requires grad, or (that, metrics)."""
    method = f"{type(task).__name__}.loss"
    if isinstance(out, tuple) and len(out) != 2:
        raise TypeError(
            f"{method} returned a tuple of {len(out)} items; it must return a scalar tensor, or a "
            "pair (scalar tensor, {name: number})"
        )
    loss, metrics = out if isinstance(out, tuple) else (out, {})
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = (
            f" of shape {tuple(loss.shape)} (reduce it, e.g. `.mean()`)"
            if isinstance(loss, torch.Tensor)
            else ""
        )
        raise TypeError(
            f"{method} returned {type(loss).__name__}{shape} as the loss; it must be a scalar "
            "tensor, alone or in a pair (scalar tensor, {name: number})"
        )
    check_metrics(task, metrics)
    if torch.is_grad_enabled() and not loss.requires_grad:
        raise TypeError(
            f"{method} returned a {loss.dtype} tensor that does not require grad (no grad_fn): "
            "backward has nothing to differentiate. Compute the loss from `model(...)`'s output "
            "in this call, not under torch.no_grad() and not through .detach(), .item() or "
            "torch.tensor(...)"
        )
    return loss, metrics


class CheckedTask:
    """The task as the first step calls it: every Task.loss return checked, its metric keys kept."""

    def __init__(self, task: Task) -> None:
        self.task = task
        self.keys: list[str] | None = None

    def loss(self, model: torch.nn.Module, batch: Any) -> Any:
        out = self.task.loss(model, batch)
        _, metrics = check_loss_return(self.task, out)
        keys = sorted(metrics)
        if self.keys is not None and keys != self.keys:
            raise ValueError(
                f"{type(self.task).__name__}.loss returned metrics {self.keys} on one micro-batch "
                f"and {keys} on another; return the same keys on every call (0.0 where there is "
                "nothing to report), as evaluation averages each over every batch"
            )
        self.keys = keys
        return out


def differing_keys(task: Task, keys_per_rank: list[list[str] | None], where: str) -> str | None:
    """The error for ranks that returned different metric keys (None when they agree)."""
    if all(k == keys_per_rank[0] for k in keys_per_rank):
        return None
    listed = "; ".join(f"rank {r}: {k}" for r, k in enumerate(keys_per_rank))
    return (
        f"{type(task).__name__}.loss returned different metric keys on different ranks {where} "
        f"({listed}); every rank must return the same keys, as the ranks sum each metric by name "
        "(different keys would leave them waiting for each other): return every key on every rank "
        "(0.0 where a rank has nothing to report)"
    )


class FirstStep:
    """Checks of the session's first step: `task` for its Task.loss calls, then `check()`
    (collective)."""

    def __init__(
        self, task: Task, strategy: Strategy, accelerator: Accelerator, cfg: RunConfig
    ) -> None:
        self.task, self.strategy, self.accelerator, self.cfg = (
            CheckedTask(task),
            strategy,
            accelerator,
            cfg,
        )
        self.ddp = isinstance(strategy.model, DistributedDataParallel)

    def check(self) -> None:
        """After the first step's backward, before its update: every rank raises the same error if
        the ranks returned different metric keys, left parameters out of the loss under DDP, or hold
        different gradients under DDP (it did not synchronise them)."""
        mine = {"keys": self.task.keys, **(self._ddp_facts() if self.ddp else {})}
        everyone = gather_object([mine]) if self.accelerator.num_processes > 1 else [mine]
        problem = differing_keys(
            self.task.task, [r["keys"] for r in everyone], "in the first training step"
        )
        if problem:
            raise ValueError(problem)
        if not self.ddp:
            return
        unused = [(rank, r["unused"]) for rank, r in enumerate(everyone) if r["unused"]]
        if unused:
            listed = "; ".join(
                f"rank {rank}: {', '.join(names[:8])}" + " ..." * (len(names) > 8)
                for rank, names in unused
            )
            raise ValueError(
                f"{type(self.task.task).__name__}.loss left parameters out of the first step's "
                f"loss ({listed}); DistributedDataParallel waits for their gradients and would "
                "fail at the next step. Set find_unused_parameters=True (RunConfig; DDP then "
                "looks for them after every forward), or make every parameter take part in the "
                "loss"
            )
        differ = [
            rank
            for rank, r in enumerate(everyone)
            if not _same_grads(r["grads"], everyone[0]["grads"])
        ]
        if differ:
            raise UnsyncedReplicas(
                "the ranks' gradients differ after the first step's backward (rank 0 and rank(s) "
                f"{differ}, parallelism={self.cfg.parallelism!r}): DistributedDataParallel did not "
                "all-reduce them, and each replica would train on its own batches alone; "
                f"{BYPASS_FIX}"
            )

    def _ddp_facts(self) -> dict[str, Any]:
        """This rank's parameters without a gradient (DDP without find_unused_parameters: left out
        of the loss) and a fingerprint of its gradients: which have one, and each one's sum and sum
        of magnitudes (the same on every rank once DDP has all-reduced them; one host sync,
        once)."""
        params = [(n, p) for n, p in self.strategy.module.named_parameters() if p.requires_grad]
        grads = [
            torch.stack([g.sum(), g.abs().sum()])
            for g in (p.grad.detach().double() for _, p in params if p.grad is not None)
        ]
        return {
            "unused": []
            if self.cfg.find_unused_parameters
            else [n for n, p in params if p.grad is None],
            "grads": (
                [p.grad is not None for _, p in params],
                torch.stack(grads).nan_to_num().tolist() if grads else [],
            ),
        }


def _same_grads(
    a: tuple[list[bool], list[list[float]]], b: tuple[list[bool], list[list[float]]]
) -> bool:
    """Two ranks' gradient fingerprints agree: all-reduced gradients are bitwise equal on every rank
    (NCCL sends the finished sum to all), but a tolerance of 1e-4 of each gradient's magnitude keeps
    a platform's rounding quirk from failing a run, while one replica's own batches (the gradients
    of a bypassed DDP) differ by far more."""
    if a[0] != b[0]:
        return False
    return all(
        abs(s1 - s2) <= 1e-4 * max(m1, m2) and abs(m1 - m2) <= 1e-4 * max(m1, m2)
        for (s1, m1), (s2, m2) in zip(a[1], b[1])
    )


def explain_ddp_error(error: RuntimeError) -> None:
    """Raise DDP's error for a parameter left out of a step's loss again, with workbench's fix;
    return otherwise."""
    text = str(error)
    if (
        "finished reduction in the prior iteration" in text
        and "find_unused_parameters=True` to" in text
    ):
        raise RuntimeError(
            "DistributedDataParallel found parameters that took no part in the previous step's "
            "loss on some rank (Task.loss used them on some batches only); set "
            "find_unused_parameters=True (RunConfig; DDP then looks for them after every "
            "forward), or make every parameter take part in every rank's loss. PyTorch's words: "
            + text.splitlines()[0]
        ) from error
