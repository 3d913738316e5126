"""`SlurmRun`: the handle of a run submitted to Slurm, with the local `Run`'s surface (status,
done(), wait(), stop(), result(), the dashboard reads its directory), and what only a cluster run
has: the job id, its state and Slurm's reason while it waits (pending: Resources, Priority, QOS
limits).

Everything comes back through the run directory and Slurm's own commands, so `wb.attach(run_dir)`
builds the same handle from a new kernel."""

from __future__ import annotations

import logging
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench.config import RunConfig
from workbench.launcher.phases import WAITING_FOR_CLUSTER, starting
from workbench.launcher.result import RunResult
from workbench.launcher.run import raise_for_ending
from workbench.rundir import RunDir, RunFiles, Status, lock
from workbench.rundir.scheduler import ACTIVE, GONE, UNKNOWN, JobAnswer, identity_of, query
from workbench.utils.mounts import on_network_filesystem

POLL_S = 1.0
"""How often wait() asks Slurm and the run directory."""
STDERR_TAIL = 2000

log = logging.getLogger("workbench")


@dataclass(repr=False)  # RunFiles' one-line repr, not every field's
class SlurmRun(RunFiles):
    """A run submitted to Slurm (`wb.start(cfg, cluster=wb.Slurm(...))` or `wb.attach(run_dir)`)."""

    run_dir: Path
    config: RunConfig
    job_id: str
    _token: str | None = field(default=None, repr=False)
    _result: RunResult | None = field(default=None, repr=False)
    _unasked_since: float | None = field(default=None, repr=False)
    """Since when (time.monotonic) wait() has found the controller unreachable; None while it
    answers."""

    @property
    def start_method(self) -> str:
        return "slurm"

    def job(self) -> tuple[str, str]:
        """(state, reason) of the job as Slurm tells it now ('PENDING', 'Resources'); ('UNKNOWN',
        why) when the controller can't be asked from here (down or unreachable, or no Slurm commands
        here); ('GONE', why) once the controller says it doesn't know the job, or its id names
        another job (see `scheduler`)."""
        answer = self._ask()
        return answer.state, answer.reason

    def _ask(self) -> JobAnswer:
        answer = query(self.job_id, self._identity())
        return (
            answer
            if answer is not None
            else JobAnswer(UNKNOWN, "squeue/scontrol are not on PATH here")
        )

    def _identity(self) -> dict[str, Any]:
        """Who the run's job is, from slurm.json ({} for an old one that names it by id only)."""
        info = self.dir.job()
        return (
            identity_of(info)
            if isinstance(info, dict) and str(info.get("job_id")) == self.job_id
            else {}
        )

    def job_line(self) -> str:
        """The job as Slurm tells it now: 'Slurm job 42 RUNNING', 'Slurm job 42 PENDING
        (Resources)'."""
        state, reason = self.job()
        waiting = f" ({reason})" if reason and state == "PENDING" else ""
        return f"Slurm job {self.job_id} {state}{waiting}"

    def launch_phase(self) -> tuple[str, str]:
        """The launch's phase, for a run whose ranks haven't reported yet: ('waiting for the
        cluster', 'Slurm job 42 PENDING: Resources') while Slurm queues the job, ('starting N
        processes', 'Slurm job 42 RUNNING') once it runs them."""
        state, reason = self.job()
        detail = f"Slurm job {self.job_id} {state}" + (f": {reason}" if reason else "")
        if state.split()[0] in ("RUNNING", "COMPLETING"):
            return starting(self.config.num_processes), detail
        return WAITING_FOR_CLUSTER, detail

    def describe(self) -> str:
        """One line: the run's status and the job's, with Slurm's reason while it waits."""
        return f"{self.run_dir.name}: {self.status.value}; {self.job_line()}"

    def done(self) -> bool:
        """The job has ended (Slurm no longer runs or queues it); where Slurm can't be asked, the
        run recorded an ending."""
        state = self.job()[0].split()[0]
        if state == UNKNOWN:
            return self.dir.summary().status.ended
        return state not in ACTIVE

    def stop(self) -> None:
        """Graceful stop: the ranks agree on a step, save a checkpoint and end 'stopped'. A job that
        hasn't started yet is cancelled, and the run ends 'stopped' with nothing trained."""
        if self.done():
            return
        if self.job()[0] == "PENDING":
            _scancel(self.job_id)
            self.dir.set_status(Status.STOPPED)
            self.dir.event(
                "stopped",
                reason="stopped before the Slurm job started; the job was cancelled",
                job_id=self.job_id,
            )
            return
        self.dir.request_stop()

    def cancel(self) -> None:
        """Hard stop: `scancel` the job. The last complete checkpoint stays; the run ends 'failed'.
        Refused (ValueError) when the job id now names another job, and (RuntimeError) when the
        controller can't be asked whether it still is the run's; a job that has ended is left as it
        is."""
        answer = self._ask()
        if answer.foreign:
            raise ValueError(
                f"cancel(): {self.run_dir.name}'s Slurm job has ended, and {answer.reason}; that "
                "job is not this run's and was not cancelled (see it with `scontrol show job "
                f"{self.job_id}`)"
            )
        if answer.state == UNKNOWN:
            raise RuntimeError(
                f"cancel(): Slurm job {self.job_id} was not cancelled: {answer.reason}; call "
                "cancel() again once `scontrol ping` says the controller is UP"
            )
        if answer.state == GONE or answer.state.split()[0] not in ACTIVE:
            return
        _scancel(self.job_id)

    kill = cancel
    """As the local Run's kill()."""

    def wait(self, timeout: float | None = None) -> RunResult:
        """Block until the job has ended and the run recorded why. A job that ended without its
        ranks recording an ending (it never started, or was cancelled or killed) is 'failed' with
        Slurm's state and reason and the job's stderr tail. While the controller can't be reached
        nothing is concluded: wait() goes on waiting (and logs so), unless the ranks record an
        ending meanwhile. Raises as a local run does (RunFailedError, ...), or TimeoutError."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ended():
            if deadline is not None and time.monotonic() > deadline:
                state, reason = self.job()
                said = f"{state.lower()} ({reason})" if state == UNKNOWN else state.lower()
                raise TimeoutError(
                    f"run {self.run_dir.name} (Slurm job {self.job_id}) still {said} after "
                    f"{timeout}s; call wait() again, or stop()"
                )
            time.sleep(POLL_S)
        self._record_an_ending()
        self._report_a_cancel()
        self._result = RunResult(self.run_dir, self.config)
        lock.release(self.dir, self._token)
        raise_for_ending(self.dir)
        return self._result

    def _ended(self) -> bool:
        """done(), saying once when the controller stops answering (and when it answers again)."""
        state, reason = self.job()
        if state == UNKNOWN:
            if self._unasked_since is None:
                self._unasked_since = time.monotonic()
                log.warning(
                    "%s: Slurm job %s's state is unknown: %s; still waiting (the run is not taken "
                    "for ended until the controller answers, or its ranks record an ending)",
                    self.run_dir.name,
                    self.job_id,
                    reason,
                )
            return self.dir.summary().status.ended
        if self._unasked_since is not None:
            log.info(
                "%s: the Slurm controller answers again after %.0f s: job %s is %s",
                self.run_dir.name,
                time.monotonic() - self._unasked_since,
                self.job_id,
                state,
            )
            self._unasked_since = None
        return state.split()[0] not in ACTIVE

    def result(self) -> RunResult:
        return self._result or self.wait()

    def _record_an_ending(self) -> None:
        """The ranks record how the run ended; when the job is over and nothing is recorded, the
        job's own end is the run's: never 'starting' or 'running' for a job Slurm has finished
        with."""
        # Rank 0's last write may show on a network filesystem (NFS, Lustre, ...) a while after
        # Slurm reports the end; on a local one it is there by then.
        deadline = time.monotonic() + (10.0 if on_network_filesystem(self.run_dir) else 1.0)
        while not self.dir.summary().status.ended and time.monotonic() < deadline:
            time.sleep(0.2)
        if self.dir.summary().status.ended:
            return
        state, reason = self.job()
        message = (
            f"the Slurm job {self.job_id} ended {state}"
            + (f" ({reason})" if reason else "")
            + " before the run recorded an ending"
        )
        tail = self.stderr_tail()
        self.dir.set_status(
            Status.FAILED, error={"type": "SlurmJobEnded", "message": message, "traceback": tail}
        )
        self.dir.event(
            "failed", type="SlurmJobEnded", message=message, job_id=self.job_id, traceback=tail
        )

    def _report_a_cancel(self) -> None:
        """`scancel` sends the ranks SIGTERM, which they take for a preemption: they checkpoint and
        end 'preempted', a run to requeue. Slurm says CANCELLED for a job someone cancelled (a
        preempted job says PREEMPTED, one past its limit TIMEOUT): that run was stopped on purpose,
        and is reported so."""
        state = self.job()[0]
        if not state.startswith("CANCELLED") or self.dir.summary().status is not Status.PREEMPTED:
            return
        step = (self.dir.summary().ending or {}).get("step")
        reason = (
            f"the Slurm job {self.job_id} was cancelled ({state}, scancel): the ranks checkpointed "
            f"at step {step} and stopped"
        )
        self.dir.set_status(Status.STOPPED)
        self.dir.event("cancelled", job_id=self.job_id, slurm_state=state, step=step, reason=reason)

    def stderr_tail(self) -> str:
        """The end of the job's standard error, every task's (submitit's log files)."""
        info = self.dir.job() or {}
        folder = Path(info.get("folder", self.dir.slurm_path))
        parts = [
            p.read_text(errors="replace")[-STDERR_TAIL:]
            for p in sorted(folder.glob(f"{self.job_id}_*.err"))
        ]
        return "\n".join(parts)[-STDERR_TAIL:]


def _scancel(job_id: str) -> None:
    from workbench.cluster.slurm import slurm_command

    subprocess.run(
        [slurm_command("scancel"), str(job_id)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def attach(run_dir: str | Path) -> SlurmRun:
    """The handle of a run submitted to Slurm, from its directory (a new kernel, another machine
    that sees the shared filesystem). ValueError when the directory holds no submitted run."""
    run = RunDir(run_dir)
    info = run.job()
    if info is None or not info.get("job_id"):
        raise ValueError(
            f"{run.path}: no slurm.json naming a job; attach() follows runs submitted to a cluster "
            "(wb.start(cfg, cluster=wb.Slurm(...))); a local run's results are "
            "wb.RunResult(run_dir)"
        )
    cfg = run.config()
    if cfg is None:
        raise ValueError(f"{run.config_path}: no such file; {run.path} is not a run directory")
    held = run.lock_owner() or {}
    return SlurmRun(run.path, cfg, str(info["job_id"]), held.get("token"))
