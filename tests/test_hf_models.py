"""A user's own Task around a Hugging Face model gets its layout from the model: tiny random-init
Llama-, Qwen2- and GPT-2-shaped transformers models (configs made here, nothing downloaded) trained
on gloo CPU ranks. Their blocks come from `_no_split_modules` (the FSDP2 units), their
tensor-parallel plan from the model's own `base_model_tp_plan`, translated to torch's styles, their
pipeline stages from `base_model_pp_plan`; a model without a plan is refused before launch, naming
the model and the way out, and context parallel is refused for these models, saying why.

Each layout is a reformulation of one process's computation (fp32, no dropout), so it must train
like one process does, and must really be the layout it says: each rank reports its DTensor
placements and local shapes (tp), holds about half of the parameters (zero3, hsdp), or holds only
its stage's decoder layers (pp). The Qwen2 model ties its head to its embeddings (as Qwen2-0.5B
does): under pp the two sit on different stages."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn import functional as F
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
    """A 2-layer model of the architecture's shape: grouped-query attention for Llama and Qwen2,
    tied embeddings for Qwen2."""
    shared = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    if arch == "gpt2":
        return transformers.GPT2Config(
            n_embd=WIDTH, n_layer=2, n_head=4, n_positions=SEQ, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, **shared,
        )  # fmt: skip
    config = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[arch]
    return config(
        hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        tie_word_embeddings=arch == "qwen2", **shared,
    )  # fmt: skip


class TinyCausalLM(wb.Task):
    """A transformers causal LM built from a config at random init, on random token windows as
    (input_ids, next tokens): the batch a pipeline splits, its last stage computing the loss from
    the logits alone (`model(x)` is the last stage's output there). The loss is the model's own
    shifted cross-entropy."""

    name = "tiny-causal-lm"
    default_options: dict[str, Any] = {"arch": "llama"}

    def build_model(self, cfg: wb.RunConfig) -> torch.nn.Module:
        config = hf_config(self.options(cfg)["arch"])
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")

    def build_datasets(self, cfg: wb.RunConfig) -> tuple[Any, Any]:
        tokens = torch.randint(3, VOCAB, (256, SEQ + 1), generator=torch.Generator().manual_seed(0))
        return TensorDataset(tokens[:, :-1], tokens[:, 1:]), None

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        out = model(x)
        logits = getattr(out, "logits", out)
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

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
        f"-tp{fields.get('tp', 1)}-pp{fields.get('pp', 1)}",
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
        "hsdp": {"num_processes": 4, "parallelism": "hsdp", "dp_shard": 2, "micro_batch_size": 2},
        "pp": {"num_processes": 2, "pp": 2, "micro_batch_size": 8},
        "pp-tp": {
            "num_processes": 4,
            "pp": 2,
            "tp": 2,
            "micro_batch_size": 8,
            # the stages' decoder layers are the checkpoint units, wrapped after the stage is cut
            "activation_checkpointing": "full",
        },
    },
    "qwen2": {
        "single": {"micro_batch_size": 8},
        "zero3": {"num_processes": 2, "parallelism": "zero3"},
        "tp": {"num_processes": 2, "tp": 2, "micro_batch_size": 8},
        "pp": {"num_processes": 2, "pp": 2, "micro_batch_size": 8, "pp_schedule": "gpipe"},
    },
    "gpt2": {
        "single": {"micro_batch_size": 8},
        "zero3": {"num_processes": 2, "parallelism": "zero3"},
    },
}
"""Global batch 16 in every layout: micro-batch x 2 accumulation x data-parallel ranks (a pipeline's
2 micro-batches are its accumulation steps)."""


class Layouts(dict):  # type: ignore[type-arg]
    """An architecture's runs, each launched when a test first asks for it: a test's time limit
    counts only the launches it waits for, not the whole matrix's."""

    def __init__(self, runs_dir: Path, arch: str) -> None:
        super().__init__()
        self.runs_dir, self.arch = runs_dir, arch

    def __missing__(self, name: str) -> wb.RunResult:
        cfg = cfg_for(self.runs_dir, self.arch, **LAYOUTS[self.arch][name])
        self[name] = wb.launch(cfg, task=TinyCausalLM())
        return self[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Layouts]:
    runs_dir = tmp_path_factory.mktemp("hf-runs")
    return {arch: Layouts(runs_dir, arch) for arch in LAYOUTS}


@pytest.mark.parametrize(
    "arch, layout",
    [(arch, name) for arch, layouts in LAYOUTS.items() for name in layouts if name != "single"],
    ids=lambda v: str(v),
)
def test_every_layout_trains_the_model_like_one_process(
    runs: dict[str, Layouts], arch: str, layout: str
) -> None:
    single, run = runs[arch]["single"], runs[arch][layout]
    assert run.status == "completed" and single.status == "completed"
    assert run.summary["global_batch_size"] == single.summary["global_batch_size"] == 16
    assert worst_relative(losses(run), losses(single)) < 1e-5


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tp_splits_the_models_own_plan_and_divides_the_attention(
    runs: dict[str, Layouts], arch: str
) -> None:
    """The model's plan, not a table of ours: q/k/v/gate/up split by output rows (Shard(0)),
    o/down by input columns (Shard(1)), on every rank, holding half; the embeddings, norms and head
    replicated."""
    for name, rows in (("tp", 2), ("fsdp-tp", 4)):
        if name not in LAYOUTS[arch]:
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
    runs: dict[str, Layouts], arch: str
) -> None:
    """_no_split_modules' class is the unit: each of the 2 ranks holds about half of the
    parameters."""
    single, zero3 = runs[arch]["single"], runs[arch]["zero3"]
    full = single.summary["ranks"][0]["params_bytes"]
    held = [r["params_bytes"] for r in zero3.summary["ranks"]]
    assert all(r["sharded"] for r in zero3.summary["ranks"])
    assert sum(held) == pytest.approx(full, rel=0.01) and max(held) < 0.6 * full, (held, full)


