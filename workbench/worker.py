"""`python -m workbench.worker RUN_DIR`: one rank of the run stored in RUN_DIR/config.yaml.

This is what `workbench train` hands to `accelerate launch`; torchrun, Slurm's srun or a multi-node
`accelerate launch` can start it the same way.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .config import RunConfig
from .launch import rank_main
from .rundir import CONFIG
from .tasks import get_task


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m workbench.worker RUN_DIR")
    run_dir = Path(args[0])
    cfg = RunConfig.from_yaml(run_dir / CONFIG)
    rank_main(cfg, get_task(cfg.task), str(run_dir), progress=os.environ.get("WORKBENCH_PROGRESS") == "1")


if __name__ == "__main__":
    main()
