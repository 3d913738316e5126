"""Pipeline stages of a transformers model, cut along the plan it declares.

A transformers config declares its base model's pipeline order in `base_model_pp_plan` (Llama's:
embed_tokens -> layers -> norm) and the model class the modules after it in `_pp_plan` (the causal
LM's lm_head). A stage here holds the modules before the layers (first stage), a contiguous run of
decoder layers balanced by parameter count (tasks/stages.balanced_split), and the modules after
them plus the head (last stage), under the full model's parameter names (`model.layers` becomes a
ModuleDict keyed by the layer's index), so that checkpoints and full weights load under any layout
and a weight the model ties (embed_tokens and lm_head) is found on both stages by its names.

Between the modules the plan names, the base model's forward also gives each decoder layer its
position ids, the rotary position embeddings (from the model's `rotary_emb`, which holds only a
buffer, so every stage holds it and computes them from its own hidden states) and the causal mask,
made here by transformers' own mask functions for the configured attention: None for sdpa with no
padding (attention is then causal by sdpa's is_causal), an explicit mask for eager attention, a
sliding-window mask for the layers that slide. The stages take no attention mask from the batch: a
batch is (input_ids, labels) of packed, unpadded windows.

transformers is already loaded wherever a stage is built (the model is one of its models); it is
imported only inside functions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from workbench.tasks.stages import balanced_split

MASKS = ("full_attention", "sliding_attention")
"""The layer types whose masks the stages make (what `config.layer_types` may name)."""


@dataclass(frozen=True)
class PipelinePlan:
    """Where a transformers model's pipeline parts sit, by their names in the task's model."""

    before: list[str]
    """Run in order on the first stage (embed_tokens)."""
    layers: str
    """The ModuleList of decoder layers, split over the stages."""
    after: list[str]
    """Run in order on the last stage: the base model's modules after the layers (norm), then the
    model's own (lm_head)."""
    rotary: str | None
    """The base model's rotary embedding (a buffer, no parameters), on every stage."""
    config: Any
    """The transformers config (attention implementation, layer types, sliding window)."""


def declared_pipeline(model: nn.Module) -> PipelinePlan | None:
    """The pipeline order a transformers model declares (config.base_model_pp_plan), as names in
    `model` (peft's wrapper prefixes included); None when it declares none. ValueError when the
    plan can't be cut here, saying why."""
    found = _transformers_model(model)
    if found is None:
        return None
    path, lm = found
    plan = dict(getattr(lm.config, "base_model_pp_plan", None) or {})
    if not plan:
        return None
    base = lm.base_model
    base_path = _join(path, lm.base_model_prefix if base is not lm else "")
    lists = [n for n in plan if isinstance(getattr(base, n, None), nn.ModuleList)]
    name = type(lm).__name__
    if len(lists) != 1:
        raise ValueError(
            f"{name}'s pipeline plan (config.base_model_pp_plan: {', '.join(plan)}) names "
            f"{len(lists)} lists of layers; workbench splits one; set pp=1, or define the Task's "
            "pipeline_stages"
        )
    (layers,) = lists
    keys = list(plan)
    # the model's own modules after the base model (lm_head); an instance's _pp_plan also lists
    # the base model's, under its prefix
    heads = [
        n
        for n in dict(getattr(lm, "_pp_plan", None) or {})
        if base is not lm and n.split(".")[0] != lm.base_model_prefix
    ]
    left = [
        n
        for n, child in lm.named_children()
        if child is not base and n not in heads and any(True for _ in child.parameters())
    ] + [
        n
        for n, child in base.named_children()
        if n not in plan and n != "rotary_emb" and any(True for _ in child.parameters())
    ]
    if left:
        # a classifier's score reads the input ids to pool the last token: no stage has both
        raise ValueError(
            f"{name}'s pipeline plan (config.base_model_pp_plan and {type(lm).__name__}._pp_plan) "
            f"leaves out module(s) with weights: {', '.join(left)}; a pipeline stage would skip "
            "them. Set pp=1 (zero3 or tp split this model), or define the Task's pipeline_stages"
        )
    rotary = getattr(base, "rotary_emb", None)
    return PipelinePlan(
        before=[_join(base_path, n) for n in keys[: keys.index(layers)]],
        layers=_join(base_path, layers),
        after=[_join(base_path, n) for n in keys[keys.index(layers) + 1 :]]
        + [_join(path, n) for n in heads],
        rotary=_join(base_path, "rotary_emb") if isinstance(rotary, nn.Module) else None,
        config=lm.config,
    )


def declared_stage(model: nn.Module, stage: int, stages: int) -> nn.Module | None:
    """Stage `stage` (0-based, of `stages`) of a transformers model cut along its declared plan;
    None when it declares none."""
    plan = declared_pipeline(model)
    if plan is None:
        return None
    layers = model.get_submodule(plan.layers)
    size = _numel(model, plan.before), _numel(model, plan.after)
    parts = balanced_split(
        [sum(p.numel() for p in layer.parameters()) for layer in layers], stages, *size
    )
    return DecoderStage(model, plan, parts[stage], stage == 0, stage == stages - 1)


