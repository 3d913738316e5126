"""Where a Hugging Face model comes from, and loading it safely.

`task_options.model` is a local folder (config.json and safetensors weights, from a
`save_pretrained` or a `hf download --local-dir`) or an architecture name transformers knows
('llama', 'qwen2', 'gpt2', ...), built with `from_config` at random init. Nothing is fetched: the
hub is off in every rank, so a hub name is refused before launch with the way to make it a folder. A
folder whose config asks for custom code (`auto_map`) is refused unless `trust_remote_code` is set,
and pickled weights (`pytorch_model.bin`) unless `allow_pickle` is (then transformers reads them
with `torch.load(weights_only=True)`).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from workbench.utils.suggest import did_you_mean

CONFIG_FILE = "config.json"
CODE_FILES = (CONFIG_FILE, "tokenizer_config.json")
"""The files whose `auto_map` names code of the folder's own."""


HUB_OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
"""The environment every rank gets (launcher): the hub off, whatever the caller's shell says."""


def offline() -> None:
    """The hub off for this process and every process it starts: the environment for libraries
    not imported yet, and huggingface_hub's own flag where it is (it reads the variable once, at
    import)."""
    os.environ.update(HUB_OFFLINE)
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        constants.HF_HUB_OFFLINE = True


def architectures() -> list[str]:
    """The architecture names transformers can build from a config ('llama', 'gpt2', ...)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return sorted(CONFIG_MAPPING_NAMES)


@dataclass(frozen=True)
class ModelSource:
    """A model folder or an architecture name, as `task_options.model` gives it."""

    value: str
    folder: Path | None = None
    """The local folder, when the model is one."""
    architecture: str | None = None
    """transformers' model_type, when the model is built from a config at random init."""

    @classmethod
    def of(cls, value: str) -> ModelSource:
        """What `value` names, or ValueError saying why it can't be used and what would work."""
        path = Path(value).expanduser()
        if path.is_dir():
            return cls(value, folder=path)
        if value in architectures():
            return cls(value, architecture=value)
        if path.exists():
            raise ValueError(
                f"task_options.model={value!r} is a file; give the folder that holds config.json "
                "and the weights (a save_pretrained folder)"
            )
        if "/" in value.strip("./") and not value.startswith(("/", ".", "~")):
            raise ValueError(
                f"task_options.model={value!r} looks like a Hugging Face Hub name; workbench "
                "downloads nothing at run time (the hub is offline in every rank). Download it "
                f"once, e.g. `hf download {value} --local-dir models/{value.split('/')[-1]}`, "
                f"and pass model='models/{value.split('/')[-1]}'"
            )
        raise ValueError(
            f"task_options.model={value!r} is neither a local folder nor an architecture "
            f"transformers knows{did_you_mean(value, architectures())}; give a folder with "
            "config.json and safetensors weights, or an architecture name such as 'llama', "
            "'qwen2' or 'gpt2' (random init, sized by model_config)"
        )

    def check(self, *, trust_remote_code: bool, allow_pickle: bool) -> None:
        """A folder holds a config and weights workbench may load: no custom code unless
        trusted, safetensors unless pickles are allowed. ValueError naming the file and the way
        out."""
        if self.folder is None:
            return
        if not (self.folder / CONFIG_FILE).is_file():
            raise ValueError(
                f"task_options.model={self.value!r}: no {CONFIG_FILE} in {self.folder}; give a "
                "folder written by save_pretrained (or `hf download --local-dir`)"
            )
        if not trust_remote_code:
            for name in CODE_FILES:
                code = _auto_map(self.folder / name)
                if code:
                    raise ValueError(
                        f"task_options.model={self.value!r}: {name} asks for the folder's own "
                        f"Python code (auto_map: {', '.join(sorted(code))}); workbench runs no "
                        "model code from a folder unless you trust it: read it, then set "
                        "task_options.trust_remote_code=true"
                    )
        if self.safetensors():
            return
        pickles = sorted(p.name for p in self.folder.glob("*.bin"))
        if pickles and not allow_pickle:
            raise ValueError(
                f"task_options.model={self.value!r}: the weights are pickled ({pickles[0]}), and "
                "unpickling runs code; convert them to safetensors (load and save_pretrained "
                "once where you trust the file), or set task_options.allow_pickle=true to read "
                "them with torch.load(weights_only=True)"
            )
        if not pickles:
            raise ValueError(
                f"task_options.model={self.value!r}: {self.folder} has {CONFIG_FILE} but no "
                "weights (*.safetensors); to train from random init, give the architecture "
                "name (e.g. model='llama') and its sizes in model_config"
            )

    def safetensors(self) -> bool:
        return self.folder is not None and any(self.folder.glob("*.safetensors"))

    def config(self, overrides: dict[str, Any], *, trust_remote_code: bool) -> Any:
        """The model's transformers config: the folder's, or the architecture's defaults, with
        `overrides` (task_options.model_config) on top."""
        from transformers import AutoConfig

        if self.folder is not None:
            return AutoConfig.from_pretrained(
                self.folder, local_files_only=True, trust_remote_code=trust_remote_code, **overrides
            )
        return AutoConfig.for_model(self.architecture, **overrides)

    def build(self, auto_class: Any, config: Any, *, trust_remote_code: bool) -> Any:
        """The model: from_pretrained on the folder's weights, or from_config at random init (the
        caller seeds it). On the meta device (the estimate, the checks before launch) no weights
        are read: the folder's model is built from its config alone."""
        on_meta = torch.empty(0).device.type == "meta"
        if self.folder is None or on_meta:
            return auto_class.from_config(
                config, trust_remote_code=trust_remote_code, attn_implementation="sdpa"
            )
        return auto_class.from_pretrained(
            self.folder,
            config=config,
            local_files_only=True,
            trust_remote_code=trust_remote_code,
            use_safetensors=self.safetensors(),
            # fp32 master weights whatever the folder stores: precision is the run's autocast
            dtype=torch.float32,
            attn_implementation="sdpa",
        )


def _auto_map(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    code = data.get("auto_map") if isinstance(data, dict) else None
    return code if isinstance(code, dict) else {}
