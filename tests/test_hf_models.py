"""A user's own Task around a Hugging Face model gets its layout from the model: tiny random-init
Llama-, Qwen2- and GPT-2-shaped transformers models (configs made here, nothing downloaded) trained on
gloo CPU ranks. Their blocks come from `_no_split_modules` (the FSDP2 units), their tensor-parallel plan
from the model's own `base_model_tp_plan`, translated to torch's styles; a model without a plan is
refused before launch, naming the model and the way out.

Each layout is a reformulation of one process's computation (fp32, no dropout), so it must train like
one process does, and must really be the layout it says: each rank reports its DTensor placements and
local shapes (tp), or holds about half of the parameters (zero3)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import TensorDataset

import workbench as wb

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is needed")

pytestmark = pytest.mark.slow

STEPS = 6
VOCAB, SEQ, WIDTH = 96, 16, 32
COLWISE = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
)
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


def hf_config(arch: str) -> Any:
    """A 2-layer model of the architecture's shape: grouped-query attention for Llama and Qwen2."""
    shared = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    if arch == "gpt2":
        return transformers.GPT2Config(
            n_embd=WIDTH, n_layer=2, n_head=4, n_positions=SEQ, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, **shared,
        )  # fmt: skip
    config = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[arch]
    return config(
        hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ, **shared,
    )  # fmt: skip


class TinyCausalLM(wb.Task):
    """A transformers causal LM built from a config at random init, on random token windows."""

    name = "tiny-causal-lm"
    default_options: dict[str, Any] = {"arch": "llama"}

    def build_model(self, cfg: wb.RunConfig) -> torch.nn.Module:
        config = hf_config(self.options(cfg)["arch"])
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")

    def build_datasets(self, cfg: wb.RunConfig) -> tuple[Any, Any]:
        tokens = torch.randint(3, VOCAB, (256, SEQ), generator=torch.Generator().manual_seed(0))
        return TensorDataset(tokens), None

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        (ids,) = batch
        return model(input_ids=ids, labels=ids).loss

    def tokens_per_sample(self, cfg: wb.RunConfig) -> int:
        return SEQ


def cfg_for(runs_dir: Path, arch: str, **fields: Any) -> wb.RunConfig:
    base = dict(
        task="tiny-causal-lm",
        task_options={"arch": arch},
        num_processes=1,
        device="cpu",
        micro_batch_size=4,  # 8 where one data-parallel rank holds the whole batch (LAYOUTS)
        grad_accum_steps=2,
        max_steps=STEPS,
        log_every=1,
        lr=3e-3,
        runs_dir=str(runs_dir),
        seed=5,
        oversubscribe=True,
        dist_timeout_s=120,
        run_name=f"{arch}-{fields.get('parallelism', 'ddp')}-{fields.get('num_processes', 1)}"
        f"-tp{fields.get('tp', 1)}",
    )
    return wb.RunConfig(**{**base, **fields})


def losses(result: wb.RunResult) -> list[float]:
    return [r["loss"] for r in result.metrics if "loss" in r]


def worst_relative(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) == STEPS
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


