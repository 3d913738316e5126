"""The built-in Hugging Face tasks, `hf-causal-lm` and `hf-sequence-classification`, end to end on
CPU ranks: a Llama-shaped model at random init (or from a folder written here), a BPE tokenizer
trained on the shipped corpus, the data tokenized once into the cache, LoRA through peft, and the
weights back as folders transformers and peft load in a fresh interpreter. Nothing is downloaded:
the hub is off in every rank."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import workbench as wb

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is needed")
peft = pytest.importorskip("peft", reason="the hf extra (peft) is needed")

from workbench.tasks.hf.causal_lm import CausalLMTask  # noqa: E402

pytestmark = pytest.mark.slow

SHAPE = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
OPTIONS: dict[str, Any] = {
    "model": "llama",
    "model_config": SHAPE,
    "dataset": "tinyshakespeare",
    "tokenizer": "train:512",
    "seq_len": 32,
}
LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "o_proj"]}
"""Adapters beside a column-wise (q_proj) and a row-wise (o_proj) layer of the tensor-parallel
plan."""


def cfg_for(runs_dir: Path, name: str, **fields: Any) -> wb.RunConfig:
    base: dict[str, Any] = dict(
        task="hf-causal-lm",
        task_options=OPTIONS,
        num_processes=1,
        device="cpu",
        micro_batch_size=8,
        max_steps=6,
        log_every=1,
        lr=1e-2,
        warmup_steps=0,
        min_lr_ratio=1.0,  # a constant lr: a run stopped early keeps the schedule of a long one
        eval_every=0,
        runs_dir=str(runs_dir),
        run_name=name,
        seed=3,
        oversubscribe=True,
        dist_timeout_s=120,
    )
    return wb.RunConfig(**{**base, **fields})


def losses(result: wb.RunResult) -> list[float]:
    return [r["loss"] for r in result.metrics if "loss" in r]


WATCHED = (
    "mlp.up_proj",
    "self_attn.q_proj.base_layer",
    "self_attn.q_proj.lora_B.default",
    "self_attn.o_proj.lora_A.default",
)
"""Layer 0's frozen base weights and adapters whose local shapes the ranks report."""


class LocalShapes(CausalLMTask):
    """hf-causal-lm that reports, per rank, the local shape of a frozen base weight and which
    parameters train (the layout made visible), and whether the hub is off there."""

    def rank_value(self, model: torch.nn.Module, cfg: wb.RunConfig) -> Any:
        import huggingface_hub.constants
        from torch.distributed.tensor import DTensor

        shapes = {}
        for name, p in model.named_parameters():
            for key in WATCHED:
                if name.endswith(f"layers.0.{key}.weight"):
                    local = p.to_local() if isinstance(p, DTensor) else p
                    shapes[key] = (tuple(local.shape), tuple(p.shape))
        trained = sorted(n for n, p in model.named_parameters() if p.requires_grad)
        hub_off = (os.environ.get("HF_HUB_OFFLINE"), huggingface_hub.constants.HF_HUB_OFFLINE)
        return {"shapes": shapes, "trained": trained, "hub_off": hub_off}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, wb.RunResult]:
    runs_dir = tmp_path_factory.mktemp("hf-tasks")
    lora = {**OPTIONS, "lora": LORA}
    with pytest.MonkeyPatch.context() as env:
        # the launcher turns the hub off in the ranks, whatever the caller's environment says
        for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
            env.delenv(name, raising=False)
        return launch_all(runs_dir, lora)


def launch_all(runs_dir: Path, lora: dict[str, Any]) -> dict[str, wb.RunResult]:
    return {
        "single": wb.launch(cfg_for(runs_dir, "single")),
        "ddp-half": wb.launch(
            cfg_for(runs_dir, "ddp-half", num_processes=2, micro_batch_size=4, max_steps=3)
        ),
        "lora-single": wb.launch(cfg_for(runs_dir, "lora-single", task_options=lora)),
        "lora-zero3": wb.launch(
            cfg_for(
                runs_dir,
                "lora-zero3",
                task_options=lora,
                num_processes=2,
                micro_batch_size=4,
                parallelism="zero3",
                checkpoint_every=3,
            ),
            task=LocalShapes(),
        ),
        "lora-tp": wb.launch(
            cfg_for(runs_dir, "lora-tp", task_options=lora, num_processes=2, tp=2),
            task=LocalShapes(),
        ),
    }


