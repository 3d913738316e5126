"""RunConfig: validation messages, YAML round trip, overrides, hardware checks, derived values."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from collected_ids import cases

import workbench as wb
from workbench.config.preflight import preflight
from workbench.tasks.schedule import lr_at
from workbench.utils.hardware import GPU, Hardware, resolve_device

CPU2 = Hardware(cpu_count=2)
V100x2 = Hardware(
    cpu_count=16,
    gpus=(GPU(name="Tesla V100", compute_capability=(7, 0), memory_bytes=16 << 30),) * 2,
)
H100x1 = Hardware(
    cpu_count=16,
    gpus=(GPU(name="NVIDIA H100 80GB HBM3", compute_capability=(9, 0), memory_bytes=80 << 30),),
)

# (fields, message pattern): each bad config must be refused on construction with its own message.
BAD_FIELDS = [
    ({"num_processes": 0}, r"num_processes=0: must be at least 1"),
    ({"num_processes": -2}, r"num_processes=-2: must be at least 1"),
    ({"num_processes": 2.5}, r"num_processes=2.5: expected int, got float"),
    ({"num_processes": True}, r"num_processes=True: expected int, got bool"),
    ({"micro_batch_size": 0}, r"micro_batch_size=0: must be at least 1"),
    ({"grad_accum_steps": 0}, r"grad_accum_steps=0: must be at least 1"),
    ({"max_steps": -1}, r"max_steps=-1: must be at least 1"),
    ({"log_every": 0}, r"log_every=0: must be at least 1"),
    ({"lr": 0.0}, r"lr=0.0: must be a positive learning rate"),
    ({"lr": -1e-3}, r"lr=-0.001: must be a positive learning rate"),
    ({"lr": "fast"}, r"lr='fast': expected float, got str"),
    ({"weight_decay": -0.1}, r"weight_decay=-0.1: must be 0 or more"),
    ({"grad_clip": -1.0}, r"grad_clip=-1.0: must be positive, or 0 to disable"),
    ({"min_lr_ratio": 1.5}, r"min_lr_ratio=1.5: must be between 0 and 1"),
    (
        {"warmup_steps": 200, "max_steps": 100},
        r"warmup_steps=200: longer than max_steps=100; use at most 100",
    ),
    ({"warmup_steps": -5}, r"warmup_steps=-5: must be 0 or more"),
    ({"eval_every": -1}, r"eval_every=-1: must be 0 or more"),
    ({"checkpoint_every": -10}, r"checkpoint_every=-10: must be 0 or more"),
    ({"seed": -1}, r"seed=-1: must be 0 or more"),
    ({"precision": "fp64"}, r"precision='fp64': choose one of 'fp32' \| 'bf16' \| 'fp16' \| 'fp8'"),
    ({"parallelism": "zero4"}, r"parallelism='zero4': choose one of 'none' \| 'ddp' \| 'zero1'"),
    ({"device": "tpu"}, r"device='tpu': choose one of 'auto' \| 'cpu' \| 'cuda'"),
    (
        {"parallelism": "none", "num_processes": 2},
        r"parallelism='none' with num_processes=2: .*set parallelism='ddp'",
    ),
    ({"run_name": "../escape"}, r"run_name='../escape': use letters, digits"),
    ({"resume": True}, r"resume=True needs run_name"),
    ({"task": ""}, r"task='': name a task"),
    ({"task_options": [1, 2]}, r"task_options=\[1, 2\]: expected dict, got list"),
    ({"keep_checkpoints": 0}, r"keep_checkpoints=0: must be at least 1"),
]


@pytest.mark.parametrize("fields,message", BAD_FIELDS, ids=[str(f) for f, _ in BAD_FIELDS])
def test_bad_field_is_rejected_with_field_value_and_fix(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        wb.RunConfig(**fields)


BAD_FOR_MACHINE = [
    (
        CPU2,
        {"num_processes": 3},
        r"num_processes=3: this machine has 2 CPU core\(s\); use num_processes=2 or fewer",
    ),
    (CPU2, {"device": "cuda"}, r"device='cuda': no CUDA GPU is visible"),
    (
        CPU2,
        {"precision": "fp16"},
        r"precision='fp16' on CPU \(2 cores\): fp16 needs a CUDA GPU.*use (bf16|fp32)",
    ),
    (
        CPU2,
        {"precision": "fp8"},
        r"precision='fp8' on CPU \(2 cores\): fp8 needs a CUDA GPU of compute capability 8.9",
    ),
    (
        V100x2,
        {"num_processes": 4},
        r"num_processes=4: this machine has 2 GPU\(s\); use num_processes=2 or fewer",
    ),
    (
        V100x2,
        {"precision": "bf16"},
        r"precision='bf16' on 2 x Tesla V100: bf16 needs compute capability 8.0\+",
    ),
    (CPU2, {"task": "digitz"}, r"task='digitz': unknown task \(did you mean 'digits'\?\)"),
    (CPU2, {"task": "nosuchmodule:Task"}, r"task='nosuchmodule:Task': cannot import it"),
    (
        CPU2,
        {"task_options": {"hiddn": 3}},
        r"task_options: unknown key\(s\) \['hiddn'\] for task 'digits'; known:",
    ),
    (
        CPU2,
        {"task": "char-gpt", "task_options": {"n_embd": 100, "n_head": 3}},
        r"task_options.n_embd=100 is not divisible by n_head=3",
    ),
    (
        CPU2,
        {"task": "char-gpt", "task_options": {"preset": "huge"}},
        r"task_options.preset='huge': choose one of",
    ),
    (
        CPU2,
        {"activation_checkpointing": "full"},
        r"activation_checkpointing='full': the model has no repeated blocks to checkpoint .*Task.shard_units",
    ),
    (
        CPU2,
        {"parallelism": "zero3", "cpu_offload": True},
        r"cpu_offload=True on CPU: .*set cpu_offload=False",
    ),
]


@pytest.mark.parametrize(
    "hw,fields,message", BAD_FOR_MACHINE, ids=[str(f) for _, f, _ in BAD_FOR_MACHINE]
)
def test_config_impossible_on_this_machine_is_rejected(
    hw: Hardware, fields: dict, message: str
) -> None:
    cfg = wb.RunConfig(**fields)
    with pytest.raises(ValueError, match=message):
        preflight(cfg, hardware=hw)


@pytest.mark.parametrize(
    "hw,fields,device",
    [
        (CPU2, {"num_processes": 2, "precision": "bf16"}, "cpu"),
        (V100x2, {"num_processes": 2, "precision": "fp16", "device": "cuda"}, "cuda"),
        (H100x1, {"precision": "bf16"}, "cuda"),
    ],
    ids=["cpu x2 bf16", "v100 x2 fp16", "h100 bf16"],
)
def test_good_configs_pass_the_machine_check(hw: Hardware, fields: dict, device: str) -> None:
    cfg = wb.RunConfig(**fields)
    assert preflight(cfg, hardware=hw) is None  # raises ValueError when the machine can't run it
    assert resolve_device(cfg, hw) == device


def test_global_batch_is_micro_times_accum_times_world() -> None:
    cfg = wb.RunConfig(num_processes=4, micro_batch_size=8, grad_accum_steps=3)
    assert cfg.global_batch_size == 96
    assert cfg.replace(num_processes=1).global_batch_size == 24


def test_yaml_round_trip_keeps_every_field(tmp_path: Path) -> None:
    cfg = wb.RunConfig(
        task="char-gpt",
        num_processes=2,
        precision="bf16",
        micro_batch_size=4,
        grad_accum_steps=2,
        max_steps=7,
        lr=3e-4,
        grad_clip=0.0,
        run_name="x1",
        task_options={"n_layer": 3},
    )
    path = tmp_path / "run.yaml"
    cfg.to_yaml(path)
    assert wb.RunConfig.from_yaml(path) == cfg
    assert not list(tmp_path.glob(".*tmp")), "atomic write left a temp file"


def test_yaml_unknown_keys_are_listed_with_suggestions(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("task: digits\nmax_step: 10\nlearning_rate: 0.1\n")
    with pytest.raises(
        ValueError,
        match=r"bad.yaml: RunConfig has no fields 'max_step' \(did you mean "
        r"'max_steps'\?\), 'learning_rate' \(did you mean 'lr'\?\)$",
    ):
        wb.RunConfig.from_yaml(path)


def test_yaml_with_a_bad_value_names_the_field(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("micro_batch_size: 0\n")
    with pytest.raises(ValueError, match="micro_batch_size=0: must be at least 1"):
        wb.RunConfig.from_yaml(path)


def test_replace_validates_and_rejects_unknown_fields() -> None:
    cfg = wb.RunConfig()
    assert cfg.replace(max_steps=10).max_steps == 10
    with pytest.raises(ValueError, match="max_steps=0: must be at least 1"):
        cfg.replace(max_steps=0)
    with pytest.raises(
        ValueError,
        match=r"^RunConfig.replace\(\): RunConfig has no field 'steps'; did you mean 'max_steps'",
    ):
        cfg.replace(steps=10)


def test_set_overrides_parse_types_and_nest_task_options() -> None:
    cfg = wb.RunConfig().with_overrides(
        [
            "max_steps=20",
            "lr=3e-4",
            "precision=bf16",
            "run_name=abc",
            "task_options.hidden=16",
            "resume=false",
        ]
    )
    assert (cfg.max_steps, cfg.lr, cfg.precision, cfg.run_name) == (20, 3e-4, "bf16", "abc")
    assert cfg.task_options == {"hidden": 16}
    with pytest.raises(ValueError, match=r"--set 'max_steps': expected key=value"):
        wb.RunConfig().with_overrides(["max_steps"])
    with pytest.raises(
        ValueError, match=r"^--set: RunConfig has no field 'epochs'; did you mean 'max_steps'\?$"
    ):
        wb.RunConfig().with_overrides(["epochs=3"])
    with pytest.raises(
        ValueError, match=r"^--set: RunConfig has no field 'colour'; its fields: task, num_proc"
    ):
        wb.RunConfig().with_overrides(["colour=red"])
    with pytest.raises(ValueError, match=r"max_steps='ten': expected int, got str"):
        wb.RunConfig().with_overrides(["max_steps=ten"])


def test_off_written_unquoted_is_the_choice_not_a_boolean(tmp_path: Path) -> None:
    # YAML 1.1 reads `off` as False: `--set compile=off` was refused with "compile=False: choose one of 'off' | ..."
    assert wb.RunConfig().with_overrides(["compile=off"]).compile == "off"
    (tmp_path / "run.yaml").write_text("task: digits\ncompile: off\n")
    assert wb.RunConfig.from_yaml(tmp_path / "run.yaml").compile == "off"
    # a boolean field keeps its boolean
    assert wb.RunConfig().with_overrides(["resume=off"]).resume is False
    with pytest.raises(
        ValueError, match=r"compile=True: choose one of 'off' \| 'model' \| 'blocks'"
    ):
        # a choice without 'on' still names what would work
        wb.RunConfig().with_overrides(["compile=yes"])


def test_lr_schedule_warms_up_linearly_then_decays_to_min_on_last_step() -> None:
    cfg = wb.RunConfig(lr=1.0, warmup_steps=4, max_steps=14, min_lr_ratio=0.1)
    assert [lr_at(s, cfg) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, cfg) == pytest.approx(1.0)
    assert lr_at(13, cfg) == pytest.approx(0.1)
    decay = [lr_at(s, cfg) for s in range(4, 14)]
    assert all(a > b for a, b in itertools.pairwise(decay))


def test_user_task_must_be_a_task_instance() -> None:
    with pytest.raises(TypeError, match="pass an instance of a workbench.Task subclass"):
        wb.launch(wb.RunConfig(), task=object())  # type: ignore[arg-type]


def test_register_task_needs_a_name() -> None:
    class Nameless(wb.Task):
        pass

    with pytest.raises(ValueError, match="needs a class attribute `name`"):
        wb.register_task(Nameless)


@pytest.mark.parametrize(
    "name,model",
    [
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA GeForce RTX 4090", "RTX4090"),
        ("Tesla V100-SXM2-16GB", "V100"),
    ],
)
def test_baseline_device_class_names_the_gpu_model_not_its_memory_or_brand(
    name: str, model: str
) -> None:
    hw = Hardware(cpu_count=8, gpus=(GPU(name=name, compute_capability=(8, 0), memory_bytes=1),))
    assert hw.device_class == f"cuda-{model}"
    assert CPU2.device_class == "cpu"


def test_builtin_tasks_are_all_known_whatever_was_imported_first() -> None:
    import subprocess
    import sys

    code = (
        "from workbench.tasks.digits import DigitsTask; from workbench.tasks import available; "
        "print(available())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert "char-gpt" in out and "digits" in out


def test_every_parallelism_mode_has_its_one_line_explanation() -> None:
    from typing import get_args

    from workbench.config import PARALLELISM_MODES, Parallelism

    assert list(PARALLELISM_MODES) == list(get_args(Parallelism))


@pytest.mark.parametrize(
    "fields,message",
    cases(
        [
            ({"lr": float("nan")}, r"lr=nan: must be a finite number"),
            (
                {"restart_backoff_s": float("inf")},
                r"restart_backoff_s=inf: must be a finite number",
            ),
            ({"seed": 2**32}, r"seed=4294967296: must be between 0 and 2\*\*32-1"),
            ({"seed": -1}, r"seed=-1: must be 0 or more"),
            ({"num_workers": 10_000}, r"num_workers=10000: .*use at most 64"),
            ({"run_name": "run\n"}, r"run_name='run\\n': use letters"),
            ({"resume": "yes", "run_name": "a"}, r"resume='yes': choose one of bool \| 'auto'"),
            ({"resume": "auto"}, r"resume='auto' needs run_name"),
            ({"preempt_signal": "SIGKILL"}, r"preempt_signal='SIGKILL': choose one of SIGUSR1"),
            (
                {"resume_allow": ["seeed"]},
                r"resume_allow: unknown field\(s\) 'seeed' \(did you mean 'seed'\?\)",
            ),
            ({"preempt_grace_s": 0.5}, r"preempt_grace_s=0.5: use 1 to 3600 seconds"),
            ({"lr": float("inf")}, r"lr=inf: must be a finite number; use a value like 0\.001"),
            (
                {"idle_after_s": 10**400},
                r"idle_after_s=\(a 401-digit integer\): must be a finite number \(it overflows",
            ),
            (
                {"max_steps": 10**41},
                r"max_steps=10{41}: too large; .* within \+-\(2\*\*31-1\) \(2,147,483,647\),.*=100",
            ),
            (
                {"eval_every": 2**31},
                r"eval_every=2147483648: too large; integer settings lie within \+-\(2\*\*31-1\)",
            ),
            (
                {"warmup_steps": -(10**5000)},
                r"warmup_steps=-\(a 5001-digit integer\): too small; .* e.g. warmup_steps=0",
            ),
            ({"checkpoint_every": 2**63}, r"checkpoint_every=9223372036854775808: too large"),
            (
                {"micro_batch_size": 2**40},
                r"micro_batch_size=1099511627776: too large; .* e.g. micro_batch_size=32",
            ),
            ({"num_processes": 10**12}, r"num_processes=1000000000000: too large"),
            # past int->str's limit
            ({"dist_timeout_s": 10**5000}, r"dist_timeout_s=\(a 5001-digit integer\): too large"),
            (
                {"restart_backoff_s": 1e12},
                r"restart_backoff_s=1000000000000\.0: wait at most 86400 seconds \(a day\)",
            ),
            (
                {"run_name": "a" * 300},
                r"run_name='a{40}'\.\.\. is 300 bytes long: .* most 255 bytes, .*use a shorter run_name",
            ),
            (
                {"runs_dir": "runs/" + "b" * 256},
                r"runs_dir='runs/b+'\.\.\.: its directory name 'b{40}'\.\.\. is 256 bytes",
            ),
        ]
    ),
)
def test_hostile_values_are_refused(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        wb.RunConfig(**fields)


def test_a_yaml_alias_bomb_is_refused_before_it_expands(tmp_path: Path) -> None:
    lines = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    lines += [
        f"{chr(98 + i)}: &{chr(98 + i)} [" + ", ".join([f"*{chr(97 + i)}"] * 10) + "]"
        for i in range(9)
    ]
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\n")  # 10**10 nodes once expanded
    with pytest.raises(
        ValueError,
        match=r"bomb.yaml: not valid YAML .*expands \(through aliases\) to more than 100,000",
    ):
        wb.RunConfig.from_yaml(path)


def test_home_in_paths_is_expanded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = wb.RunConfig(runs_dir="~/runs", run_name="r")
    assert cfg.runs_dir_path == tmp_path / "runs" and cfg.run_dir == tmp_path / "runs" / "r"
    cfg.to_yaml(tmp_path / "run.yaml")
    assert wb.RunConfig.from_yaml("~/run.yaml") == cfg


def test_the_moved_config_methods_say_where_they_went() -> None:
    cfg = wb.RunConfig(task="digits", device="auto")
    with pytest.raises(AttributeError, match=r"preflight\(cfg, task=task"):
        cfg.check()
    cuda = Hardware(
        cpu_count=2, gpus=(GPU(name="H100", compute_capability=(9, 0), memory_bytes=80 * 2**30),)
    )
    with pytest.warns(DeprecationWarning, match="resolve_device"):
        assert cfg.resolved_device(cuda) == "cuda"


def test_the_largest_values_allowed_still_make_a_config() -> None:
    cfg = wb.RunConfig(
        run_name="r" * 255,
        max_steps=2**31 - 1,
        eval_every=2**31 - 1,
        seed=2**32 - 1,
        restart_backoff_s=86_400.0,
    )
    assert len(cfg.run_name or "") == 255 and cfg.max_steps == 2**31 - 1


@pytest.mark.parametrize(
    "text,message",
    cases(
        [
            (
                "lr: 1e400\n",
                r"lr=1e400: must be a finite number \(it overflows a float, .*1\.8e308\); use a value like 0\.001",
            ),
            ("lr: -1e999\n", r"lr=-1e999: must be a finite number \(it overflows a float"),
            ("lr: nan\n", r"lr=nan: must be a finite number; use a value like 0\.001"),
            ("lr: inf\n", r"lr=inf: must be a finite number; use a value like 0\.001"),
            ("lr: .inf\n", r"lr=inf: must be a finite number; use a value like 0\.001"),
            ("beta2: -.inf\n", r"beta2=-inf: must be a finite number; use a value like 0\.999"),
            ("eps: .NaN\n", r"eps=nan: must be a finite number; use a value like 1e-08"),
        ]
    ),
)
def test_yaml_numbers_that_are_not_finite_are_named_as_written(
    tmp_path: Path, text: str, message: str
) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        wb.RunConfig.from_yaml(path)
    key, _, value = text.strip().partition(": ")
    with pytest.raises(ValueError, match=message):
        wb.RunConfig().with_overrides([f"{key}={value}"])


def test_yaml_floats_without_a_dot_are_numbers(tmp_path: Path) -> None:
    # YAML 1.1 (PyYAML) reads 1e-3 and 3E-4 as strings; in a float field they mean numbers.
    path = tmp_path / "run.yaml"
    path.write_text("lr: 3E-4\neps: 1e-6\nweight_decay: 1e-1\nrun_name: 1e5\n")
    cfg = wb.RunConfig.from_yaml(path)
    # a str field stays text
    assert (cfg.lr, cfg.eps, cfg.weight_decay, cfg.run_name) == (3e-4, 1e-6, 0.1, "1e5")


@pytest.mark.parametrize(
    "text,message",
    cases(
        [
            (
                "task: digits\nlr: 0.001\nmax_steps: 10\nlr: 0.01\n",
                r"dup.yaml: not valid YAML \(line 4, column 1\): duplicate key 'lr' \(first on line 2\); .* write each key once",
            ),
            (
                "task_options:\n  n_layer: 2\n  n_layer: 4\n",
                r"\(line 3, column 3\): duplicate key 'n_layer' \(first on line 2",
            ),
            ("trackers: [{a: 1, a: 2}]\n", r"line 1, column 19\): duplicate key 'a'"),
        ]
    ),
)
def test_a_duplicate_yaml_key_is_refused_with_its_line(
    tmp_path: Path, text: str, message: str
) -> None:
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        wb.RunConfig.from_yaml(path)


def test_yaml_merge_keys_may_still_be_overridden() -> None:
    from workbench.utils.files import load_yaml

    text = "base: &base {lr: 0.001, seed: 1}\nrun: {<<: *base, seed: 2}\n"
    assert load_yaml(text, "merge")["run"] == {"lr": 0.001, "seed": 2}


@pytest.mark.parametrize(
    "runs_dir,message",
    cases(
        [
            (
                "file",
                r"runs_dir='.*file': .*file is a file, not a directory; point runs_dir at a directory",
            ),
            (
                "file/runs",
                r"runs_dir='.*file/runs': .*file, on its path, is a file, not a directory",
            ),
            (
                "dangling",
                r"runs_dir='.*dangling': .*dangling is a broken symbolic link, not a directory",
            ),
        ]
    ),
)
def test_runs_dir_that_is_no_directory_is_refused_before_anything_runs(
    tmp_path: Path, runs_dir: str, message: str
) -> None:
    (tmp_path / "file").write_text("not a directory")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    cfg = wb.RunConfig(task="digits", device="cpu", runs_dir=str(tmp_path / runs_dir), run_name="r")
    with pytest.raises(ValueError, match=message):
        preflight(cfg, hardware=CPU2)
    assert preflight(cfg.replace(runs_dir=str(tmp_path / "new" / "runs")), hardware=CPU2) is None
