"""A run's job in a scheduler (Slurm), as liveness and the cluster handle read it: its state and Slurm's reason.
Here, not in cluster/, because whether a run is alive must follow its job however the run directory is read."""

from __future__ import annotations

import shutil
import subprocess

ACTIVE = frozenset({"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD",
                    "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED"})
"""Job states in which the job may still run ranks (or is waiting to)."""
JOB_FILE = "slurm.json"
"""In a run directory: the Slurm job that runs it (job_id; a submitted run adds its submission folder and
partition), written by submit.py or by hand (scripts/slurm/multinode.sbatch)."""
GONE = "GONE"
"""The controller no longer knows the job (it ended long enough ago to be purged)."""


def job_state(job_id: str) -> tuple[str, str] | None:
    """(state, reason) of a Slurm job: squeue while it is queued or running, then scontrol while the controller
    remembers it, GONE after; None when Slurm's commands aren't here to ask."""
    squeue, scontrol = shutil.which("squeue"), shutil.which("scontrol")
    if squeue is None or scontrol is None:
        return None
    try:
        out = subprocess.run([squeue, "-h", "-j", str(job_id), "-o", "%T|%r"], capture_output=True, text=True,
                             timeout=30, check=False)
        line = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
        if line:
            state, _, reason = line.partition("|")
            return state.strip(), "" if reason.strip() in ("None", "(null)") else reason.strip()
        shown = subprocess.run([scontrol, "show", "job", "-o", str(job_id)], capture_output=True, text=True,
                               timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if shown.returncode != 0 or "JobState=" not in shown.stdout:
        return GONE, ""
    fields = dict(part.split("=", 1) for part in shown.stdout.split() if "=" in part)
    reason = fields.get("Reason", "")
    return fields.get("JobState", GONE), "" if reason in ("None", "(null)") else reason