def test_causal_lm_trains_from_a_config_on_a_tokenizer_it_trained(
    runs: dict[str, wb.RunResult],
) -> None:
    """An architecture name and a shape give a random-init Llama sized for the trained tokenizer;
    the run learns (the loss falls from about ln(vocab)) and keeps the tokenizer in its run
    directory."""
    run = runs["single"]
    assert run.summary["status"] == "completed"
    model = run.load_model()
    assert isinstance(model, transformers.LlamaForCausalLM)
    assert model.config.num_hidden_layers == 2 and model.config.vocab_size == 512
    found = losses(run)
    assert abs(found[0] - torch.log(torch.tensor(512.0)).item()) < 0.5
    assert found[-1] < found[0] - 0.2
    tokenizer = transformers.AutoTokenizer.from_pretrained(run.run_dir / "tokenizer")
    assert len(tokenizer) == 512
    text = "To be, or not to be"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_resume_mid_epoch_continues_the_data_exactly(runs: dict[str, wb.RunResult]) -> None:
    """Two ranks, stopped at step 3 of 6 and resumed: steps 4-6 see the samples the uninterrupted
    run saw (packed windows, each rank its shard), so the losses are the one-process run's."""
    resumed = runs["ddp-half"].resume(max_steps=6)
    assert resumed.summary["status"] == "completed"
    assert losses(resumed) == pytest.approx(losses(runs["single"]), rel=2e-4)


def test_lora_trains_only_the_adapters_on_a_sharded_frozen_base(
    runs: dict[str, wb.RunResult],
) -> None:
    """LoRA under zero3 on 2 ranks: the trained parameters are the adapters alone, the frozen base
    is sharded (each rank half of a weight), the checkpoints hold only the adapters, and the losses
    are one process's."""
    from workbench.training.checkpoint.files import saved_model_shapes

    run = runs["lora-zero3"]
    assert losses(run) == pytest.approx(losses(runs["lora-single"]), rel=2e-4)
    assert losses(run) != pytest.approx(losses(runs["single"]), rel=1e-3)
    for value in run.rank_values:
        local, full = value["shapes"]["mlp.up_proj"]
        assert local[0] * 2 == full[0] and local[1] == full[1]
        assert value["trained"] and all(".lora_" in n for n in value["trained"])
        assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in value["trained"]} == {
            "q_proj",
            "o_proj",
        }
    saved = saved_model_shapes(run.run_dir / "checkpoints" / "step_3" / "model")
    assert saved and all(".lora_" in name for name in saved)
    # the checkpoint loads into the whole model: the base is rebuilt as the ranks built it
    assert torch.equal(
        run.load_model(step=6).state_dict()[
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"
        ],
        run.load_model().state_dict()[
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"
        ],
    )


