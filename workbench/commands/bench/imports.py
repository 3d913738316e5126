"""`workbench bench imports`: what importing the rank side costs on top of torch and accelerate.

Every rank of every spawned or multi-node start runs `python -m workbench.worker`, so whatever the
worker imports is paid once per rank. The worker loads the trainer only when its rank starts to
train, and the trainer only the parallel strategy its layout uses. Each pair starts two fresh
interpreters back to back, one importing torch and accelerate, the other those and then the worker,
alternating which goes first so a warming page cache favours neither; the verdict is on the median
of the pairs' differences.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from workbench.commands.bench.results import write_result

BASELINE = "import torch, accelerate"
RANK_SIDE = "import torch, accelerate, workbench.worker"
"""The worker on top of what every rank imports anyway, so the difference is workbench's own
cost."""
BUDGET_S = 0.2
"""How much the rank side may add to `import torch, accelerate` (issue 19's bound)."""

_TIMER = "import time; t = time.perf_counter(); {statement}; print(time.perf_counter() - t)"


@dataclass
class ImportReport:
    baseline_s: list[float] = field(default_factory=list)
    rank_side_s: list[float] = field(default_factory=list)
    budget_s: float = BUDGET_S

    @property
    def differences(self) -> list[float]:
        return [r - b for b, r in zip(self.baseline_s, self.rank_side_s)]

    @property
    def added_s(self) -> float:
        """The median of the pairs' differences: what the rank side adds."""
        return statistics.median(self.differences)

    @property
    def passed(self) -> bool:
        return self.added_s <= self.budget_s

    def table(self) -> str:
        base, rank = statistics.median(self.baseline_s), statistics.median(self.rank_side_s)
        verdict = "PASS" if self.passed else "FAIL"
        return "\n".join(
            [
                f"workbench bench imports: {len(self.differences)} pairs of fresh interpreters",
                f"  {BASELINE:50} median {base:6.3f} s",
                f"  {RANK_SIDE:50} median {rank:6.3f} s",
                f"  added by the rank side: {self.added_s:+.3f} s (median of the pairs; budget "
                f"{self.budget_s:.1f} s): {verdict}",
            ]
        )


def _time(statement: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", _TIMER.format(statement=statement)],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout
    return float(out.strip().splitlines()[-1])


def imports(repeats: int = 7, json_path: Path | None = None) -> ImportReport:
    """Time `repeats` interleaved pairs of fresh interpreters (plus one unrecorded warm-up pair)."""
    _time(BASELINE), _time(RANK_SIDE)
    report = ImportReport()
    for i in range(repeats):
        if i % 2:
            rank = _time(RANK_SIDE)
            base = _time(BASELINE)
        else:
            base = _time(BASELINE)
            rank = _time(RANK_SIDE)
        report.baseline_s.append(base)
        report.rank_side_s.append(rank)
    if json_path is not None:
        data = {**asdict(report), "added_s": report.added_s, "passed": report.passed}
        write_result(json_path, data)
    return report
