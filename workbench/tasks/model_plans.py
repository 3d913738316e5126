"""The plans a model declares for itself, behind the Task's own hooks: what the parallelize recipe
(training/parallel/apply.py) asks of a model, answered by the Task first and, where its hook returns
None, by the model.

A transformers `PreTrainedModel` declares its layout: `_no_split_modules` names the decoder-layer
class (the FSDP2 / activation-checkpointing / compile unit) and `config.base_model_tp_plan` (the
model-level `tp_plan`, prefixed with the base model's attribute) says which Linear is split by
column and which by row. These are translated to torch's ColwiseParallel / RowwiseParallel here, so
no architecture needs a table of ours. `config.base_model_pp_plan` gives the pipeline order
(embed_tokens -> layers -> norm), cut into stages by tasks/hf/stages.py. A model without a plan is
refused before launch, naming what is missing and the way out.

Kept outside training/ so that the preflight checks (config/preflight.py) can ask it of a model
built on the meta device without importing the trainer; transformers is never imported here: a
model is one of its models only if transformers is already loaded (the task built it).
"""

from __future__ import annotations

import re
import sys
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from workbench.config import RunConfig
    from workbench.tasks.base import Task

TP_STYLES = ("colwise", "rowwise")
"""transformers' tensor-parallel styles that map onto torch's own plan entries one to one. The
others in its plans (the embedding's 'embedding_rowwise', the head's 'colwise_gather_output', ...)
are left out: those modules stay replicated, which is correct and costs only their memory."""


def is_transformers_model(model: nn.Module) -> bool:
    """A transformers PreTrainedModel (peft's wrappers around one included)."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return False
    base = getattr(model, "get_base_model", None)
    inner = base() if callable(base) else model
    return isinstance(inner, transformers.PreTrainedModel)


def declared_units(model: nn.Module) -> list[nn.Module] | None:
    """A transformers model's blocks: the modules of the classes `_no_split_modules` names (its
    decoder layers), outermost only; None for other models or a model that names none."""
    if not is_transformers_model(model):
        return None
    names = set(getattr(model, "_no_split_modules", None) or ())
    if not names:
        return None
    units = [m for m in model.modules() if type(m).__name__ in names and m is not model]
    inner = {id(m) for u in units for m in u.modules() if m is not u}
    return [u for u in units if id(u) not in inner] or None


def declared_tp_plan(model: nn.Module) -> dict[str, Any] | None:
    """A transformers model's own tensor-parallel plan (model-level names, `*` for the layer index)
    as torch plan entries; None when the model declares none. Under peft's LoRA, the entries follow
    the adapters (adapted_plan)."""
    if not is_transformers_model(model):
        return None
    plan = dict(getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None) or {})
    entries = {name: style for name, style in plan.items() if style in TP_STYLES}
    if not entries:
        return None
    if callable(getattr(model, "get_base_model", None)):
        return adapted_plan(model, entries) or None
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    return {name: styles[style]() for name, style in entries.items()}


def adapted_plan(model: nn.Module, entries: dict[str, str]) -> dict[str, Any]:
    """The plan of a peft-wrapped model: the model's names sit under the wrapper's prefix
    ('base_model.model.'), and an adapted Linear is a LoRA layer around it (`base_layer`, with
    `lora_A` and `lora_B` per adapter). The base layer is split as the plan says; the adapter's
    path is split to match, so that its output adds to the base's shard: beside a column-wise
    layer, lora_B column-wise (lora_A, whole, reads the whole input); beside a row-wise layer,
    lora_A row-wise (it reads the sharded input; its small output is all-reduced) and lora_B
    whole."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    base = model.get_base_model()  # type: ignore[operator]
    prefix = next(name for name, module in model.named_modules() if module is base)
    modules = dict(model.named_modules())
    out: dict[str, Any] = {}
    for pattern, style in entries.items():
        full = re.compile(re.escape(f"{prefix}.{pattern}").replace(r"\*", r"[^.]+") + "$")
        for name, module in modules.items():
            if not full.match(name):
                continue
            if getattr(module, "base_layer", None) is None:
                out[name] = styles[style]()
                continue
            out[f"{name}.base_layer"] = styles[style]()
            part = "lora_B" if style == "colwise" else "lora_A"
            for adapter in getattr(module, part, {}):
                out[f"{name}.{part}.{adapter}"] = styles[style]()
    return out


