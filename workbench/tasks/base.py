"""Task: what to train. A task builds the model and datasets and computes the loss; the trainer does
the rest."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from workbench.tasks.options import TaskOption, option_table
from workbench.utils.suggest import did_you_mean

if TYPE_CHECKING:
    from workbench.config import RunConfig

log = logging.getLogger("workbench")
_TRAIN_SIZES: dict[tuple[type, str], int | None] = {}
"""Training-set sizes by task class and options: the panel checks on every change, tasks are made
fresh."""


class Task:
    """Base class for user and built-in tasks.

    Subclass it anywhere (a notebook cell included), then `wb.launch(cfg, task=MyTask())`, or
    decorate the class with `@wb.register_task` and name it in `RunConfig(task=...)`.
    """

    name: ClassVar[str] = "task"
    option_specs: ClassVar[tuple[TaskOption, ...]] = ()
    """The task's options declared with type, default, range or choices and help (see TaskOption):
    checked by check_options before launch, shown in the panel. default_options follows from
    them."""
    default_options: ClassVar[dict[str, Any]] = {}
    """Task options and their defaults; RunConfig.task_options may override these keys, no others. A
    task that declares option_specs gets it made from them; one that sets only this dict (the older
    way) still works, its options checked against their default's type."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "option_specs" in cls.__dict__:
            names = [spec.name for spec in cls.option_specs]
            twice = sorted({n for n in names if names.count(n) > 1})
            if twice:
                raise ValueError(
                    f"{cls.__name__}.option_specs: {twice} declared more than once; keep one of "
                    "each"
                )
            inherited = super(cls, cls).default_options  # keys the parent's code reads stay options
            own = cls.__dict__.get("default_options", {})
            cls.default_options = {
                **inherited,
                **{s.name: s.default for s in cls.option_specs},
                **own,
            }
        # a default its declaration refuses fails here, early
        option_table(cls.option_specs, cls.default_options)

    def declared_options(self) -> dict[str, TaskOption]:
        """Every option the task takes, by name in default_options' order: its TaskOption from
        option_specs, or one inferred from its default (its type, no range) for options only
        default_options names."""
        return option_table(self.option_specs, self.default_options)

    def build_model(self, cfg: RunConfig) -> torch.nn.Module:
        raise NotImplementedError(
            f"{type(self).__name__}.build_model(cfg) must return a torch.nn.Module"
        )

    def build_datasets(self, cfg: RunConfig) -> tuple[Any, Any | None]:
        raise NotImplementedError(
            f"{type(self).__name__}.build_datasets(cfg) must return (train, eval or None)"
        )

    def loss(
        self, model: torch.nn.Module, batch: Any
    ) -> torch.Tensor | tuple[torch.Tensor, dict[str, Any]]:
        raise NotImplementedError(
            f"{type(self).__name__}.loss(model, batch) must return a scalar tensor"
        )

    # Optional hooks
    # ------------------------------------------------------------------------------------
    def collate_fn(self, cfg: RunConfig) -> Any:
        """DataLoader collate function; None uses PyTorch's default."""
        return None

    def tokens_per_sample(self, cfg: RunConfig) -> int | None:
        """Tokens in one sample, for token tasks (tokens/s); None for others."""
        return None

    def flops_per_sample(self, cfg: RunConfig, model: torch.nn.Module) -> float | None:
        """Training FLOPs (forward + backward) per sample, for MFU on GPUs; None when unknown."""
        return None

    def shard_units(self, model: torch.nn.Module) -> list[torch.nn.Module] | None:
        """Submodules to shard (zero2/zero3/hsdp) and checkpoint (activation_checkpointing) as
        units, in forward order; the root is always a unit on top. None means the repeated blocks
        (children of a ModuleList). Tied parameters must sit in one unit (or both in the root)."""
        return None

    def tensor_parallel_plan(self, model: torch.nn.Module, cfg: RunConfig) -> dict[str, Any] | None:
        """For tp > 1: {submodule name: parallel style} for
        torch.distributed.tensor.parallel.parallelize_module, names relative to `model` (e.g.
        {'blocks.0.attn.q': ColwiseParallel(), 'blocks.0.attn.proj': RowwiseParallel()}); modules
        left out stay replicated on every rank of a TP group. None (the default) means the task
        can't be split, and a run with tp > 1 is refused before launch."""
        return None

    def pipeline_stages(
        self, model: torch.nn.Module, cfg: RunConfig, stage: int, stages: int
    ) -> torch.nn.Module | None:
        """For pp > 1: the part of `model` that pipeline stage `stage` (0-based, of `stages`) runs,
        as an nn.Module whose forward takes the previous stage's output (the batch's input on stage
        0) and whose last stage returns what `loss` gets from the model. Keep the full model's
        parameter names (a ModuleDict keyed by block index keeps `blocks.<i>.`), so checkpoints load
        under any layout. Tied parameters may sit on two stages: their gradients are summed between
        them. None (the default): refused before launch."""
        return None

    def context_parallel_buffers(
        self, model: torch.nn.Module, batch: Any
    ) -> list[tuple[torch.Tensor, int]] | None:
        """For cp > 1: the tensors that run along the sequence, each with its sequence dimension:
        the batch's (inputs and targets) and any of the model's buffers indexed by position
        (torchtitan's rotary table, char-gpt's positions). PyTorch's context_parallel shards them in
        place for the forward and backward (each rank of a CP group keeps 2 of every sequence's 2 x
        cp chunks, one from the head and one from the tail) and restores them after; attention must
        be F.scaled_dot_product_attention, which it turns into ring attention. `model` is the
        parallel model as the strategy holds it; under a pipeline (pp > 1), this rank's stages (an
        nn.ModuleList), with None in `batch` for what they don't take (inputs off the first stage,
        targets off the last): name what there is. None (the default): cp > 1 is refused."""
        return None

    def configure_optimizers(
        self, model: torch.nn.Module, cfg: RunConfig
    ) -> torch.optim.Optimizer | None:
        """Your optimizer for `model` (nanoGPT's hook name), or None for AdamW(lr, beta1, beta2,
        eps, weight decay on matrices only). Called on every rank after the model is made parallel:
        build it from the parameters `model` has then (sharded ones included), and don't move them.
        Each param group's lr is the peak that `lr_scale` scales; the optimizer's state is
        checkpointed and resumed like AdamW's."""
        return None

    def lr_scale(self, step: int, cfg: RunConfig) -> float:
        """Learning-rate multiplier at optimizer step `step` (0-based), applied to every param
        group's peak lr: linear warm-up over cfg.warmup_steps, then cosine down to cfg.min_lr_ratio.
        Override it for your own schedule (return 1.0 for a constant lr)."""
        from workbench.tasks.schedule import lr_at

        return lr_at(step, cfg) / cfg.lr

    def rank_value(self, model: torch.nn.Module, cfg: RunConfig) -> Any:
        """Called on every rank when the run completes or stops, with the trained model as the rank
        holds it (wrapped or sharded: call it on every rank alike); what it returns comes back in
        the caller's `result.rank_values`, in rank order. Tensors, numbers, strings and
        lists/tuples/dicts of them; None sends nothing."""
        return None

    def datasets(self, cfg: RunConfig) -> list[str]:
        """Names of the data-manifests datasets build_datasets reads: checked to be available
        offline (cache or mirror) before launch."""
        return []

    def train_size(self, cfg: RunConfig) -> int | None:
        """Samples in the training set, for the pre-launch check that one step's micro-batches fit
        in it. The default builds the datasets once per task_options (override it when that is
        expensive); None means unknown, not checked."""
        key, cache = (type(self), repr(sorted(self.options(cfg).items()))), _TRAIN_SIZES
        if key not in cache:
            try:
                built = self.build_datasets(cfg)
            except Exception as e:  # noqa: BLE001  (one only a rank can build)
                log.debug(
                    "%s: training-set size unknown before launch (%s: %s)",
                    self.name,
                    type(e).__name__,
                    e,
                )
                built = (None, None)
            else:
                # a pair that isn't one is the task's bug: said now, not by a rank
                dataset_pair(self, built)
            try:
                cache[key] = len(built[0])
            except TypeError:  # a dataset without len(), or none built
                cache[key] = None
        return cache[key]

    def check_datasets(self, cfg: RunConfig) -> None:
        """The datasets `datasets(cfg)` names are available offline (cache or mirror): nothing is
        fetched."""
        from workbench import data

        for name in self.datasets(cfg):
            try:
                data.resolve(name, offline=True, progress=False)
            except data.DataUnavailableError as e:
                raise ValueError(
                    f"task {self.name!r}: dataset {name!r} is not available offline "
                    f"({str(e).splitlines()[0]}); fetch it once with `workbench data fetch {name}` "
                    "or point WORKBENCH_DATA_MIRROR at a copy"
                ) from e

    def check_data(self, cfg: RunConfig) -> None:
        """Before launch: the datasets are available offline and one step's micro-batches fit in the
        training set (each data-parallel rank draws micro_batch_size samples of its 1/dp_size
        share)."""
        self.check_datasets(cfg)
        size = self.train_size(cfg) if cfg.micro_batch_size != "auto" else None
        if size is not None and cfg.micro_batch_size * cfg.dp_size > size:
            fit = max(1, size // cfg.dp_size)
            ranks = (
                f"num_processes={cfg.num_processes}"
                if cfg.tp == 1
                else f"data-parallel size {cfg.dp_size} (num_processes={cfg.num_processes} / "
                f"tp={cfg.tp})"
            )
            raise ValueError(
                f"micro_batch_size={cfg.micro_batch_size} x {ranks} is more than the {size:,} "
                f"training samples of task {self.name!r}: use micro_batch_size={fit} or fewer"
            )

    def options(self, cfg: RunConfig) -> dict[str, Any]:
        """default_options overridden by cfg.task_options."""
        return {**self.default_options, **cfg.task_options}

    def resolved_options(self, cfg: RunConfig) -> dict[str, Any]:
        """The options as the task uses them, with what None stands for filled in (char-gpt: the
        preset's sizes); the panel shows these beside blank boxes. The default: options(cfg)."""
        return self.options(cfg)

    def check_options(self, cfg: RunConfig) -> None:
        """Reject task_options keys this task doesn't know, naming the ones it does, and values
        outside their declaration (type, range, choices). Checks between options (n_embd a multiple
        of n_head) belong in the task's override, after this one."""
        unknown = sorted(set(cfg.task_options) - set(self.default_options))
        if unknown:
            known = ", ".join(sorted(self.default_options)) or "(none)"
            hints = "".join(did_you_mean(k, self.default_options) for k in unknown)
            raise ValueError(
                f"task_options: unknown key(s) {unknown} for task {self.name!r}; known: "
                f"{known}{hints}"
            )
        specs = self.declared_options()
        for key, value in cfg.task_options.items():
            specs[key].check(value)


def dataset_pair(task: Task, built: Any) -> tuple[Any, Any | None]:
    """What `task.build_datasets(cfg)` returned, checked: a (train, eval or None) pair whose eval
    set is not empty. TypeError or ValueError naming the method, what it returned and what it
    should."""
    method = f"{type(task).__name__}.build_datasets(cfg)"
    if not isinstance(built, (tuple, list)) or len(built) != 2:
        what = type(built).__name__
        if isinstance(built, (tuple, list)):
            what += f" of {len(built)} item(s)"
        elif hasattr(built, "__getitem__"):
            what += " (one dataset: return (dataset, None) to train without evaluation)"
        raise TypeError(
            f"{method} returned {what}; it must return a pair (train_dataset, eval_dataset or None)"
        )
    train, evaluation = built
    if train is None:
        raise TypeError(
            f"{method} returned None as the training set; it must return a pair (train_dataset, "
            "eval_dataset or None)"
        )
    if evaluation is not None and hasattr(evaluation, "__len__") and len(evaluation) == 0:
        raise ValueError(
            f"{method} returned an empty eval dataset ({type(evaluation).__name__} of 0 samples): "
            "evaluation would measure nothing and report no eval_loss; return (train, None) to "
            "train without evaluation, or give the eval split some samples"
        )
    return train, evaluation
