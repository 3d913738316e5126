"""Where a run goes beyond this machine: a cluster is an engine workbench submits to (Slurm, through
submitit), never a scheduler of its own. slurm.py describes and checks the cluster and submits;
job.py is what each Slurm task runs (one rank); slurm_run.py is the handle that follows the job
through the run directory and Slurm. raytrain/ is the same for Ray (Ray Train workers)."""

from workbench.cluster.raytrain.spec import Ray
from workbench.cluster.slurm import Slurm

__all__ = ["Ray", "Slurm"]
