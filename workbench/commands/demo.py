"""`workbench demo`: the README's main job. Digits on 2 CPU processes of real DDP, offline, in about
a minute."""

from __future__ import annotations

import logging

from workbench.config import RunConfig
from workbench.launcher.launch import launch
from workbench.rundir import Status
from workbench.utils.units import fmt_bytes

log = logging.getLogger("workbench")

DEMO = RunConfig(
    task="digits",
    num_processes=2,
    parallelism="ddp",
    precision="fp32",
    device="cpu",
    micro_batch_size=32,
    grad_accum_steps=1,
    max_steps=300,
    lr=3e-3,
    warmup_steps=20,
    weight_decay=0.01,
    eval_every=100,
    log_every=10,
    checkpoint_every=100,
    seed=0,
)


def run_demo(runs_dir: str = "runs", num_processes: int = 2, steps: int = 300) -> int:
    cfg = DEMO.replace(
        runs_dir=runs_dir,
        num_processes=num_processes,
        max_steps=steps,
        warmup_steps=min(DEMO.warmup_steps, steps),
    )
    result = launch(cfg, progress=True)
    plot_path = result.dir.write_plot(result.plot())
    s = result.summary
    ranks = s.get("ranks", [])
    same = len({r["weights_sha256"] for r in ranks}) == 1
    print(f"\nrun directory: {result.run_dir}")
    print(
        f"  {s['world_size']} ranks ({ranks[0]['distributed_type'] if ranks else '?'}), "
        f"weights identical on every rank: {same}"
    )
    print(
        f"  final train loss {s['final_loss']:.4f}, eval loss "
        f"{s.get('eval_loss', float('nan')):.4f}, eval accuracy "
        f"{s.get('eval_accuracy', float('nan')):.3f}"
    )
    print(
        f"  {s['samples_per_s']:.0f} samples/s, peak memory "
        f"{fmt_bytes(s['peak_memory_bytes'], 'MiB')} per rank, {s['wall_time_s']:.1f} s"
    )
    print(
        "  files: config.yaml metrics.jsonl events.jsonl summary.json checkpoints/ plot.png "
        f"({plot_path})"
    )
    return 0 if s.get("status") == Status.COMPLETED and same else 1
