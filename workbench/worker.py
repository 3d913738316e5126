"""`python -m workbench.worker RUN_DIR`: one rank of the run stored in RUN_DIR/config.yaml.

This is what `workbench train` hands to `accelerate launch`; torchrun, Slurm's srun or a multi-node
`accelerate launch` can start it the same way. It imports only the rank side of workbench.
"""

from __future__ import annotations

import os
import sys

from .rank import rank_main
from .rundir import RunDir
from .tasks import get_task


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m workbench.worker RUN_DIR")
    run = RunDir(args[0])
    cfg = run.config()
    if cfg is None:
        raise SystemExit(f"{run.config_path}: no such file; create the run directory with "
                         "`workbench train CONFIG --prepare-only`")
    rank_main(cfg, get_task(cfg.task), str(run.path), progress=os.environ.get("WORKBENCH_PROGRESS") == "1")


if __name__ == "__main__":
    main()