def test_hsdp_shards_within_a_group_and_replicates_across(runs: dict[str, Layouts]) -> None:
    """2 x 2 hsdp: each rank holds half of the model (its shard group of 2 splits the decoder layers
    and the root), the two groups hold the same halves."""
    full = runs["llama"]["single"].summary["ranks"][0]["params_bytes"]
    ranks = runs["llama"]["hsdp"].summary["ranks"]
    assert all(r["mesh"] == {"dp_replicate": 2, "dp_shard": 2} for r in ranks), ranks
    held = [r["params_bytes"] for r in ranks]
    assert sum(held) == pytest.approx(2 * full, rel=0.01) and max(held) < 0.6 * full, (held, full)


def stage_names(model: torch.nn.Module) -> tuple[set[str], set[str]]:
    """The parameter names of a 2-layer model's first stage (the embeddings and layer 0) and its
    last (layer 1, the norm and the head), a tied weight under each of its names."""
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    first = {n for n in names if n.startswith(("model.embed_tokens.", "model.layers.0."))}
    return first, names - first


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_pp_stages_hold_their_decoder_layers_under_the_models_names(
    runs: dict[str, Layouts], arch: str
) -> None:
    """base_model_pp_plan's order cut in two, balanced by parameters: the embeddings and layer 0 on
    stage 0, layer 1, the norm and the head on stage 1 (Qwen2's tied head and embeddings: one on
    each end), under the full model's names; nothing else on either."""
    model = TinyCausalLM().build_model(wb.RunConfig(task_options={"arch": arch}))
    first, last = stage_names(model)
    for layout in ("pp", "pp-tp"):
        if layout not in LAYOUTS[arch]:
            continue
        ranks = sorted(runs[arch][layout].summary["ranks"], key=lambda r: r["rank"])
        half = len(ranks) // 2
        assert [r["pp_stage"] for r in ranks] == [0] * half + [1] * half
        for r in ranks:
            assert set(r["pp_params"]) == (first if r["pp_stage"] == 0 else last), (layout, r)