def test_lora_under_tensor_parallel_splits_the_base_and_the_adapters_alike(
    runs: dict[str, wb.RunResult],
) -> None:
    """LoRA under tp=2: the frozen base is split by the model's own plan, and each adapter beside it
    so that its output adds to the base's shard (lora_B by columns beside the column-wise q_proj,
    lora_A by rows beside the row-wise o_proj); the losses are one process's."""
    run = runs["lora-tp"]
    assert losses(run) == pytest.approx(losses(runs["lora-single"]), rel=2e-4)
    for value in run.rank_values:
        shapes = value["shapes"]
        (local, full) = shapes["self_attn.q_proj.base_layer"]
        assert local[0] * 2 == full[0] and local[1] == full[1]
        (local, full) = shapes["self_attn.q_proj.lora_B.default"]
        assert local == (full[0] // 2, LORA["r"])
        (local, full) = shapes["self_attn.o_proj.lora_A.default"]
        assert local == (LORA["r"], full[1] // 2)
        assert all(".lora_" in n for n in value["trained"])


def fresh_logits(code: str, *args: Path) -> torch.Tensor:
    """Run `code` in a new interpreter (hub off, no workbench imported) that saves logits to the
    last argument; return them."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return torch.load(args[-1], weights_only=True)


def test_save_pretrained_gives_an_adapter_peft_loads_and_a_merged_model(
    runs: dict[str, wb.RunResult], tmp_path: Path
) -> None:
    """The LoRA run's adapter folder loads with PeftModel.from_pretrained on its base (written
    beside it: the base was random init), the merged folder with AutoModelForCausalLM, each in a
    fresh interpreter, with load_model()'s logits; both carry the tokenizer; the merged model
    generates in this process."""
    run = runs["lora-zero3"]
    adapter = run.save_pretrained(tmp_path / "adapter")
    merged = run.save_pretrained(tmp_path / "merged", merged=True)
    assert (adapter / "adapter_config.json").is_file()
    assert (adapter / "adapter_model.safetensors").is_file()
    assert not (adapter / "model.safetensors").exists()
    assert (merged / "model.safetensors").is_file() and (merged / "tokenizer.json").is_file()
    ids = torch.randint(3, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.save(ids, tmp_path / "ids.pt")
    with torch.no_grad():
        here = run.load_model()(ids).logits
    peft_code = (
        "import sys, json, torch, transformers, peft\n"
        "cfg = json.load(open(sys.argv[1] + '/adapter_config.json'))\n"
        "base = transformers.AutoModelForCausalLM.from_pretrained(cfg['base_model_name_or_path'])\n"
        "m = peft.PeftModel.from_pretrained(base, sys.argv[1]).eval()\n"
        "ids = torch.load(sys.argv[2], weights_only=True)\n"
        "with torch.no_grad():\n    torch.save(m(ids).logits, sys.argv[3])\n"
    )
    merged_code = (
        "import sys, torch, transformers\n"
        "m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()\n"
        "ids = torch.load(sys.argv[2], weights_only=True)\n"
        "with torch.no_grad():\n    torch.save(m(ids).logits, sys.argv[3])\n"
    )
    via_peft = fresh_logits(peft_code, adapter, tmp_path / "ids.pt", tmp_path / "a.pt")
    via_merged = fresh_logits(merged_code, merged, tmp_path / "ids.pt", tmp_path / "m.pt")
    torch.testing.assert_close(via_peft, here)
    torch.testing.assert_close(via_merged, here, rtol=1e-4, atol=1e-5)
    model = transformers.AutoModelForCausalLM.from_pretrained(merged)
    tokenizer = transformers.AutoTokenizer.from_pretrained(merged)
    prompt = tokenizer("ROMEO:", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=5, do_sample=False)
    assert out.shape[1] == prompt["input_ids"].shape[1] + 5


def test_a_model_folder_is_loaded_with_its_weights_and_tokenizer(tmp_path: Path) -> None:
    """model= a save_pretrained folder: the task's model has the folder's weights (not a random
    init), in fp32, and the folder's tokenizer is the one used."""
    from workbench.tasks.hf.causal_lm import CausalLMTask

    folder = tmp_path / "model"
    base = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**SHAPE, vocab_size=300), dtype=torch.bfloat16
    )
    base.save_pretrained(folder)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=_bpe(tmp_path, 300), eos_token="<eos>", pad_token="<pad>"
    )
    tokenizer.save_pretrained(folder)
    task = CausalLMTask()
    cfg = cfg_for(tmp_path, "folder", task_options={"model": str(folder), "seq_len": 32})
    task.check_options(cfg)
    model = task.build_model(cfg)
    saved = base.state_dict()
    for name, tensor in model.state_dict().items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, saved[name].float()), name
    assert task.tokenizer(cfg).get_vocab() == tokenizer.get_vocab()


def _bpe(tmp_path: Path, vocab: int) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<eos>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 50, trainer=trainer)
    return bpe


