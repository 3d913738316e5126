"""A run's job in a scheduler (Slurm), as liveness and the cluster handle read it: its state and
Slurm's reason. Here, not in cluster/, because whether a run is alive must follow its job however
the run directory is read.

Only what the controller says for certain is taken for an ending: a job it lists, in the state it
gives, or a job id it answers it doesn't know (GONE). A controller that can't be reached (down,
restarting, a network outage) says nothing about the job: that is UNKNOWN, and nothing is concluded
from it. A job id is also not enough to name a job: ids start over when a cluster's state is reset,
so slurm.json records who the job is (its name, submit time and cluster, as Slurm prints them) and a
job whose id matches but who doesn't is another's: GONE for this run, and never cancelled.

Asked of squeue and scontrol here, not through submitit's job watcher: submitit reads job states
from `sacct`, which needs Slurm's accounting database (slurmdbd; absent on small clusters and on the
test cluster, where submitit logs "Bypassing sacct error" and guesses), and it reports an
unreachable controller and an unknown job alike, where this module must tell them apart (UNKNOWN
against GONE).
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

ACTIVE = frozenset(
    {
        "PENDING",
        "CONFIGURING",
        "RUNNING",
        "COMPLETING",
        "SUSPENDED",
        "REQUEUED",
        "REQUEUE_HOLD",
        "REQUEUE_FED",
        "RESIZING",
        "SIGNALING",
        "STAGE_OUT",
        "STOPPED",
    }
)
"""Job states in which the job may still run ranks (or is waiting to)."""
JOB_FILE = "slurm.json"
"""In a run directory: the Slurm job that runs it (job_id; a submitted run adds who the job is:
job_name, submit_time and cluster as Slurm prints them, and its submission folder and partition),
written by submit.py or by hand (scripts/slurm/multinode.sbatch writes only the id: such a job is
taken for the run's by its id alone)."""
IDENTITY = ("job_name", "submit_time", "cluster")
"""The fields of slurm.json (and of a lock's runner) that say which job of that id is the run's."""
GONE = "GONE"
"""The controller no longer knows the job (it ended long enough ago to be purged), or the id now
names another job."""
UNKNOWN = "UNKNOWN"
"""The controller could not be asked, or answered nothing about the job: it may well still be
running."""
NO_SUCH_JOB = "Invalid job id specified"
"""What squeue/scontrol print (slurm_strerror(ESLURM_INVALID_JOB_ID), after 'slurm_load_jobs error:
') when the controller doesn't know a job id: the one failure that says the job is gone. Any other,
such as 'Unable to contact slurm controller (connect failure)' or 'Socket timed out on send/recv
operation', says nothing of it."""
_SQUEUE_FIELDS = "State:|,Reason:|,SubmitTime:|,Cluster:|,RestartCnt:|,Name:|"
"""squeue -O: '|' after each field and no padding; the name last, as it may hold anything, '|'
included."""
_KEY = re.compile(r"\s+(?=[A-Za-z][\w/:]*=)")
"""Between two fields of `scontrol show job -o` (a job name may hold spaces)."""


@dataclass(frozen=True)
class JobAnswer:
    """What Slurm says of a job id now."""

    state: str
    """Slurm's state (RUNNING, PENDING, COMPLETED, CANCELLED by 0, ...), GONE or UNKNOWN."""
    reason: str = ""
    """Slurm's reason (Resources, JobHeldUser, ...), or why the state is GONE or UNKNOWN."""
    name: str | None = None
    submit_time: str | None = None
    """As Slurm prints it (2026-11-28T08:49:09, the controller's local time); a requeue sets it
    anew."""
    cluster: str | None = None
    restarts: int | None = None
    foreign: bool = False
    """The id names a job other than the run's (its name or submit time differ from
    slurm.json's)."""


def query(job_id: str, expected: Mapping[str, Any] | None = None) -> JobAnswer | None:
    """What Slurm says of `job_id`: squeue while it is queued or running, then scontrol while the
    controller remembers it, GONE once it says it doesn't know it, UNKNOWN when it can't be asked.
    `expected`: who the run's job is (IDENTITY fields, from slurm.json; missing ones aren't
    checked): a job of that id that is someone else's reads GONE with `foreign` set. None when
    Slurm's commands aren't here to ask."""
    squeue, scontrol = shutil.which("squeue"), shutil.which("scontrol")
    if squeue is None or scontrol is None:
        return None
    answer = _ask(squeue, scontrol, str(job_id))
    return _as_ours(answer, job_id, expected or {})


def job_state(job_id: str, expected: Mapping[str, Any] | None = None) -> tuple[str, str] | None:
    """(state, reason) of a Slurm job (see query); None when Slurm's commands aren't here to ask."""
    answer = query(job_id, expected)
    return None if answer is None else (answer.state, answer.reason)


def identity_of(record: Mapping[str, Any] | None) -> dict[str, Any]:
    """The IDENTITY fields a record (slurm.json, a lock's runner) holds; {} for an old one without
    them."""
    return {k: record[k] for k in IDENTITY if isinstance(record, Mapping) and record.get(k)}


def _ask(squeue: str, scontrol: str, job_id: str) -> JobAnswer:
    try:
        out = subprocess.run(
            [squeue, "-h", "-j", job_id, "-O", _SQUEUE_FIELDS],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if out.returncode != 0:
            return _failed("squeue", out)
        line = out.stdout.strip().splitlines()[0] if out.stdout.strip() else ""
        if line:
            state, reason, submitted, cluster, restarts, name = (
                line.removesuffix("|").split("|", 5) + [""] * 6
            )[:6]
            return JobAnswer(
                state.strip(),
                _reason(reason),
                name or None,
                submitted.strip() or None,
                cluster.strip() or None,
                _int(restarts),
            )
        # not queued or running any more: scontrol, while the controller remembers the job
        shown = subprocess.run(
            [scontrol, "show", "job", "-o", job_id],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except subprocess.TimeoutExpired as e:
        return JobAnswer(
            UNKNOWN, f"`{' '.join(map(str, e.cmd))}` did not answer within {e.timeout:.0f} s"
        )
    except OSError as e:
        return JobAnswer(UNKNOWN, f"Slurm's commands could not be run: {e}")
    if shown.returncode != 0 or "JobState=" not in shown.stdout:
        return _failed("scontrol", shown)
    fields = dict(part.split("=", 1) for part in _KEY.split(shown.stdout.strip()) if "=" in part)
    return JobAnswer(
        fields.get("JobState", UNKNOWN),
        _reason(fields.get("Reason", "")),
        fields.get("JobName"),
        fields.get("SubmitTime"),
        None,
        _int(fields.get("Restarts")),
    )


def _failed(command: str, done: subprocess.CompletedProcess[str]) -> JobAnswer:
    said = (done.stderr or done.stdout).strip()
    if NO_SUCH_JOB in said:
        return JobAnswer(GONE, "the controller no longer knows the job")
    last = said.splitlines()[-1] if said else f"exit {done.returncode}, nothing said"
    return JobAnswer(UNKNOWN, f"the Slurm controller can't be asked ({command}: {last})")


def _as_ours(answer: JobAnswer, job_id: str, expected: Mapping[str, Any]) -> JobAnswer:
    """`answer` checked against who the run's job is: on another cluster, UNKNOWN from here; another
    job that has the id, GONE and foreign."""
    if answer.state == UNKNOWN:
        return answer
    cluster = expected.get("cluster")
    here = answer.cluster or (_local_cluster() if cluster else None)
    if cluster and here and here != cluster:
        return JobAnswer(
            UNKNOWN,
            f"the job was submitted to Slurm cluster {cluster!r}; the Slurm commands here "
            f"ask cluster {here!r}",
        )
    if answer.state == GONE:
        return answer
    differs = _differs(answer, expected)
    if differs:
        return JobAnswer(
            GONE,
            f"job id {job_id} now names another job ({differs}): this run's job has ended "
            "and its id was given again",
            answer.name,
            answer.submit_time,
            answer.cluster,
            answer.restarts,
            foreign=True,
        )
    return answer


def _differs(answer: JobAnswer, expected: Mapping[str, Any]) -> str:
    name, submitted = expected.get("job_name"), expected.get("submit_time")
    if name and answer.name is not None and answer.name != name:
        return f"named {answer.name!r}, not {name!r}"
    if submitted and answer.submit_time and answer.submit_time != submitted:
        # a requeue gives the job a new submit time: later than the recorded one, with a restart
        # counted
        requeued = (answer.restarts or 0) > 0 and answer.submit_time > str(submitted)
        if not requeued:
            return f"submitted at {answer.submit_time}, not at {submitted}"
    return ""


@functools.lru_cache(maxsize=1)
def _cached_cluster() -> str:
    scontrol = shutil.which("scontrol")
    done = subprocess.run(
        [scontrol or "scontrol", "show", "config"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    match = (
        re.search(r"^ClusterName\s*=\s*(\S+)", done.stdout, re.MULTILINE)
        if done.returncode == 0
        else None
    )
    if match is None:
        raise LookupError("no ClusterName")  # not cached: asked again next time
    return match.group(1)


def _local_cluster() -> str | None:
    """The cluster the Slurm commands here ask (its ClusterName); None when it can't be told now."""
    try:
        return _cached_cluster()
    except (LookupError, OSError, subprocess.TimeoutExpired):
        return None


def _reason(reason: str) -> str:
    reason = reason.strip()
    return "" if reason in ("None", "(null)") else reason


def _int(text: str | None) -> int | None:
    try:
        return int(str(text).strip())
    except ValueError:
        return None
