"""A pipeline rank's checkpoints and full weights, in the one-process format, so they load under any
layout.

Model keys are the full model's names (pipeline_parts.full_name drops the chunk list's index and the
checkpoint/compile wrappers); a tied parameter's optimizer state is saved once, under the name the
full model gives it (the first of its names), by the copy that counts; param groups are first merged
back to the task's grouping (tensor parallel splits them by mesh), then over the stages. DCP
reshards sharded and tensor-parallel parameters into whatever layout loads them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from workbench.training.parallel.param_groups import merge_split_groups, resplit_groups
from workbench.training.parallel.pipeline_parts import full_name
from workbench.training.parallel.strategy import LOAD_TRAINED, TRAINED, Strategy
from workbench.utils.distributed import single_process_dcp


class PipelineCheckpoints(Strategy):
    """What a pipeline strategy saves and loads; it sets _canonical, _tied, column and, when tensor
    parallel split the optimizer's param groups by mesh, _origin."""

    _canonical: dict[str, str]
    _tied: Any
    column: int

    def named_full_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        for name, p in self.module.named_parameters():
            yield full_name(name), p

    def _canon(self, name: str) -> str:
        full = full_name(name)
        return self._canonical.get(full, full)

    def state_dict(self) -> dict[str, Any]:
        """Model keyed by full names; optimizer state under canonical names (a tied parameter once);
        the param groups merged over the stages (collective)."""
        model, optim = get_state_dict(self.module, self.optimizer, options=TRAINED)
        uncounted = {id(p) for p in self.module.parameters()} & self._tied.uncounted()
        skipped = {n for n, p in self.module.named_parameters() if id(p) in uncounted}
        state = {self._canon(n): v for n, v in optim["state"].items() if n not in skipped}
        mine = [
            {**g, "params": [self._canon(n) for n in g["params"]]}
            for g in merge_split_groups(optim["param_groups"], self._origin)
        ]
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        return {
            "model": {full_name(k): v for k, v in model.items()},
            "optim": {"state": state, "param_groups": merge_param_groups(everyone)},
        }

    def load(self, path: Path) -> None:
        """Read this rank's parameters and their optimizer state from a checkpoint of any layout.

        Why not Strategy.load: DCP's state-dict API keys a chunk's state by the chunk list's names
        ('1.blocks.3._checkpoint_wrapped_module...') and holds one copy of a tied parameter per
        stage, while the checkpoint keys by the full model's names, each tied parameter once: the
        names are mapped here, around get_state_dict/set_state_dict."""
        model, optim = get_state_dict(self.module, self.optimizer, options=TRAINED)
        full = {full_name(k): v for k, v in model.items()}
        template = {
            "state": {self._canon(n): v for n, v in optim["state"].items()},
            "param_groups": merge_split_groups(optim["param_groups"], self._origin),
        }
        with single_process_dcp():
            dcp.load({"model": full}, checkpoint_id=str(path / "model"))
            dcp.load({"optim": template}, checkpoint_id=str(path / "optim"))
        local = {self._canon(n): n for n, _ in self.module.named_parameters()}
        state = {local[c]: v for c, v in template["state"].items() if c in local}
        groups = resplit_groups(
            optim["param_groups"], template["param_groups"], self._origin, self._canon
        )
        set_state_dict(
            self.module,
            self.optimizer,
            model_state_dict={k: full[full_name(k)] for k in model},
            optim_state_dict={"state": state, "param_groups": groups},
            options=LOAD_TRAINED,
        )

    def full_weights(self) -> dict[str, torch.Tensor]:
        """Every stage's weights (full names), gathered on rank 0 (other ranks get {}); sharded and
        tensor-parallel parameters are made whole within each stage first (collective there)."""
        if any(isinstance(p, DTensor) for p in self.module.parameters()):
            state = get_model_state_dict(
                self.module, options=StateDictOptions(full_state_dict=True)
            )
        else:
            state = self.module.state_dict()
        mine = (
            {full_name(k): v.detach().cpu() for k, v in state.items()} if self.column == 0 else {}
        )
        gathered: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
        dist.gather_object(mine, gathered if dist.get_rank() == 0 else None, dst=0)
        weights: dict[str, torch.Tensor] = {}
        for part in gathered:
            weights.update(part)
        return weights


def merge_param_groups(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The stages' param groups as the full model's optimizer has them: group i holds every stage's
    group-i parameters (each name once), with the hyperparameters the stages share."""
    counts = {len(groups) for groups in per_rank}
    if len(counts) != 1:
        raise ValueError(
            "pipeline stages built different numbers of optimizer param groups "
            f"({sorted(counts)}); Task.configure_optimizers must make the same groups on every "
            "stage (empty ones included)"
        )
    merged = [dict(g, params=[]) for g in per_rank[0]]
    for groups in per_rank:
        for target, group in zip(merged, groups):
            target["params"] += [n for n in group["params"] if n not in target["params"]]
    return merged
