"""wb.estimate for a Task whose model is a transformers model: built on the meta device from its
config (nothing allocated, no weights read), laid out by the model's own plans as the trainer lays
it out (tasks/model_plans.ModelPlan), and priced per rank. Compared with real 2-rank CPU runs whose
step PyTorch's memory tracker measured (track_memory): the peak within the issue's 10% and the model
state exact, under zero3, zero3 with LoRA through peft, and tp=2; under pp=2 (whose memory the
trainer can't track) the stages' model state. A model folder is estimated from its config alone.

LoRA freezes the base: the estimate must count gradients and optimizer state for the adapters only
(sizes computed here from the trainable parameters), while the frozen base stays sharded.

Under zero3 a rank's parameters at the peak exceed its shard (2.3x here): the root unit (embeddings,
final norm, head: what no decoder layer holds) is gathered whole through backward. The real run
holds the same; the estimate says so in its assumptions."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from machine_stand_in import stand_in_machine
from test_estimate import RETRIES, _lower_peaks
from torch.utils.data import TensorDataset

import workbench as wb
from workbench.estimator import estimate

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is needed")
peft = pytest.importorskip("peft", reason="the hf extra (peft) is needed for LoRA")

pytestmark = pytest.mark.slow

VOCAB, SEQ = 256, 32
TOLERANCE = 0.10
"""Issue 45's promise for these tasks: memory per rank within 10% of the measured peak."""
LAYOUTS: dict[str, dict[str, Any]] = {
    "zero3": {"parallelism": "zero3"},
    "lora-zero3": {"parallelism": "zero3", "task_options": {"lora": True}},
    "tp2": {"tp": 2, "micro_batch_size": 8},
    # the frozen base split by the model's plan, the adapters beside it split to match
    "lora-tp2": {"tp": 2, "micro_batch_size": 8, "task_options": {"lora": True}},
    # the trainer can't track a pipeline's memory (track_memory is refused with pp > 1): model
    # state only; tests/test_estimate_layouts.py checks stage peaks against the real schedule
    "pp2": {"pp": 2, "micro_batch_size": 2, "grad_accum_steps": 4, "track_memory": False},
}


class TinyLlama(wb.Task):
    """A Llama-shaped causal LM from a config at random init (LoRA on q_proj and v_proj through
    peft when task_options.lora), on random token windows."""

    name = "tiny-llama-estimate"
    default_options: dict[str, Any] = {"lora": False}

    def build_model(self, cfg: wb.RunConfig) -> torch.nn.Module:
        config = transformers.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
        )  # fmt: skip
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        if self.options(cfg)["lora"]:
            lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
            model = peft.get_peft_model(model, lora)
        return model

    def build_datasets(self, cfg: wb.RunConfig) -> tuple[Any, Any]:
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, VOCAB, (256, SEQ + 1), generator=g)
        return TensorDataset(tokens[:, :-1], tokens[:, 1:]), None

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        out = model(x)
        # the model returns its output; a pipeline's last stage, the logits
        logits = getattr(out, "logits", out)
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    def tokens_per_sample(self, cfg: wb.RunConfig) -> int:
        return SEQ


def cfg_for(runs_dir: Path, **fields: Any) -> wb.RunConfig:
    base = dict(
        task=TinyLlama.name,
        num_processes=2,
        device="cpu",
        micro_batch_size=4,
        grad_accum_steps=2,
        max_steps=2,
        log_every=1,
        runs_dir=str(runs_dir),
        oversubscribe=True,
        track_memory=True,
    )
    return wb.RunConfig(**{**base, **fields})


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[list[dict], Any]]:
    """Each layout's real run (its ranks, memory tracked) and the estimate of the same config (time
    priced on a stand-in machine profile: memory is what these tests check)."""
    runs_dir = tmp_path_factory.mktemp("hf-estimate-runs")
    out = {}
    for name, fields in LAYOUTS.items():
        cfg = cfg_for(runs_dir, **fields)
        with stand_in_machine():
            est = estimate(cfg, task=TinyLlama())
        ranks = wb.launch(cfg, task=TinyLlama()).summary["ranks"]
        for _ in range(RETRIES if cfg.track_memory else 0):
            if all(abs(est.ranks[r["rank"]].tensors / _peak(r) - 1) < 0.02 for r in ranks):
                break
            ranks = _lower_peaks(ranks, wb.launch(cfg, task=TinyLlama()).summary["ranks"])
        out[name] = ranks, est
    return out


