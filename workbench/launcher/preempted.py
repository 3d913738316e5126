"""A preempted launch: its exit code, and the run recorded as preempted when the ranks could not
record it themselves. Which signals mean "preempted", and their handlers, are
utils/preemption.py's."""

from __future__ import annotations

import signal

from workbench.rundir import RunDir, Status, is_fallout

EXIT_PREEMPTED = 75
"""`workbench train`'s exit code for a preempted run (sysexits' EX_TEMPFAIL: try again, e.g.
resubmit it)."""


def record_preemption(run: RunDir, signum: int, why: str, *, after_failure: bool = False) -> bool:
    """The launcher got preemption signal `signum` and the ranks ended without recording an ending:
    they never started, or the signal ended them before they could checkpoint. That is a preemption,
    not a failure (which would read as an out-of-memory kill), unless a rank failed for a reason of
    its own: then False, and the failure is recorded as usual. `after_failure`: the signal came
    after the run had failed, while it waited to restart; it ends preempted, the failure kept in the
    ending. The run resumes from its newest checkpoint."""
    summary, name = run.summary(), signal.Signals(signum).name
    if summary.status is Status.UNKNOWN:
        return False  # a status this version can't read is not written over (finalize says so)
    if after_failure:
        if summary.status is Status.PREEMPTED:
            return True  # the ranks' own ending says it better
        extra = {"failure": summary.error}
    else:
        if summary.status.ended:
            return False  # the ranks' own ending stands
        errors = run.rank_errors()
        if any(
            not (is_fallout(e) or e.get("type") == "Killed" and name in e.get("message", ""))
            for e in errors
        ):
            return False
        # What the signal did to the ranks (a rank that lost its peer): kept with the ending, not a
        # failure.
        extra = {
            "rank_errors": [{k: e.get(k) for k in ("rank", "type", "message")} for e in errors]
        }
        run.clear_rank_errors()
    run.end_preempted(name, why, **extra)
    return True
