"""Ray as the second engine beside Slurm: a run's ranks become Ray Train workers (TorchTrainer,
Train V2), which places them on the cluster's nodes, restarts the group when a worker fails and
keeps its state under the run directory. workbench hands its ranks to Ray and follows them through
the run directory, as it does with Slurm; it never imitates Ray's placement or restarts.

spec.py describes and checks what a run asks of the cluster (`wb.Ray`); session.py connects to the
cluster with Ray's own lines kept out of the cell; driver.py is the detached actor that runs the
TorchTrainer, so the run outlives the kernel that started it; rank.py is the training function
each Ray Train worker runs (one rank); submit.py is the submission, run.py the handle that follows
it; local.py brings up a multi-node Ray cluster on this machine's loopback addresses (the tests,
the benchmark, notebook 07).
"""

from workbench.cluster.raytrain.spec import Ray

__all__ = ["Ray"]