def _peak(rank: dict) -> int:
    return rank["tracked_memory"]["peak"]


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "pp2"])
def test_the_peak_per_rank_is_within_10_percent_and_the_model_state_exact(
    measured: dict, layout: str
) -> None:
    ranks, est = measured[layout]
    assert len(est.ranks) == len(ranks) == 2
    for real in ranks:
        mine = est.ranks[real["rank"]]
        held = {k: real[f"{k}_bytes"] for k in ("params", "grads", "optimizer")}
        assert mine.held == held, (layout, real["rank"])
        # the parameters alive at the peak (shards plus what is gathered whole then) as tracked:
        # which unit is gathered at the peak's moment follows how the all-gathers overlap the
        # compute, so under load it may be one decoder layer more or less than traced
        tracked = real["tracked_memory"]["params"]
        assert abs(mine.params - tracked) <= TOLERANCE * _peak(real), (layout, mine.params, tracked)
        assert abs(mine.tensors / _peak(real) - 1) < TOLERANCE, (layout, mine.tensors, _peak(real))


def _shard_numel(shape: torch.Size, rank: int, world: int) -> int:
    """FSDP2's share of a tensor for `rank`: dim-0 chunks as torch.chunk makes them."""
    rows = shape[0] if shape else 1
    chunk = math.ceil(rows / world)
    mine = max(0, min(chunk, rows - rank * chunk))
    return mine * math.prod(shape[1:])


def test_lora_counts_gradients_and_optimizer_state_of_the_adapters_only(measured: dict) -> None:
    """Frozen base weights have no gradient and no AdamW moments: the estimate's grads and optimizer
    state are the adapters' (computed here from the trainable parameters' shapes), while every
    weight, frozen or not, is still sharded over the 2 ranks."""
    _, est = measured["lora-zero3"]
    _, full = measured["zero3"]
    with torch.device("meta"):
        model = TinyLlama().build_model(cfg_for(Path("."), task_options={"lora": True}))
    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert trainable and frozen
    for rank in est.ranks:
        grads = 4 * sum(_shard_numel(p.shape, rank.rank, 2) for p in trainable)
        # AdamW: two fp32 moments per element of the shard, and a 4-byte step per parameter
        optimizer = 2 * grads + 4 * len(trainable)
        assert rank.held["grads"] == grads
        assert rank.held["optimizer"] == optimizer
        # the adapters are a small fraction of the model: nothing of the base is counted
        assert rank.held["grads"] < 0.05 * full.ranks[rank.rank].held["grads"]
        weights = 4 * sum(_shard_numel(p.shape, rank.rank, 2) for p in model.parameters())
        assert rank.held["params"] == weights
        assert rank.held["params"] < 0.6 * 4 * sum(p.numel() for p in model.parameters())


def test_the_root_unit_is_held_whole_through_backward_and_said_so(measured: dict) -> None:
    """Why zero3's params at the peak read well above the shard (2.3x here): the root unit (the
    parameters outside the decoder layers: embeddings, final norm, head) is gathered whole through
    backward, beside the decoder layer being computed. The estimate's gap over the shard is those
    parameters' bytes, as in the real run (the tracked params match:
    test_the_peak_per_rank_is_within_10_percent_and_the_model_state_exact), and its assumptions
    say it."""
    _, est = measured["zero3"]
    with torch.device("meta"):
        model = TinyLlama().build_model(cfg_for(Path(".")))
    inside = {id(p) for layer in model.model.layers for p in layer.parameters()}
    root = 4 * sum(p.numel() for p in model.parameters() if id(p) not in inside)
    layer = 4 * sum(p.numel() for p in model.model.layers[0].parameters())
    rank = est.ranks[0]
    gap = rank.params - rank.held["params"]
    assert rank.params / rank.held["params"] > 1.5
    # a layer's parameters at the peak are those of the one being computed, or none
    assert gap in (root, root + layer), (gap, root, layer)
    note = next(a for a in est.assumptions if a.startswith("params at the peak"))
    assert f"{gap:,} bytes of parameters gathered whole" in note
    assert "root unit" in note


