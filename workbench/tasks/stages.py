"""Pipeline-parallel helpers a task uses to cut its model into stages (Task.pipeline_stages)."""

from __future__ import annotations

from collections.abc import Sequence


def balanced_split(
    costs: Sequence[float], stages: int, first_extra: float = 0.0, last_extra: float = 0.0
) -> list[list[int]]:
    """Contiguous split of blocks (with these costs, e.g. parameter counts) into `stages` parts
    minimising the largest part; the first part also pays `first_extra` (embeddings), the last
    `last_extra` (the head). Exact dynamic programme, O(stages x blocks^2). A part may be empty when
    there are fewer blocks than stages."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        extra = (first_extra if s == 1 else 0.0) + (last_extra if s == stages else 0.0)
        for i in range(n + 1):
            for j in range(i + 1):  # part s-1 holds blocks j..i-1
                value = max(best[s - 1][j], prefix[i] - prefix[j] + extra)
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    parts, i = [], n
    for s in range(stages, 0, -1):
        j = cut[s][i]
        parts.append(list(range(j, i)))
        i = j
    return parts[::-1]