LAYOUTS = {
    "llama": {
        "single": {"micro_batch_size": 8},
        "ddp": {"num_processes": 2},
        "zero3": {"num_processes": 2, "parallelism": "zero3"},
        "tp": {"num_processes": 2, "tp": 2, "micro_batch_size": 8},
        "fsdp-tp": {"num_processes": 4, "tp": 2, "parallelism": "zero3"},
    },
    "qwen2": {
        "single": {"micro_batch_size": 8},
        "zero3": {"num_processes": 2, "parallelism": "zero3"},
        "tp": {"num_processes": 2, "tp": 2, "micro_batch_size": 8},
    },
    "gpt2": {
        "single": {"micro_batch_size": 8},
        "zero3": {"num_processes": 2, "parallelism": "zero3"},
    },
}
"""Global batch 16 in every layout: micro-batch x 2 accumulation x data-parallel ranks."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, wb.RunResult]]:
    runs_dir = tmp_path_factory.mktemp("hf-runs")
    return {
        arch: {
            name: wb.launch(cfg_for(runs_dir, arch, **fields), task=TinyCausalLM())
            for name, fields in layouts.items()
        }
        for arch, layouts in LAYOUTS.items()
    }


@pytest.mark.parametrize(
    "arch, layout",
    [(arch, name) for arch, layouts in LAYOUTS.items() for name in layouts if name != "single"],
    ids=lambda v: str(v),
)
def test_every_layout_trains_the_model_like_one_process(
    runs: dict[str, dict[str, wb.RunResult]], arch: str, layout: str
) -> None:
    single, run = runs[arch]["single"], runs[arch][layout]
    assert run.status == "completed" and single.status == "completed"
    assert run.summary["global_batch_size"] == single.summary["global_batch_size"] == 16
    assert worst_relative(losses(run), losses(single)) < 1e-5


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tp_splits_the_models_own_plan_and_divides_the_attention(
    runs: dict[str, dict[str, wb.RunResult]], arch: str
) -> None:
    """The model's plan, not a table of ours: q/k/v/gate/up split by output rows (Shard(0)), o/down by
    input columns (Shard(1)), on every rank, holding half; the embeddings, norms and head replicated."""
    for name, rows in (("tp", 2), ("fsdp-tp", 4)):
        if name not in runs[arch]:
            continue
        for rank in runs[arch][name].summary["ranks"]:
            split = rank["tp_params"]
            for layer in (0, 1):
                for module in COLWISE + ROWWISE:
                    p = split[f"model.layers.{layer}.{module}.weight"]
                    full, local = p["global_shape"], p["local_shape"]
                    if module in COLWISE:
                        assert "Shard(dim=0)" in p["placements"], (rank["rank"], module, p)
                        assert local == [full[0] // rows, full[1]], (rank["rank"], module, p)
                    else:
                        assert p["placements"][-1] == "Shard(dim=1)", (rank["rank"], module, p)
                        assert local[1] == full[1] // 2, (rank["rank"], module, p)
            assert not any(
                k.startswith(("model.embed_tokens", "lm_head", "model.norm")) and "tp" in p["mesh"]
                for k, p in split.items()
            )


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_zero3_shards_the_decoder_layers_the_model_names(
    runs: dict[str, dict[str, wb.RunResult]], arch: str
) -> None:
    """_no_split_modules' class is the unit: each of the 2 ranks holds about half of the parameters."""
    single, zero3 = runs[arch]["single"], runs[arch]["zero3"]
    full = single.summary["ranks"][0]["params_bytes"]
    held = [r["params_bytes"] for r in zero3.summary["ranks"]]
    assert all(r["sharded"] for r in zero3.summary["ranks"])
    assert sum(held) == pytest.approx(full, rel=0.01) and max(held) < 0.6 * full, (held, full)


def test_a_units_list_is_the_models_decoder_layers() -> None:
    from workbench.tasks.blocks import shard_units
    from workbench.tasks.model_plans import ModelPlan

    for arch, layer in (("llama", "LlamaDecoderLayer"), ("gpt2", "GPT2Block")):
        with torch.device("meta"):
            model = TinyCausalLM().build_model(wb.RunConfig(task_options={"arch": arch}))
        units = shard_units(model, ModelPlan(TinyCausalLM()))
        assert [type(u).__name__ for u in units] == [layer, layer]


