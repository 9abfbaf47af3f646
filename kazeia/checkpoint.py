"""Find a checkpoint (local directory or hub id) and load its safetensors strictly.

Scope: locating the released file layout, memory-mapped tensor loading, and assigning tensors to
modules built on the meta device, with one clear `CheckpointError` for any missing, unexpected,
mis-shaped or unreadable tensor. Non-goal: knowing what the tensors mean (the model files do).
"""

from __future__ import annotations

import json
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

# Weight precisions of the talker and code predictor; "int8" and "int4" are quantized at load
# (kazeia/quant.py, kazeia/int4.py). The precisions `Engine.load` takes by name; int8 and int4 are
# quantization schemes, not torch dtypes.
DTYPES: dict[str, torch.dtype | str] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": "int8",
    "int4": "int4",
}


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


def load_tensors(
    path: Path,
    dtype: torch.dtype | None = None,
    mmap: bool = True,
    wanted: Callable[[str], bool] | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file (those whose name `wanted` accepts, when given), floating
    ones in `dtype` (None: as stored).

    When nothing needs converting and `mmap` allows it, the file is memory-mapped (no copy at all).
    Otherwise tensors are read and converted one at a time, so the file's copy and the converted
    copy never coexist in memory (the library only offers a memory map, which keeps every page read
    resident until the last tensor is dropped: a bfloat16 file loaded as float32 would cost 1.5x the
    float32 size). Callers that replace most tensors anyway (fusing, quantizing) pass mmap=False.
    """
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    try:
        with safe_open(str(path), framework="pt") as f:  # validates the header
            stored = {f.get_slice(name).get_dtype() for name in f.keys()}
        if mmap and (dtype is None or stored <= {_SAFETENSORS_DTYPES[dtype], *_NOT_FLOATING}):
            mapped = load_file(str(path), device="cpu")
            return mapped if wanted is None else {name: t for name, t in mapped.items() if wanted(name)}
        return _read_converting(path, dtype, wanted)
    except FileNotFoundError:
        raise CheckpointError(f"missing file: {path}") from None
    except (SafetensorError, OSError, ValueError, RuntimeError, KeyError) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file (truncated or corrupt?): {e}") from None


_SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_TORCH_DTYPES = {v: k for k, v in _SAFETENSORS_DTYPES.items()}
_NOT_FLOATING = {"I64", "I32", "I16", "I8", "U8", "BOOL"}


def _read_converting(
    path: Path, dtype: torch.dtype | None, wanted: Callable[[str], bool] | None = None
) -> dict[str, torch.Tensor]:
    """Read the file sequentially (8-byte header length, JSON header, raw little-endian data),
    skipping the tensors `wanted` rejects."""
    out = {}
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
        header.pop("__metadata__", None)
        for name, info in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
            if wanted is not None and not wanted(name):
                continue
            begin, end = info["data_offsets"]
            buffer = bytearray(end - begin)
            f.seek(8 + header_len + begin)
            if f.readinto(buffer) != len(buffer):
                raise ValueError(f"tensor {name} is cut short")
            source = _TORCH_DTYPES[info["dtype"]]
            tensor = torch.frombuffer(buffer, dtype=source) if buffer else torch.empty(0, dtype=source)
            tensor = tensor.reshape(info["shape"])
            out[name] = tensor.to(dtype) if tensor.is_floating_point() and dtype is not None else tensor
    return out


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

    Floating tensors are converted to `dtype` (`None` keeps each tensor's own); a missing,
    unexpected or mis-shaped tensor raises a `CheckpointError` naming it (as `released_name`
    spells it) and `where` (the file). Derived buffers are then rebuilt.
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
        if t.is_floating_point():
            target = t.dtype if dtype is None else dtype  # None: keep the file's precision (no copy)
        else:
            target = ref.dtype if (dtype is None or not ref.is_floating_point()) else dtype
        converted[name] = t.to(device=device, dtype=target)
    module.load_state_dict(converted, strict=True, assign=True)
    module.requires_grad_(False)  # inference only: no autograd graph may ever hold activations
    for sub in module.modules():
        init = getattr(sub, "init_buffers", None)
        if init is not None:
            init(device)


def _more(names: list[str]) -> str:
    return f" (and {len(names) - 1} more)" if len(names) > 1 else ""
