"""TrainerState: the progress a checkpoint carries, enough to continue a run bit for bit."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class TrainerState:
    """Progress saved with every checkpoint (trainer_state.json)."""

    step: int = 0
    micro_batches: int = 0
    """Micro-batches each rank has consumed: the position in the deterministic data order."""
    samples: int = 0
    tokens: int = 0
    skipped_steps: int = 0
    train_time_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainerState:
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})
