"""Environment: the variables that change how distributed training behaves, and the known pitfalls
among them.

The advice follows the NCCL user guide's environment-variable page (its "Debugging" variables, such
as NCCL_P2P_DISABLE, NCCL_IB_DISABLE and NCCL_SHM_DISABLE, are workarounds "not to be used in
production nor retained in scripts"; loopback is used only when NCCL_SOCKET_IFNAME names it) and
PyTorch's ProcessGroupNCCL variables (TORCH_NCCL_ASYNC_ERROR_HANDLING: 0 = no handling, default 3 =
tear the process down on an error; TORCH_NCCL_BLOCKING_WAIT makes wait() block,
pytorch/pytorch#50820 reports it making training much slower).
"""

from __future__ import annotations

from collections.abc import Mapping

from workbench.commands.doctor.findings import Finding, Section

PREFIXES = (
    "NCCL_",
    "GLOO_",
    "TORCH_",
    "OMP_",
    "MKL_",
    "CUDA_",
    "PYTORCH_",
    "ACCELERATE_",
    "WORKBENCH_",
)
NAMES = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "TORCHELASTIC_RUN_ID",
)

# (variable, values that trigger it, finding text, fix). Values are compared upper-cased; None means
# any value.
RULES: tuple[tuple[str, tuple[str, ...] | None, str, str], ...] = (
    (
        "NCCL_P2P_DISABLE",
        ("1",),
        "NCCL_P2P_DISABLE=1: no direct GPU-to-GPU transfers (NVLink/PCIe P2P); collectives bounce "
        "through host memory and are much slower",
        "unset NCCL_P2P_DISABLE (a debugging workaround; keep it only if P2P is known broken on "
        "this machine)",
    ),
    (
        "NCCL_P2P_LEVEL",
        ("0", "LOC"),
        "NCCL_P2P_LEVEL=LOC/0 disables P2P between GPUs, like NCCL_P2P_DISABLE=1: slow collectives",
        "unset NCCL_P2P_LEVEL and let NCCL choose from the topology",
    ),
    (
        "NCCL_SHM_DISABLE",
        ("1",),
        "NCCL_SHM_DISABLE=1: no shared-memory transport; GPUs without P2P talk over the network "
        "stack instead",
        "unset NCCL_SHM_DISABLE",
    ),
    (
        "NCCL_IB_DISABLE",
        ("1",),
        "NCCL_IB_DISABLE=1: InfiniBand/RoCE is off, so traffic between nodes falls back to TCP "
        "sockets (slow)",
        "unset NCCL_IB_DISABLE on a cluster with InfiniBand/RoCE (harmless only where there is "
        "none)",
    ),
    (
        "NCCL_DEBUG",
        ("INFO", "TRACE"),
        "NCCL_DEBUG=INFO/TRACE: every rank logs NCCL's set-up (and TRACE every call): noisy, and "
        "TRACE is slow",
        "unset NCCL_DEBUG or set NCCL_DEBUG=WARN; use INFO only while debugging",
    ),
    (
        "NCCL_ALGO",
        None,
        "NCCL_ALGO is forced: NCCL's tuner can no longer pick the best algorithm per message size",
        "unset NCCL_ALGO unless a measurement showed it helps here",
    ),
    (
        "NCCL_PROTO",
        None,
        "NCCL_PROTO is forced: NCCL's tuner can no longer pick the best protocol per message size",
        "unset NCCL_PROTO unless a measurement showed it helps here",
    ),
    (
        "TORCH_NCCL_BLOCKING_WAIT",
        ("1",),
        "TORCH_NCCL_BLOCKING_WAIT=1: every wait() blocks the CPU until the collective ends; "
        "training can be much slower",
        "unset TORCH_NCCL_BLOCKING_WAIT; TORCH_NCCL_ASYNC_ERROR_HANDLING (default 3) already "
        "turns a failed or timed-out collective into an error",
    ),
    (
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        ("0",),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING=0: NCCL errors and timeouts are not handled, so a failed "
        "rank leaves the others hanging instead of failing",
        "unset TORCH_NCCL_ASYNC_ERROR_HANDLING (default 3 tears the process down on an error or "
        "timeout)",
    ),
    (
        "NCCL_BLOCKING_WAIT",
        None,
        "NCCL_BLOCKING_WAIT is the deprecated name; current torch reads TORCH_NCCL_BLOCKING_WAIT",
        "rename it to TORCH_NCCL_BLOCKING_WAIT, or better unset it",
    ),
    (
        "NCCL_ASYNC_ERROR_HANDLING",
        None,
        "NCCL_ASYNC_ERROR_HANDLING is the deprecated name; current torch reads "
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "rename it to TORCH_NCCL_ASYNC_ERROR_HANDLING, or unset it (the default, 3, is what you "
        "want)",
    ),
    (
        "CUDA_LAUNCH_BLOCKING",
        ("1",),
        "CUDA_LAUNCH_BLOCKING=1: every CUDA kernel runs synchronously: for debugging, very slow "
        "for training",
        "unset CUDA_LAUNCH_BLOCKING",
    ),
    (
        "TORCH_DISTRIBUTED_DEBUG",
        ("DETAIL",),
        "TORCH_DISTRIBUTED_DEBUG=DETAIL: every collective is checked and logged; adds overhead",
        "unset TORCH_DISTRIBUTED_DEBUG (or set OFF) outside debugging",
    ),
)


