"""Find a checkpoint (local directory or hub id) and load its safetensors strictly.

Scope: locating the released file layout, memory-mapped tensor loading, and assigning tensors to
modules built on the meta device, with one clear `CheckpointError` for any missing, unexpected,
mis-shaped or unreadable tensor. Non-goal: knowing what the tensors mean (the model files do).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .config import CheckpointError

# Files of the released layout that the engine reads (relative to the checkpoint root).
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "vocab.json",
    "merges.txt",
    "tokenizer_config.json",
    "speech_tokenizer/config.json",
    "speech_tokenizer/model.safetensors",
)

# Weight precisions of the talker and code predictor; "int8" is quantized at load (kazeia/quant.py).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": "int8"}


@dataclass(frozen=True)
class CheckpointFiles:
    """Paths of one checkpoint in the released layout."""

    root: Path
    from_hub: bool  # fetched by hub id (affects the reference tokenizer quirk, see text.py)

    def __getitem__(self, name: str) -> Path:
        return self.root / name


def resolve(path_or_id: str | os.PathLike, *, offline: bool | None = None) -> CheckpointFiles:
    """Return the checkpoint files for a local directory or a hub id such as `Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice`.

    A hub id is fetched with huggingface_hub (progress bar, shared cache); with `offline=True` (or
    HF_HUB_OFFLINE=1) only the cache is used. Every required file must be present.
    """
    path = Path(path_or_id).expanduser()
    if path.is_dir():
        files = CheckpointFiles(path.resolve(), from_hub=False)
    elif path.exists():
        raise CheckpointError(f"{path} is a file; expected a checkpoint directory or a hub id")
    elif _looks_like_hub_id(str(path_or_id)):
        files = CheckpointFiles(_download(str(path_or_id), offline), from_hub=True)
    else:
        raise CheckpointError(
            f"no checkpoint directory at {path} (and it is not a hub id like 'Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice')"
        )
    for name in REQUIRED_FILES:
        if not files[name].is_file():
            raise CheckpointError(f"checkpoint {files.root} is incomplete: missing file {name}")
    return files


def _looks_like_hub_id(text: str) -> bool:
    parts = text.split("/")
    return len(parts) == 2 and all(parts) and not text.startswith((".", "/", "~"))


def _download(repo_id: str, offline: bool | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    patterns = ["*.json", "*.safetensors", "merges.txt", "speech_tokenizer/*"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=bool(offline)))
    except LocalEntryNotFoundError as e:
        raise CheckpointError(f"{repo_id}: not in the local cache and the hub cannot be reached ({e})") from None
    except HfHubHTTPError as e:
        raise CheckpointError(f"{repo_id}: download failed ({e})") from None


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Memory-map every tensor of a safetensors file (no copy until a dtype/device change)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device="cpu")
    except FileNotFoundError:
        raise CheckpointError(f"missing file: {path}") from None
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file (truncated or corrupt?): {e}") from None


def assign(
    module: nn.Module,
    tensors: Mapping[str, torch.Tensor],
    where: str,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    released_name: Callable[[str], str] = str,
) -> None:
    """Load `tensors` (module names) into a module built on the meta device; strict.

    Floating tensors are converted to `dtype` (if given); a missing, unexpected or mis-shaped tensor
    raises a `CheckpointError` naming it (as `released_name` spells it) and `where` (the file).
    Derived buffers are then rebuilt.
    """
    expected = module.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing:
        raise CheckpointError(f"{where}: missing tensor {released_name(missing[0])}" + _more(missing))
    if unexpected:
        raise CheckpointError(f"{where}: unexpected tensor {released_name(unexpected[0])}" + _more(unexpected))
    converted = {}
    for name, ref in expected.items():
        t = tensors[name]
        if tuple(t.shape) != tuple(ref.shape):
            raise CheckpointError(
                f"{where}: tensor {released_name(name)} has shape {tuple(t.shape)}, expected {tuple(ref.shape)}"
            )
        target = dtype if (dtype is not None and t.is_floating_point()) else ref.dtype
        if not t.is_floating_point() and ref.is_floating_point():
            target = ref.dtype if dtype is None else dtype
        converted[name] = t.to(device=device, dtype=target)
    module.load_state_dict(converted, strict=True, assign=True)
    for sub in module.modules():
        init = getattr(sub, "init_buffers", None)
        if init is not None:
            init(device)


def _more(names: list[str]) -> str:
    return f" (and {len(names) - 1} more)" if len(names) > 1 else ""
