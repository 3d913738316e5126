"""`workbench bench dashboard`: what the live dashboard costs the ranks, side by side in one run.

Both arms are the quickstart's run (digits on 2 processes, log_every 5), long enough for the
dashboard to poll and draw many times: one arm headless, the other with a `Dashboard` polling the
run directory, rendering its widgets and figure exactly as under a panel (no browser: what a browser
adds is its own CPU, not the kernel's). They run in back-to-back pairs whose order alternates (A B,
B A, ...), so a machine that warms up or gets busier hits both alike. Throughput is the trainer's
own samples/s (summary.json: samples over the time in training steps); the cost is 1 - the median
over pairs of (dashboard / headless), and every pair's ratio is reported so the noise shows. The
kernel-side CPU the dashboard used is the difference of this process's CPU time between arms.
"""

from __future__ import annotations

import logging
import resource
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from workbench.commands.bench.results import write_result
from workbench.config import RunConfig
from workbench.config.preflight import preflight
from workbench.launcher.launch import start
from workbench.utils.hardware import detect, resolve_device

log = logging.getLogger("workbench")

DASHBOARD_BENCH = RunConfig(task="digits", num_processes=2, max_steps=2000, log_every=5)
"""notebooks/01_quickstart.ipynb's run (its parameters cell), with steps enough for ~10 s of
training."""
BUDGET = 0.05
"""The dashboard may cost the ranks at most this share of their throughput at its default
refresh."""


@dataclass
class ArmRun:
    """One run of one arm."""

    pair: int
    arm: str
    samples_per_s: float
    wall_s: float
    cpu_s: float
    """CPU seconds this process (the kernel's side: launcher and dashboard) used while the run
    went."""
    figures: int = 0
    """Figures the dashboard rendered while the run went (0 headless)."""


@dataclass
class DashboardReport:
    device: str
    cores: int
    steps: int
    pairs: int
    interval_s: float
    runs: list[ArmRun] = field(default_factory=list)

    def _rates(self, arm: str) -> list[float]:
        return [r.samples_per_s for r in sorted(self.runs, key=lambda r: r.pair) if r.arm == arm]

    @property
    def ratios(self) -> list[float]:
        """dashboard / headless throughput of each back-to-back pair, in pair order."""
        return [
            d / h for h, d in zip(self._rates("headless"), self._rates("dashboard"), strict=True)
        ]

    @property
    def cost(self) -> float:
        """The share of throughput the dashboard costs: 1 - the median pair ratio."""
        return 1.0 - statistics.median(self.ratios)

    @property
    def dashboard_cpu_s(self) -> float:
        """Median CPU seconds the dashboard added to this process per run."""
        cpu = {
            arm: statistics.median(r.cpu_s for r in self.runs if r.arm == arm)
            for arm in ("headless", "dashboard")
        }
        return cpu["dashboard"] - cpu["headless"]

    @property
    def passed(self) -> bool:
        return self.cost <= BUDGET

    def table(self) -> str:
        head = (
            "workbench bench dashboard: the quickstart run (digits, 2 processes, log_every 5), "
            f"{self.steps} steps, {self.pairs} alternating pairs, on {self.device}; dashboard "
            f"refresh {self.interval_s:g} s"
        )
        lines = [
            head,
            f"  {'arm':10} {'samples/s (median)':>19} {'min - max':>21} {'figures drawn':>14}",
        ]
        for arm in ("headless", "dashboard"):
            rates = self._rates(arm)
            figures = statistics.median(r.figures for r in self.runs if r.arm == arm)
            lines.append(
                f"  {arm:10} {statistics.median(rates):19,.0f} {min(rates):>10,.0f} - "
                f"{max(rates):<8,.0f} {figures:>14g}"
            )
        ratios = self.ratios
        lines += [
            f"  pair ratios (dashboard / headless): {', '.join(f'{r:.3f}' for r in ratios)}",
            (
                f"  cost: {self.cost:.1%} of throughput (1 - median ratio; budget {BUDGET:.0%}); "
                f"the pairs range {1 - max(ratios):+.1%} to {1 - min(ratios):+.1%}"
            ),
            (
                f"  dashboard CPU in the kernel's process: {self.dashboard_cpu_s:.2f} s per run "
                "(median difference between arms)"
            ),
            f"  verdict: {'PASS' if self.passed else 'FAIL'}",
        ]
        return "\n".join(lines)


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _run_arm(cfg: RunConfig, pair: int, arm: str, interval: float) -> ArmRun:
    from workbench.notebook.dashboard import Dashboard

    cpu0, wall0 = _cpu_s(), time.monotonic()
    run = start(cfg)
    dash = None
    try:
        if arm == "dashboard":  # as Panel._go attaches it
            dash = Dashboard(
                run.run_dir, max_steps=cfg.max_steps, interval=interval, show_error=False
            ).start()
        result = run.wait()
        # While the ranks ran: what the dashboard does once they are done (its final figure) costs
        # them nothing.
        measured = ArmRun(
            pair,
            arm,
            float(result.summary["samples_per_s"]),
            time.monotonic() - wall0,
            _cpu_s() - cpu0,
            dash.figures_drawn if dash is not None else 0,
        )
    finally:
        if not run.done():
            run.kill()
        if dash is not None:
            dash.stop()
    return measured


def dashboard_cost(
    steps: int = DASHBOARD_BENCH.max_steps,
    pairs: int = 4,
    interval: float = 1.0,
    cfg: RunConfig | None = None,
    json_path: Path | None = None,
) -> DashboardReport:
    """Throughput of the quickstart run headless against the same run with a live Dashboard (module
    docstring)."""
    if pairs < 1:
        raise ValueError(f"pairs={pairs}: at least 1 (2 or more to see the noise)")
    cfg = (cfg or DASHBOARD_BENCH).replace(max_steps=steps)
    preflight(cfg)
    # Loaded once, up front, as a kernel that shows a dashboard has them: the arms compare drawing,
    # not importing.
    import workbench.notebook.dashboard
    import workbench.notebook.plots  # noqa: F401  (matplotlib)

    hw = detect()
    report = DashboardReport(
        device=hw.device_line(resolve_device(cfg, hw)),
        cores=hw.cpu_count,
        steps=steps,
        pairs=pairs,
        interval_s=interval,
    )
    with tempfile.TemporaryDirectory(prefix="workbench-bench-") as tmp:
        for i in range(pairs):
            order = ("headless", "dashboard") if i % 2 == 0 else ("dashboard", "headless")
            for arm in order:
                report.runs.append(
                    _run_arm(cfg.replace(runs_dir=tmp, run_name=f"{arm}-{i}"), i, arm, interval)
                )
                log.debug("pair %d %s: %.0f samples/s", i, arm, report.runs[-1].samples_per_s)
    if json_path is not None:
        write_result(
            json_path,
            {
                **asdict(report),
                "ratios": report.ratios,
                "cost": report.cost,
                "passed": report.passed,
            },
        )
    return report
