"""torch.compile in the trainer: which modules compile, in which order with the parallel wrappers,
what compiling cost and found (graphs, graph breaks, recompilations), and a failure that names the
module and the way out.

The order is torchtitan's: tensor parallel, then activation checkpointing, then each block compiled,
then FSDP (compile='blocks'). compile='model' compiles the whole model once it is parallel: the DDP
wrapper itself, so PyTorch's DDPOptimizer splits the graph at DDP's buckets; FSDP2's root after
sharding; a pipeline rank's stage. Modules compile in place (`nn.Module.compile`), so parameter
names and checkpoints are the same as eager's.

Nothing falls back silently: dynamo's suppress_errors is off, so a model that can't compile fails
the run with one error. Inductor's cache lives in workbench's cache folder (TORCHINDUCTOR_CACHE_DIR,
when the user set none): a relaunch, a resume and every rank of the machine find the kernels
compiled before.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from workbench.config import RunConfig

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


class CompileError(RuntimeError):
    """torch.compile could not compile the model: which module, why, and compile='off' as the way
    out."""


def inductor_cache() -> Path:
    """Where inductor keeps compiled kernels: TORCHINDUCTOR_CACHE_DIR, else <workbench
    cache>/inductor (the folder: WORKBENCH_CACHE_DIR, else the user's cache folder; on a cluster,
    usually the shared home)."""
    import platformdirs

    given = os.environ.get(CACHE_ENV)
    if given and given != _inductor_default():
        # inductor writes its default there once it has chosen it
        return Path(given).expanduser()
    base = Path(
        os.environ.get("WORKBENCH_CACHE_DIR") or platformdirs.user_cache_dir("workbench")
    ).expanduser()
    return base / "inductor"


def _inductor_default() -> str:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return str(default_cache_dir())


def prepare(cfg: RunConfig) -> None:
    """Before anything compiles: inductor's cache where later launches find it, and no silent
    fallback."""
    if cfg.compile == "off":
        return
    os.environ[CACHE_ENV] = str(inductor_cache())
    import torch._dynamo

    torch._dynamo.config.suppress_errors = False


def compile_blocks(cfg: RunConfig, units: list[torch.nn.Module], *, tracing: bool = False) -> None:
    """compile='blocks': each unit (a repeated block, or its activation-checkpoint wrapper) compiled
    in place, before FSDP wraps it. A traced estimate leaves modules eager (fake tensors)."""
    if cfg.compile != "blocks" or tracing:
        return
    if not units:
        raise ValueError(
            "compile='blocks': the model has no repeated blocks to compile (no ModuleList of "
            "blocks); set compile='model' to compile it whole, or define Task.shard_units(model) "
            "to name them"
        )
    prepare(cfg)
    for unit in units:
        compile_in_place(unit, cfg.compile_backend)


def compile_model(cfg: RunConfig, model: torch.nn.Module, *, tracing: bool = False) -> None:
    """compile='model': the whole (parallel) model compiled in place."""
    if cfg.compile != "model" or tracing:
        return
    prepare(cfg)
    compile_in_place(model, cfg.compile_backend)


def compile_in_place(module: torch.nn.Module, backend: str) -> None:
    """`module` compiled in place, parameter names unchanged. A module whose forward is PyTorch's
    own code (nn.Sequential, nn.TransformerEncoderLayer, ...), alone or inside DDP, compiles through
    a function of ours that calls it: dynamo skips a frame of torch.nn's code where compiling starts
    (PyTorch 2.13 traces it only when called from user code, or with fullgraph=True), so
    `nn.Module.compile` on an nn.Sequential compiles nothing and the run would train eagerly. Inside
    DDP's forward the DDPOptimizer still splits the graph at its buckets: dynamo applies it to any
    frame it converts while a DDP module is active."""
    import torch

    inner = (
        module.module if isinstance(module, torch.nn.parallel.DistributedDataParallel) else module
    )
    if not _torchs_own(type(inner).forward):
        module.compile(backend=backend)
        return
    forward = inner.forward

    def forward_from_workbench(*args: Any, **kwargs: Any) -> Any:
        return forward(*args, **kwargs)

    inner.forward = torch.compile(forward_from_workbench, backend=backend)


def _torchs_own(function: Any) -> bool:
    """Defined in PyTorch's package (torch.nn.modules.container for nn.Sequential, also under
    FSDP2's subclass)."""
    return getattr(function, "__module__", "").split(".")[0] == "torch"


def compiled_module(cfg: RunConfig, model: torch.nn.Module) -> str:
    """What compile compiles, in words: 'GPT (the whole model)', 'each block of GPT'."""
    name = type(model).__name__
    return {"model": f"{name} (the whole model)", "blocks": f"each block of {name}"}.get(
        cfg.compile, "nothing"
    )


def _counters() -> tuple[int, int, dict[str, int]]:
    """(frames compiled, graphs, graph breaks by reason) in this process so far."""
    from torch._dynamo.utils import counters

    breaks: dict[str, int] = {}
    for reason, count in counters["graph_break"].items():
        line = next((part.strip() for part in str(reason).splitlines() if part.strip()), "?")
        breaks[line] = breaks.get(line, 0) + count
    return counters["frames"]["ok"], counters["stats"]["unique_graphs"], breaks


