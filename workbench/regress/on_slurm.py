"""`workbench regress --slurm`: every case of a suite as one task of a Slurm job array (submitit's
map_array), papermill inside the task on a node, each case judged there against the baselines of the
node's device class; the results come back to the submitting process, which writes the one report
and JUnit file."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workbench.cluster.slurm import Slurm, check_cluster, executor_parameters, python_for_jobs

if TYPE_CHECKING:
    from workbench.regress.judging import CaseResult
    from workbench.regress.suite import Case

log = logging.getLogger("workbench")


def run_case_job(
    case: Case, overrides: Mapping[str, Any], out: Path, update_baselines: bool
) -> tuple[CaseResult, str]:
    """One array task: the case run and judged on this node, with the node's device class."""
    from workbench.regress.case_run import run_case
    from workbench.utils.hardware import detect

    hw = detect()
    return run_case(
        case,
        overrides,
        out,
        device_class=hw.device_class,
        has_cuda=hw.has_cuda,
        update_baselines=update_baselines,
    ), hw.device_class


def run_cases_on_slurm(
    cases: list[Case], overrides: Mapping[str, Any], out: Path, slurm: Slurm, update_baselines: bool
) -> tuple[list[CaseResult], str | None]:
    """Submit one array task per case, wait for all, and return their results in the cases' order
    with the device class they ran on. A task that died before returning (its node, its time limit)
    is the case's error, with submitit's words."""
    import submitit

    from workbench.regress.baselines import baseline_path
    from workbench.regress.execution import CaseError
    from workbench.regress.judging import ERROR, CaseResult

    partition = check_cluster(slurm)
    executor = submitit.SlurmExecutor(folder=out / "slurm", python=python_for_jobs())
    executor.update_parameters(
        **executor_parameters(
            slurm, partition, job_name="workbench-regress", nodes=1, tasks_per_node=1
        )
    )
    n = len(cases)
    jobs = executor.map_array(
        run_case_job, cases, [overrides] * n, [out] * n, [update_baselines] * n
    )
    log.info(
        "submitted %d case(s) to Slurm as job array %s",
        n,
        jobs[0].job_id.split("_")[0] if jobs else "-",
    )
    results, device_class = [], None
    for case, job in zip(cases, jobs):
        try:
            result, device_class = job.result()
        except Exception as e:  # noqa: BLE001
            # the task's failure is the case's error, the suite goes on
            result = CaseResult(
                case,
                ERROR,
                {**case.parameters, **overrides},
                baseline_path=baseline_path(case, device_class or "cpu"),
            )
            result.error = CaseError("Slurm task failed", f"job {job.job_id}: {str(e)[-1500:]}")
        log.info("  %s", result.summary_line())
        results.append(result)
    return results, device_class