def test_tp_splits_the_matrices_the_model_plans(measured: dict) -> None:
    """Under tp=2 each rank holds the embeddings, norms and head whole and half of every matrix
    the model's own plan (config.base_model_tp_plan) splits, as the real run holds."""
    ranks, est = measured["tp2"]
    with torch.device("meta"):
        model = TinyLlama().build_model(cfg_for(Path(".")))
    planned = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    split = sum(p.numel() for n, p in model.named_parameters() if n.split(".")[-2] in planned)
    whole = sum(p.numel() for p in model.parameters()) - split
    for rank in est.ranks:
        assert rank.held["params"] == 4 * (whole + split // 2)


def test_pp_stages_are_cut_along_the_models_pipeline_plan(measured: dict) -> None:
    """pp=2 follows the model's base_model_pp_plan as the trainer does: stage 0 holds the
    embeddings and the first decoder layer, stage 1 the second, the final norm and the head; each
    rank's model state is what its real stage held."""
    ranks, est = measured["pp2"]
    with torch.device("meta"):
        model = TinyLlama().build_model(cfg_for(Path(".")))
    sizes = {n: 4 * p.numel() for n, p in model.named_parameters()}
    first = sum(
        v for n, v in sizes.items() if n.startswith(("model.embed_tokens", "model.layers.0."))
    )
    last = sum(
        v for n, v in sizes.items() if n.startswith(("model.layers.1.", "model.norm", "lm_head"))
    )
    assert first + last == sum(sizes.values())  # nothing else in the model
    assert [r["pp_stage"] for r in ranks] == [0, 1]
    assert [r.held["params"] for r in est.ranks] == [first, last]
    for real in ranks:
        held = {k: real[f"{k}_bytes"] for k in ("params", "grads", "optimizer")}
        assert est.ranks[real["rank"]].held == held


def test_a_model_folder_is_estimated_from_its_config_without_reading_its_weights(
    tmp_path: Path,
) -> None:
    """hf-causal-lm on a saved model folder: the estimate builds the model on the meta device from
    config.json alone. Its weights file here is garbage of the right size, which from_pretrained
    refuses, and the estimate still gives each zero3 rank half of the model's parameters."""
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=64,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config)
    folder = tmp_path / "tiny-llama"
    model.save_pretrained(folder)
    (weights,) = folder.glob("*.safetensors")
    weights.write_bytes(b"\xff" * weights.stat().st_size)
    with pytest.raises(Exception, match="deserializing header"):  # safetensors' own error
        transformers.AutoModelForCausalLM.from_pretrained(folder)
    # a small local corpus: the tokenizer trains on it in a moment
    words = [f"w{i}{chr(97 + i % 26)}" for i in range(400)]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(" ".join(words[i : i + 12]) for i in range(0, 388, 3)))
    cfg = wb.RunConfig(
        task="hf-causal-lm",
        task_options={
            "model": str(folder),
            "dataset": str(corpus),
            "tokenizer": "train:512",
            "seq_len": SEQ,
        },
        num_processes=2,
        parallelism="zero3",
        micro_batch_size=4,
        device="cpu",
        runs_dir=str(tmp_path / "runs"),
    )
    with stand_in_machine():
        est = estimate(cfg)
    full = 4 * sum(p.numel() for p in model.parameters())
    assert [r.held["params"] for r in est.ranks] == [full // 2, full // 2]