def splits_heads(module: nn.Module) -> bool:
    """Whether `module`'s attention modules are a transformers model's (the model, or a pipeline
    stage of one), whose head counts follow a tensor-parallel split (divide_heads)."""
    return is_transformers_model(module) or getattr(module, "splits_heads", False) is True


def declared_stage(model: nn.Module, stage: int, stages: int) -> nn.Module | None:
    """Pipeline stage `stage` of `stages` of a transformers model, cut along the order its config
    declares (base_model_pp_plan); None for other models or a model that declares none."""
    if not is_transformers_model(model):
        return None
    from workbench.tasks.hf.stages import declared_stage as cut

    return cut(model, stage, stages)


def divide_heads(model: nn.Module, tp: int) -> None:
    """After the split, each attention module of a transformers model computes its share of the
    heads: attributes that count heads (older versions read them to reshape) are divided by tp.
    Current versions infer the count from the local projection's width and keep none."""
    for module in model.modules():
        for name in ("num_heads", "num_key_value_heads"):
            value = module.__dict__.get(name)
            if isinstance(value, int) and value % tp == 0:
                setattr(module, name, value // tp)


class ModelPlan:
    """The ParallelPlan the recipe follows: the Task's hooks, then what the model declares."""

    def __init__(self, task: Task) -> None:
        self.task = task
        self.name = task.name
        self.owner = type(task).__name__
        """Who answers for the hooks, in messages: the Task's class."""

    def shard_units(self, model: nn.Module) -> list[nn.Module] | None:
        units = self.task.shard_units(model)
        return units if units is not None else declared_units(model)

    def tensor_parallel_plan(self, model: nn.Module, cfg: RunConfig) -> dict[str, Any] | None:
        plan = self.task.tensor_parallel_plan(model, cfg)
        if plan is not None:
            return plan
        return declared_tp_plan(model)

    def pipeline_stages(
        self, model: nn.Module, cfg: RunConfig, stage: int, stages: int
    ) -> nn.Module | None:
        part = self.task.pipeline_stages(model, cfg, stage, stages)
        return part if part is not None else declared_stage(model, stage, stages)

    def missing(self, model: nn.Module, what: str) -> str:
        """Why there is no `what` ('tensor-parallel plan', 'pipeline stages', 'context-parallel
        buffers') for this model, and the way out, for a refusal."""
        hook, dim, declares = _MISSING[what]
        owner = type(self.task).__name__
        if is_transformers_model(model):
            return f"{type(model).__name__} {declares}; set {dim}=1, or define {owner}.{hook}"
        return f"task {self.name!r} has no {what} ({owner}.{hook} returns None)"


_MISSING = {
    "tensor-parallel plan": (
        "tensor_parallel_plan",
        "tp",
        "declares no tensor-parallel plan (config.base_model_tp_plan)",
    ),
    "pipeline stages": (
        "pipeline_stages",
        "pp",
        "declares no pipeline plan (config.base_model_pp_plan)",
    ),
    # Why a transformers model can't simply be given the sequence split: its forward makes the
    # position ids itself (arange over the sequence it sees), and from them its rotary (or learned)
    # position embeddings, so each rank of a CP group would embed its chunks of the sequence as if
    # they began at position 0 (and were contiguous), unlike one process.
    "context-parallel buffers": (
        "context_parallel_buffers",
        "cp",
        "computes its token positions inside its forward (position_ids = arange over the "
        "sequence it is given, then its rotary or learned position embeddings), which context "
        "parallel's sequence split can't reach: each rank would embed its chunks of the sequence "
        "as if they started at position 0, unlike one process",
    ),
}
"""For each thing a model may lack: the Task hook that provides it, the mesh dimension that needs
it, and what a transformers model lacks, in words."""