def _is_compile_failure(exc: BaseException) -> bool:
    import torch._dynamo.exc

    return isinstance(exc, torch._dynamo.exc.TorchDynamoException) or type(exc).__name__ in (
        "InductorError",
        "BackendCompilerFailed",
        "LoweringException",
        "CppCompileError",
    )


class CompileWatch:
    """Per rank: which steps compiled and how long they took, what dynamo found, and a failure made
    readable."""

    first_steps = 2
    """Steps of a session that compile by design: the first, and the second under DDP (which
    rebuilds its buckets after the first step, taking a path of its own once). Frames compiled later
    are recompilations."""

    def __init__(self, cfg: RunConfig, module: str) -> None:
        self.cfg = cfg
        self.on = cfg.compile != "off"
        self.module = module
        """What was compiled, for messages: 'GPT (the whole model)', '4 x Block'."""
        self.compiling_steps: list[tuple[int, float]] = []
        """(step, seconds) of the steps during which something compiled."""
        self.compiled_now = False
        """The step just run compiled something (its time is compile time, not training pace)."""
        self._start, self._graphs_start, _ = _counters() if self.on else (0, 0, {})
        self._in_steps = 0
        """Frames compiled during steps."""
        self._late = 0
        """Frames compiled after the first steps: recompilations."""
        self._steps_before: int = 0

    def session_starts_at(self, step: int) -> None:
        """A resumed session compiles in its own first steps."""
        self._steps_before = step

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Around one optimizer step: note whether it compiled, and turn a compile failure into
        CompileError."""
        if not self.on:
            yield
            return
        before, start = _counters()[0], time.perf_counter()
        try:
            yield
        except Exception as e:
            if _is_compile_failure(e):
                raise self.error(e) from e
            raise
        now, graphs, _ = _counters()
        if step == self._steps_before + 1 and graphs == self._graphs_start:
            raise self._error(
                f"compiled no graph by the end of the first step: dynamo skipped every frame of "
                f"{self.module}, which would train eagerly while the run says it compiled"
            )
        frames = now - before
        self.compiled_now = frames > 0
        if frames:
            self.compiling_steps.append((step, time.perf_counter() - start))
            self._in_steps += frames
            if step > self.first_steps + self._steps_before:
                self._late += frames

    def what(self) -> dict[str, Any]:
        """What is being compiled, how, and where the kernels are cached (the 'compiling' event)."""
        return {
            "mode": self.cfg.compile,
            "backend": self.cfg.compile_backend,
            "module": self.module,
            "cache_dir": str(inductor_cache()),
        }

    def error(self, exc: BaseException) -> CompileError:
        reason = " ".join(
            line.strip() for line in str(exc).strip().splitlines()[:3] if line.strip()
        )[:600]
        where = next(
            (line.strip() for line in str(exc).splitlines() if line.strip().startswith("File ")), ""
        )
        return self._error(
            f"failed on {self.module}: {type(exc).__name__}: {reason}"
            + (f" [{where}]" if where else "")
        )

    def _error(self, what: str) -> CompileError:
        return CompileError(
            f"torch.compile (compile={self.cfg.compile!r}, backend {self.cfg.compile_backend!r}) "
            f"{what}; set compile='off' to train this model eagerly"
        )

    def report(self) -> dict[str, Any]:
        """What compiling cost and found, for the summary and the 'compile_report' event."""
        from torch._dynamo.utils import counters

        frames, graphs, breaks = _counters()
        first = self.compiling_steps[0] if self.compiling_steps else None
        inductor = counters["inductor"]
        return {
            "mode": self.cfg.compile,
            "backend": self.cfg.compile_backend,
            "module": self.module,
            "first_step_s": round(first[1], 3) if first else None,
            "compile_steps": [s for s, _ in self.compiling_steps],
            "graphs": graphs,
            "graph_breaks": breaks,
            "recompiles": self._late,
            "eval_compiles": max(0, frames - self._start - self._in_steps),
            "cache_hits": inductor["fxgraph_cache_hit"],
            "cache_misses": inductor["fxgraph_cache_miss"],
            "cache_dir": str(inductor_cache()),
        }


def compile_line(report: dict[str, Any]) -> str:
    """One line: 'blocks (inductor): first step 12.3 s; 4 graphs, 0 graph breaks, 0 recompilations
    in later steps, 2 for evaluation'."""
    breaks = sum(report.get("graph_breaks", {}).values())
    first = report.get("first_step_s")
    recompiles = report.get("recompiles", 0)
    evals = report.get("eval_compiles", 0)
    return (
        f"{report.get('mode')} ({report.get('backend')}): "
        + (f"first step {first:.1f} s; " if first is not None else "")
        + f"{report.get('graphs', 0)} graphs, {breaks} graph break{'s' * (breaks != 1)}, "
        f"{recompiles} recompilation{'s' * (recompiles != 1)} in later steps"
        + (f", {evals} for evaluation" if evals else "")
    )