class DecoderStage(nn.Module):
    """One pipeline stage of a transformers model: its decoder layers (a ModuleDict keyed by the
    layer's index, at the full model's path), with the modules before them on the first stage and
    those after them on the last, all under the full model's names. forward takes input_ids on the
    first stage, else the previous stage's hidden states; returns hidden states, logits on the last
    stage."""

    splits_heads = True
    """tp: its attention modules are a transformers model's (model_plans.divide_heads)."""

    def __init__(
        self, model: nn.Module, plan: PipelinePlan, layer_ids: list[int], first: bool, last: bool
    ) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.before = plan.before if first else []
        self.after = plan.after if last else []
        self.layers_path, self.rotary_path = plan.layers, plan.rotary
        for name in self.before + self.after:
            _place(self, name, model.get_submodule(name))
        layers = model.get_submodule(plan.layers)
        _place(self, plan.layers, nn.ModuleDict({str(i): layers[i] for i in layer_ids}))
        if plan.rotary is not None:
            _place(self, plan.rotary, model.get_submodule(plan.rotary))
        self.kinds = [_layer_kind(plan.config, i) for i in layer_ids]
        self._masks = _mask_functions(plan.config, set(self.kinds))
        # the model's config, out of the module tree (a module attribute would be registered)
        self._config = plan.config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # modules are looked up at each call: activation checkpointing and compile='blocks' swap
        # the decoder layers in their ModuleDict after the stage is built
        for name in self.before:
            x = self.get_submodule(name)(x)
        layers = self.get_submodule(self.layers_path)
        if len(layers):
            x = self._decoder_layers(x, layers)
        for name in self.after:
            x = self.get_submodule(name)(x)
        return x

    def _decoder_layers(self, hidden: torch.Tensor, layers: nn.ModuleDict) -> torch.Tensor:
        """What the base model's forward gives each layer: positions 0..T-1 (no cache, no
        padding), their rotary embeddings and the causal mask of the layer's kind."""
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        rotary = self.get_submodule(self.rotary_path) if self.rotary_path else None
        embeddings = rotary(hidden, positions) if rotary is not None else None
        masks = {
            kind: make(
                config=self._config,
                inputs_embeds=hidden,
                attention_mask=None,
                cache=None,
                position_ids=positions,
            )
            for kind, make in self._masks.items()
        }
        for kind, layer in zip(self.kinds, layers.values()):
            out = layer(
                hidden,
                attention_mask=masks[kind],
                position_ids=positions,
                position_embeddings=embeddings,
                use_cache=False,
            )
            # transformers 4 returned a tuple (hidden states first), 5 the hidden states
            hidden = out[0] if isinstance(out, tuple) else out
        return hidden


def _transformers_model(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The transformers PreTrainedModel in `model` and its path ('' for the model itself, e.g.
    'base_model.model' under peft), outermost first."""
    import transformers

    for path, module in model.named_modules():
        if isinstance(module, transformers.PreTrainedModel):
            return path, module
    return None


def _layer_kind(config: Any, index: int) -> str:
    """The mask a decoder layer takes, as the base model's forward picks it: by
    config.layer_types (Qwen2), else a sliding window for every layer when the config has one
    (Mistral), else full causal attention (Llama)."""
    types = getattr(config, "layer_types", None)
    if types:
        kind = types[index]
        if kind not in MASKS:
            raise ValueError(
                f"layer {index} of the {config.model_type} model is a {kind!r} layer; the "
                f"pipeline stages make masks for {', '.join(MASKS)} only: set pp=1, or define the "
                "Task's pipeline_stages"
            )
        return kind
    return "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"


def _mask_functions(config: Any, kinds: set[str]) -> dict[str, Callable[..., Any]]:
    from transformers import masking_utils

    made = {
        "full_attention": masking_utils.create_causal_mask,
        "sliding_attention": masking_utils.create_sliding_window_causal_mask,
    }
    return {kind: made[kind] for kind in sorted(kinds)}


def _numel(model: nn.Module, names: list[str]) -> int:
    seen: set[int] = set()
    total = 0
    for name in names:
        for p in model.get_submodule(name).parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
    return total


def _place(root: nn.Module, path: str, module: nn.Module) -> None:
    """Set `module` at dotted `path` under `root`, with plain containers on the way, so that its
    parameters are named as the full model names them."""
    *parents, leaf = path.split(".")
    here = root
    for part in parents:
        if part not in here._modules:
            here.add_module(part, nn.Module())
        here = here._modules[part]  # type: ignore[assignment]
    here.add_module(leaf, module)


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)