def relevant_env(env: Mapping[str, str]) -> dict[str, str]:
    """The variables in `env` that affect distributed training, sorted by name."""
    return {k: env[k] for k in sorted(env) if k.startswith(PREFIXES) or k in NAMES}


def env_pitfalls(
    env: Mapping[str, str],
    *,
    cpus: int,
    cpu_ranks: int = 0,
    visible_gpus: int | None = None,
    physical_gpus: int | None = None,
) -> list[Finding]:
    """Known pitfalls in `env`, each with its fix.

    cpu_ranks: ranks that would run on this machine's CPUs (0 on a GPU box, where threads matter
    less); visible_gpus / physical_gpus: GPUs torch sees and GPUs the driver has, to tell when
    CUDA_VISIBLE_DEVICES hides some.
    """
    found = []
    for name, values, text, fix in RULES:
        if name in env and (values is None or env[name].strip().upper() in values):
            found.append(Finding("warn", text, fix))
    for name in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        if name in env and _only_loopback(env[name]):
            found.append(
                Finding(
                    "warn",
                    f"{name}={env[name]}: loopback only; ranks on other nodes cannot reach this "
                    "one",
                    f"for multi-node runs set {name} to the interface between nodes (e.g. eth0, "
                    "ib0, or ^lo,docker to exclude), or unset it; lo works on one node only",
                )
            )
    found += _thread_pitfalls(env, cpus, cpu_ranks)
    found += _visibility_pitfalls(env, visible_gpus, physical_gpus)
    return found


def _only_loopback(value: str) -> bool:
    names = [v.strip() for v in value.split(",") if v.strip()]
    # '^lo' excludes loopback; '=lo' and 'lo' select it.
    return bool(names) and all(
        not n.startswith("^") and n.lstrip("=").startswith("lo") for n in names
    )


def _thread_pitfalls(env: Mapping[str, str], cpus: int, cpu_ranks: int) -> list[Finding]:
    if cpu_ranks < 2:
        return []
    share = max(1, cpus // cpu_ranks)
    value = env.get("OMP_NUM_THREADS", "").strip()
    if not value:
        return [
            Finding(
                "warn",
                f"OMP_NUM_THREADS is unset: each of {cpu_ranks} CPU ranks starts a thread per core "
                f"({cpu_ranks} x {cpus} threads on {cpus} cores), oversubscribing the CPU "
                "(workbench's own launches and torchrun set it; mp.spawn or notebook_launcher "
                "scripts don't)",
                f"export OMP_NUM_THREADS={share}",
            )
        ]
    if value.isdigit() and int(value) * cpu_ranks > cpus:
        return [
            Finding(
                "warn",
                f"OMP_NUM_THREADS={value} x {cpu_ranks} CPU ranks = {int(value) * cpu_ranks} "
                f"threads on {cpus} cores: oversubscribed",
                f"export OMP_NUM_THREADS={share}",
            )
        ]
    return []


def _visibility_pitfalls(
    env: Mapping[str, str], visible: int | None, physical: int | None
) -> list[Finding]:
    if "CUDA_VISIBLE_DEVICES" not in env or not physical:
        return []
    value = env["CUDA_VISIBLE_DEVICES"]
    shown = visible if visible is not None else len([v for v in value.split(",") if v.strip()])
    if shown >= physical:
        return []
    what = "every GPU" if shown == 0 else f"{physical - shown} of {physical} GPUs"
    return [
        Finding(
            "warn",
            f"CUDA_VISIBLE_DEVICES={value!r} hides {what} from this process",
            "unset CUDA_VISIBLE_DEVICES, or list every GPU the job should use (e.g. "
            f"CUDA_VISIBLE_DEVICES={','.join(map(str, range(physical)))})",
        )
    ]


def build_environment(
    section: Section,
    env: Mapping[str, str],
    *,
    cpus: int,
    cpu_ranks: int,
    visible_gpus: int | None,
    physical_gpus: int | None,
) -> None:
    shown = relevant_env(env)
    section.data["variables"] = shown
    width = max((len(k) for k in shown), default=0)
    section.lines += [f"{k:{width}} = {v}" for k, v in shown.items()] or [
        "no NCCL_/GLOO_/TORCH_/OMP_/CUDA_/MASTER_* variables set"
    ]
    section.findings += env_pitfalls(
        env, cpus=cpus, cpu_ranks=cpu_ranks, visible_gpus=visible_gpus, physical_gpus=physical_gpus
    )
    if not section.findings:
        section.lines.append("no known pitfalls")