def test_a_task_hook_wins_over_the_models_plan() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel

    from workbench.tasks.model_plans import ModelPlan

    class OwnPlan(TinyCausalLM):
        def tensor_parallel_plan(self, model: torch.nn.Module, cfg: wb.RunConfig) -> Any:
            return {"model.layers.*.mlp.up_proj": ColwiseParallel()}

    cfg = wb.RunConfig(task_options={"arch": "llama"}, num_processes=2, tp=2)
    model = OwnPlan().build_model(cfg)
    assert list(ModelPlan(OwnPlan()).tensor_parallel_plan(model, cfg)) == [
        "model.layers.*.mlp.up_proj"
    ]
    declared = ModelPlan(TinyCausalLM()).tensor_parallel_plan(model, cfg)
    assert {k: type(v).__name__ for k, v in declared.items()} == {
        **{f"model.layers.*.{m}": "ColwiseParallel" for m in COLWISE},
        **{f"model.layers.*.{m}": "RowwiseParallel" for m in ROWWISE},
    }


def test_a_model_without_a_plan_is_refused_before_launch_naming_it(tmp_path: Path) -> None:
    cfg = cfg_for(tmp_path, "gpt2", num_processes=2, tp=2)
    with pytest.raises(
        ValueError,
        match=r"tp=2: GPT2LMHeadModel declares no tensor-parallel plan \(config.base_model_tp_plan\); "
        r"set tp=1, or define TinyCausalLM.tensor_parallel_plan",
    ):
        wb.launch(cfg, task=TinyCausalLM())
    assert not any(tmp_path.iterdir()), "refused before any run directory was made"


def test_save_pretrained_gives_a_folder_transformers_loads_with_the_same_logits(
    runs: dict[str, dict[str, wb.RunResult]], tmp_path: Path
) -> None:
    """The tp run's weights, gathered from both ranks, saved as a transformers folder: a fresh
    interpreter that knows nothing of workbench loads it with AutoModelForCausalLM and computes the
    logits load_model()'s model computes here."""
    import subprocess
    import sys

    run = runs["llama"]["tp"]
    folder = run.save_pretrained(tmp_path / "llama")
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    model = run.load_model()
    assert isinstance(model, transformers.LlamaForCausalLM)
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        here = model(input_ids=ids).logits
    torch.save(ids, tmp_path / "ids.pt")
    code = (
        "import sys, torch, transformers\n"
        "m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()\n"
        "ids = torch.load(sys.argv[2], weights_only=True)\n"
        "with torch.no_grad():\n    torch.save(m(input_ids=ids).logits, sys.argv[3])\n"
    )
    env = {**__import__("os").environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code, str(folder), str(tmp_path / "ids.pt"), str(tmp_path / "l.pt")],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    there = torch.load(tmp_path / "l.pt", weights_only=True)
    assert torch.equal(here, there)


def test_save_pretrained_refuses_a_model_that_is_not_a_transformers_one(tmp_path: Path) -> None:
    result = wb.launch(
        wb.RunConfig(task="digits", max_steps=1, runs_dir=str(tmp_path), eval_every=0)
    )
    with pytest.raises(TypeError, match=r"not a transformers PreTrainedModel; use load_model\(\)"):
        result.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_estimate_traces_the_models_own_plans() -> None:
    """wb.estimate goes through the same plans: under tp=2 each rank holds the replicated embeddings,
    norms and head plus half of every matrix the model's plan splits."""
    from workbench.estimator import estimate

    def params(**fields: Any) -> int:
        cfg = wb.RunConfig(
            task="tiny-causal-lm", task_options={"arch": "llama"}, micro_batch_size=4, **fields
        )
        est = estimate(cfg, task=TinyCausalLM(), gpu="H100-SXM-80GB", gpus=2)
        return max(r.params for r in est.ranks)

    model = TinyCausalLM().build_model(wb.RunConfig(task_options={"arch": "llama"}))
    full = 4 * sum(p.numel() for p in model.parameters())
    planned = 4 * sum(
        p.numel() for n, p in model.named_parameters() if any(m in n for m in COLWISE + ROWWISE)
    )
    # the estimate prices a GPU, whose allocator rounds each tensor up to 512 bytes: ratios, not bytes
    ddp = params(num_processes=2)
    assert ddp == pytest.approx(full, rel=0.03)
    assert params(num_processes=2, tp=2) / ddp == pytest.approx(1 - planned / full / 2, rel=0.03)
