"""LoRA through peft: `task_options.lora = {r, alpha, dropout, target_modules}` wraps the model in
peft's adapters, so that only they train (the base is frozen: no gradients, no optimizer state)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from workbench.utils.suggest import did_you_mean

DEFAULTS: dict[str, Any] = {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": None}
"""LoRA's settings when the dict leaves them out; target_modules None: peft's choice for the
architecture (q_proj and v_proj for Llama-shaped models)."""


def lora_settings(value: Any) -> dict[str, Any] | None:
    """`task_options.lora` checked and completed with DEFAULTS; None for no LoRA. ValueError naming
    the key, the value and what would work."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(
            f"task_options.lora={value!r}: a dict such as {{'r': 8, 'alpha': 16}}, or None (null "
            "in YAML) to train every weight"
        )
    unknown = sorted(set(value) - set(DEFAULTS))
    if unknown:
        hints = "".join(did_you_mean(k, DEFAULTS) for k in unknown)
        raise ValueError(
            f"task_options.lora: unknown key(s) {unknown}; known: {', '.join(DEFAULTS)}{hints}"
        )
    out = {**DEFAULTS, **value}
    r, alpha, dropout, targets = out["r"], out["alpha"], out["dropout"], out["target_modules"]
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"task_options.lora.r={r!r}: the adapters' rank, an integer >= 1")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise ValueError(f"task_options.lora.alpha={alpha!r}: a number > 0 (the scale is alpha/r)")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ValueError(f"task_options.lora.dropout={dropout!r}: a number from 0 to below 1")
    if targets is not None and (
        isinstance(targets, str)
        or not isinstance(targets, (list, tuple))
        or not targets
        or not all(isinstance(t, str) for t in targets)
    ):
        raise ValueError(
            f"task_options.lora.target_modules={targets!r}: a list of module names such as "
            "['q_proj', 'v_proj'], or None for peft's choice for the architecture"
        )
    return out


def with_lora(model: Any, settings: dict[str, Any], task_type: str) -> Any:
    """`model` inside peft's adapters: a PeftModel whose base weights are frozen."""
    from peft import LoraConfig, get_peft_model

    targets = settings["target_modules"]
    config = LoraConfig(
        r=settings["r"],
        lora_alpha=settings["alpha"],
        lora_dropout=float(settings["dropout"]),
        target_modules=list(targets) if targets else None,
        task_type=task_type,
    )
    try:
        with warnings.catch_warnings():
            # peft asks transformers a question under its old name: not the user's to fix
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing`", FutureWarning)
            return get_peft_model(model, config)
    except ValueError as e:
        names = sorted({n.rsplit(".", 1)[-1] for n, _ in model.named_modules() if n})
        raise ValueError(
            f"task_options.lora.target_modules={targets!r}: {str(e).splitlines()[0]}; the "
            f"model's module names include {', '.join(names[:12])}"
        ) from e


def save_adapter(model: Any, folder: Path) -> None:
    """The adapter's folder (PeftModel.save_pretrained), naming its base by absolute path: the
    model folder it was trained on, or, for a base that exists nowhere else (an architecture at
    random init), the base written into folder/base."""
    named = getattr(model.peft_config["default"], "base_model_name_or_path", None) or ""
    model.save_pretrained(folder)
    if named and Path(named).is_dir():
        base = Path(named)
    else:
        base = folder / "base"
        # the adapter is written: take the layers out again (unload, not merge) for the plain base
        model.unload().save_pretrained(base)
    config = folder / "adapter_config.json"
    data = json.loads(config.read_text(encoding="utf-8"))
    data["base_model_name_or_path"] = str(base.resolve())
    config.write_text(json.dumps(data, indent=2), encoding="utf-8")


def merged(model: Any) -> Any:
    """The plain transformers model with the adapters folded into its weights."""
    return model.merge_and_unload()


def is_peft(model: Any) -> bool:
    return callable(getattr(model, "merge_and_unload", None)) and hasattr(model, "peft_config")