def test_pp_tp_splits_each_stages_layers_by_the_models_plan(runs: dict[str, Layouts]) -> None:
    """pp=2 x tp=2: the plan's wildcard keys ('model.layers.*.self_attn.q_proj') reach the layer
    each stage holds: split over the stage's 'tp' in halves, columns or rows as the model's plan
    says."""
    for rank in runs["llama"]["pp-tp"].summary["ranks"]:
        layer, split = rank["pp_stage"], rank["split_params"]
        assert {k.split(".")[2] for k in split} == {str(layer)}, split.keys()
        for module in COLWISE + ROWWISE:
            p = split[f"model.layers.{layer}.{module}.weight"]
            full, local = p["global_shape"], p["local_shape"]
            assert p["mesh"] == ["tp"], p
            if module in COLWISE:
                assert p["placements"] == ["Shard(dim=0)"] and local == [full[0] // 2, full[1]], p
            else:
                assert p["placements"] == ["Shard(dim=1)"] and local == [full[0], full[1] // 2], p


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_pipeline_runs_weights_load_as_the_whole_transformers_model(
    runs: dict[str, Layouts], arch: str
) -> None:
    """Both stages' weights gathered under the full model's names load into the transformers model,
    trained as one process trained it; Qwen2's head stayed tied to its embeddings (their gradients
    summed between the stages)."""
    pp, single = runs[arch]["pp"].load_model(), runs[arch]["single"].load_model()
    assert type(pp) is type(single) and type(pp).__name__.endswith("ForCausalLM")
    got, want = pp.state_dict(), single.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert torch.allclose(got[name], want[name], rtol=1e-4, atol=1e-6), name
    if arch == "qwen2":
        from safetensors.torch import load_file

        # stage 0's embeddings and stage 1's head, two copies trained on two ranks: equal only if
        # each step summed their gradients
        saved = load_file(str(runs[arch]["pp"].dir.weights_path))
        assert torch.equal(saved["lm_head.weight"], saved["model.embed_tokens.weight"])
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.allclose(pp(ids).logits, single(ids).logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_the_stages_compute_the_models_own_forward(arch: str, attention: str) -> None:
    """Each stage gives its layers what the base model's forward gives them (positions, rotary
    embeddings, the causal mask: sdpa's is_causal, an explicit mask for eager attention, a sliding
    window for Mistral's 4-token one): the stages in a row compute the model's logits, for 2 and 3
    stages (3 leaves one without layers)."""
    from workbench.tasks.model_plans import declared_stage

    config = (
        transformers.MistralConfig(
            vocab_size=VOCAB,
            hidden_size=WIDTH,
            intermediate_size=2 * WIDTH,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=4,
        )  # fmt: skip
        if arch == "mistral"
        else hf_config(arch)
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention)
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(ids).logits
        for stages in (2, 3):
            x = ids
            for stage in range(stages):
                x = declared_stage(model, stage, stages)(x)
            assert torch.allclose(x, want, rtol=0, atol=1e-6), (stages, (x - want).abs().max())


def test_a_model_without_a_pipeline_plan_is_refused_before_launch_naming_it(tmp_path: Path) -> None:
    cfg = cfg_for(tmp_path, "gpt2", num_processes=2, pp=2, micro_batch_size=8)
    with pytest.raises(
        ValueError,
        match=r"pp=2: GPT2LMHeadModel declares no pipeline plan \(config.base_model_pp_plan\); "
        r"set pp=1, or define TinyCausalLM.pipeline_stages",
    ):
        wb.launch(cfg, task=TinyCausalLM())
    assert not any(tmp_path.iterdir()), "refused before any run directory was made"


def test_a_classifier_is_refused_a_pipeline_naming_the_head_its_plan_leaves_out() -> None:
    """A sequence classifier's score head pools the last token of each input: the plan
    (embeddings -> layers -> norm) has no place for it, and a stage that skipped it would train
    another model."""
    from workbench.tasks.model_plans import declared_stage

    config = hf_config("llama")
    with torch.device("meta"):
        model = transformers.AutoModelForSequenceClassification.from_config(config)
    with pytest.raises(
        ValueError,
        match=r"LlamaForSequenceClassification's pipeline plan .* leaves out module\(s\) with "
        r"weights: score; .* Set pp=1",
    ):
        declared_stage(model, 1, 2)


def test_context_parallel_is_refused_for_a_transformers_model_saying_why() -> None:
    """cp isn't proven equal to one process for these models: their forward makes the positions
    that a sequence split would have to shard. Refused before launch, naming the model (the check
    past the CPU's own refusal of cp, which a GPU machine doesn't make)."""
    from workbench.config.preflight import check_parallel_task

    cfg = wb.RunConfig(
        task="tiny-causal-lm",
        task_options={"arch": "llama"},
        num_processes=2,
        cp=2,
        parallelism="zero3",
    )
    with pytest.raises(
        ValueError,
        match=r"cp=2: LlamaForCausalLM computes its token positions inside its forward .* each "
        r"rank would embed its chunks of the sequence as if they started at position 0, unlike "
        r"one process; set cp=1, or define TinyCausalLM.context_parallel_buffers",
    ):
        check_parallel_task(cfg, TinyCausalLM())


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
        match=r"tp=2: GPT2LMHeadModel declares no tensor-parallel plan "
        r"\(config.base_model_tp_plan\); set tp=1, or define TinyCausalLM.tensor_parallel_plan",
    ):
        wb.launch(cfg, task=TinyCausalLM())
    assert not any(tmp_path.iterdir()), "refused before any run directory was made"


def test_save_pretrained_gives_a_folder_transformers_loads_with_the_same_logits(
    runs: dict[str, Layouts], tmp_path: Path
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
    """wb.estimate goes through the same plans: under tp=2 each rank holds the replicated
    embeddings, norms and head plus half of every matrix the model's plan splits."""
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
    # the estimate prices a GPU, whose allocator rounds each tensor up to 512 bytes: ratios, not
    # bytes
    ddp = params(num_processes=2)
    assert ddp == pytest.approx(full, rel=0.03)
    assert params(num_processes=2, tp=2) / ddp == pytest.approx(1 - planned / full / 2, rel=0.03)