def test_sequence_classification_learns_string_labels(tmp_path: Path) -> None:
    """A jsonl of texts with 'pos'/'neg' labels: the labels are numbered in sorted order and named
    in the model's config, and two ranks learn the separable task (eval accuracy reported)."""
    import random

    rng = random.Random(0)
    rows = []
    for _ in range(240):
        positive = rng.random() < 0.5
        words = rng.sample(["good", "great", "fine"] if positive else ["bad", "awful", "poor"], 2)
        words += rng.sample(["movie", "plot", "actor", "scene", "score"], 3)
        rng.shuffle(words)
        rows.append({"review": " ".join(words), "label": "pos" if positive else "neg"})
    data = tmp_path / "reviews.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    options = {
        "dataset": str(data),
        "text_field": "review",
        "model_config": SHAPE,
        "tokenizer": "train:300",
        "seq_len": 16,
        "eval_fraction": 0.2,
    }
    result = wb.launch(
        cfg_for(
            tmp_path,
            "classify",
            task="hf-sequence-classification",
            task_options=options,
            num_processes=2,
            max_steps=25,
            eval_every=25,
        )
    )
    model = result.load_model()
    assert isinstance(model, transformers.LlamaForSequenceClassification)
    assert model.config.id2label == {0: "neg", 1: "pos"}
    evaluation = [r for r in result.metrics if "eval_accuracy" in r]
    assert evaluation and evaluation[-1]["eval_accuracy"] >= 0.9


