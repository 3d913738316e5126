"""How the figures' axes read: the loss on a log scale once it spans a decade (LOG_LOSS_SPAN),
labelled 0.6 and 2 rather than 6x10^-1, and learning rates written as papers and configs write them
(3e-4, `sci`), with the digits it takes to tell neighbouring ticks apart."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from matplotlib.ticker import Formatter, LogFormatter  # imported only when something is plotted

from workbench.notebook.figure_lines import Runs, series_of

if TYPE_CHECKING:
    from matplotlib.axes import Axes

LOG_LOSS_SPAN = 10.0
"""log_loss=None (auto) puts the loss on a log scale once its largest value is this many times its
smallest."""


def loss_on_log_scale(runs: Runs, log_loss: bool | None) -> bool:
    """The loss axis's scale: as asked, or with None, log once the positive losses span
    LOG_LOSS_SPAN."""
    losses = [v for _, rows in runs for v in series_of(rows, lambda r: r.loss)[1] if v > 0]
    if log_loss is not None:
        return log_loss and bool(losses)
    return bool(losses) and max(losses) >= LOG_LOSS_SPAN * min(losses)


def set_loss_scale(ax: Axes, log: bool) -> None:
    """Put the loss axis `ax` on a log scale (labelled as PlainLogFormatter does) or a linear one,
    and say which in its title."""
    ax.set_yscale("log" if log else "linear")
    if log:
        ax.yaxis.set_major_formatter(PlainLogFormatter())
        ax.yaxis.set_minor_formatter(PlainLogFormatter(minor_thresholds=(2, 0.5)))
    ax.set_title("loss" + (" (log scale)" if log else ""))


def sci(value: float, digits: int = 2) -> str:
    """3e-4 rather than 0.000300: the way learning rates are written in papers and configs."""
    if value == 0:
        return "0"
    mantissa, exponent = f"{value:.{max(1, digits) - 1}e}".split("e")
    if "." in mantissa:
        mantissa = mantissa.rstrip("0").rstrip(".")
    return f"{mantissa}e{int(exponent)}"


class SciFormatter(Formatter):
    """Tick labels in `sci` style, with as many digits as it takes to tell neighbouring ticks apart:
    a slowly decaying learning rate would otherwise read 1e-3, 1e-3, 1e-3."""

    digits = 2

    def set_locs(self, locs: Sequence[float]) -> None:
        super().set_locs(locs)
        self.digits = next(
            (d for d in range(2, 8) if len({sci(v, d) for v in locs}) == len(set(locs))), 8
        )

    def __call__(self, x: float, pos: int | None = None) -> str:
        return sci(x, self.digits)


class PlainLogFormatter(LogFormatter):
    """Log-axis labels as 0.6 and 2 rather than 6x10^-1; which ticks get a label stays
    LogFormatter's choice."""

    def __call__(self, x: float, pos: int | None = None) -> str:
        return f"{x:g}" if super().__call__(x, pos) else ""