def test_the_data_is_tokenized_once_by_whichever_process_comes_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Two processes build the same task's datasets on an empty cache at once: one tokenizes (and
    trains the tokenizer), the other waits on the lock (or comes after) and reads the cached files;
    this process, later, tokenizes nothing."""
    monkeypatch.setenv("WORKBENCH_DATA_DIR", str(tmp_path / "cache"))
    code = (
        "import logging, sys, workbench as wb\n"
        "logging.basicConfig(level=logging.INFO, format='%(message)s')\n"
        "from workbench.tasks.hf.causal_lm import CausalLMTask\n"
        f"opts = {OPTIONS!r}\n"
        "cfg = wb.RunConfig(task='hf-causal-lm', task_options=opts, runs_dir=sys.argv[1])\n"
        "train, _ = CausalLMTask().build_datasets(cfg)\n"
        "print('windows', len(train))\n"
    )
    env = {**os.environ, "WORKBENCH_DATA_DIR": str(tmp_path / "cache")}

    def start() -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )

    pair = [start(), start()]
    try:
        outs = [p.communicate(timeout=120)[0] for p in pair]
    finally:
        for p in pair:
            p.kill()
    assert all(p.returncode == 0 for p in pair), outs
    windows = {line for out in outs for line in out.splitlines() if line.startswith("windows")}
    assert len(windows) == 1
    lines = [line for out in outs for line in out.splitlines()]
    assert sum(line.startswith("tokenized ") for line in lines) == 2, outs  # train and eval
    assert sum(line.startswith("trained a 512-token BPE") for line in lines) == 1, outs
    # later, here: the cache answers
    with caplog.at_level(logging.INFO, logger="workbench"):
        train, _ = CausalLMTask().build_datasets(
            wb.RunConfig(task="hf-causal-lm", task_options=OPTIONS, runs_dir=str(tmp_path))
        )
    assert f"windows {len(train)}" in windows
    assert not [r for r in caplog.records if r.getMessage().startswith(("tokenized", "trained"))]


def test_a_process_waiting_on_the_tokenization_lock_gives_up_at_its_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import filelock

    from workbench.tasks.hf import text

    monkeypatch.setattr(text, "WAIT_S", 0.2)
    path = tmp_path / "key.lock"
    holder = filelock.FileLock(str(path))
    holder.acquire()
    try:
        with pytest.raises(TimeoutError, match=r"another process has been tokenizing .* delete"):
            with text.held_lock(path, "tokenizing train (key)"):
                pass  # pragma: no cover
    finally:
        holder.release()


# ---- refused before launch -------------------------------------------------------------------
def refused(tmp_path: Path, **options: Any) -> wb.RunConfig:
    return cfg_for(tmp_path, "refused", task_options={**OPTIONS, **options})


def test_a_hub_name_is_refused_with_the_way_to_download_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"looks like a Hugging Face Hub name.*--local-dir"):
        wb.launch(refused(tmp_path, model="meta-llama/Llama-3.2-1B"))
    with pytest.raises(ValueError, match=r"dataset='stanfordnlp/imdb' looks like a Hugging Face"):
        wb.launch(refused(tmp_path, dataset="stanfordnlp/imdb"))
    with pytest.raises(ValueError, match=r"neither a local folder nor an architecture.*'llama'"):
        wb.launch(refused(tmp_path, model="lama"))


def folder_with(tmp_path: Path, **files: str) -> Path:
    folder = tmp_path / "folder"
    transformers.LlamaConfig(**SHAPE, vocab_size=300).save_pretrained(folder)
    for name, content in files.items():
        (folder / name).write_text(content)
    return folder


def test_a_folder_with_its_own_code_is_refused_unless_trusted(tmp_path: Path) -> None:
    folder = folder_with(tmp_path, **{"model.safetensors": ""})
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"auto_map.*trust_remote_code=true"):
        wb.launch(refused(tmp_path, model=str(folder)))


def test_pickled_weights_are_refused_unless_allowed_then_read_weights_only(tmp_path: Path) -> None:
    folder = tmp_path / "pickled"
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**SHAPE, vocab_size=512)
    )
    model.config.save_pretrained(folder)
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pickled \(pytorch_model.bin\).*allow_pickle=true"):
        wb.launch(refused(tmp_path, model=str(folder)))
    from workbench.tasks.hf.causal_lm import CausalLMTask

    cfg = refused(tmp_path, model=str(folder), allow_pickle=True)
    task = CausalLMTask()
    task.check_options(cfg)
    loaded = task.build_model(cfg)
    assert torch.equal(
        loaded.state_dict()["lm_head.weight"], model.state_dict()["lm_head.weight"].float()
    )


@pytest.mark.parametrize(
    "options, match",
    [
        ({"lora": {"rank": 4}}, r"lora: unknown key\(s\) \['rank'\].*did you mean 'r'"),
        ({"lora": {"r": 0}}, r"lora.r=0: the adapters' rank, an integer >= 1"),
        ({"seq_len": 128}, r"seq_len=128 is more than the model's max_position_embeddings=64"),
        ({"tokenizer": "train:10"}, r"tokenizer='train:10'.*at least 300"),
        ({"text_field": "body"}, r"text_field='body'.*no such column; its columns: text"),
    ],
    ids=["lora-key", "lora-rank", "seq-len", "vocab", "text-field"],
)
def test_bad_options_are_refused_before_launch_naming_the_fix(
    tmp_path: Path, options: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        wb.launch(refused(tmp_path, **options))


def test_ranks_run_with_the_hub_off(runs: dict[str, wb.RunResult]) -> None:
    """The caller's environment had no HF_HUB_OFFLINE; every rank had the hub off, in the
    environment and in huggingface_hub's own flag."""
    assert [v["hub_off"] for v in runs["lora-zero3"].rank_values] == [("1", True)] * 2


def test_the_panel_names_the_model_and_counts_what_trains() -> None:
    """The panel's task controls for hf-causal-lm with LoRA: the model's class, all its parameters
    (built on the meta device) and the adapters' share that trains."""
    from workbench.notebook.panel.task_controls import TaskControls, count_text

    controls = TaskControls(CausalLMTask(), {**OPTIONS, "lora": LORA})
    built = CausalLMTask().build_model(
        wb.RunConfig(task="hf-causal-lm", task_options={**OPTIONS, "lora": LORA})
    )
    total = sum(p.numel() for p in built.parameters())
    adapters = sum(p.numel() for n, p in built.named_parameters() if ".lora_" in n)
    assert controls.parameters == total and controls.model_name == "LlamaForCausalLM + LoRA"
    shown = controls.count_box.value
    assert "LlamaForCausalLM + LoRA" in shown
    trained = count_text(adapters).replace(" parameters", "")
    assert f"({trained} trained)" in shown and adapters < total / 10, shown
