"""Writing a checkpoint prepared for one precision: `kazeia quantize SRC DST --dtype ...`.

The format, and what a prepared checkpoint holds for each precision, is kazeia/prepared.py's; this
module loads the released checkpoint in that precision (kazeia/model.py) and writes what loading
made, so a prepared checkpoint speaks exactly like its source loaded in the same precision.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from torch import nn

from .checkpoint import DTYPES, load_tensors, resolve
from .config import ModelConfig
from .model import SKIPPED_PREFIXES, TTSModel, rename
from .prepared import FORMAT, QUANTIZED, VERSION, WEIGHTS, prepared_dtype


def quantize(source: str | os.PathLike, target: str | os.PathLike, dtype: str, *, offline: bool | None = None) -> Path:
    """Write the checkpoint `source` (a directory or hub id) prepared for `dtype` into the new
    directory `target`; returns it. Every other file is copied unchanged."""
    from safetensors.torch import save_file

    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of: {', '.join(DTYPES)}")
    target = Path(target)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ValueError(f"{target} exists and is not an empty directory; choose a new one")
    files = resolve(source, offline=offline)
    weights = files[WEIGHTS]
    if (already := prepared_dtype(weights)) is not None:
        raise ValueError(f"{weights} is already prepared (for {already}); prepare the released checkpoint instead")
    cfg = ModelConfig.from_file(files["config.json"])

    def kept(name: str) -> bool:  # the speaker encoder's tensors (Base), as released
        return name.startswith(SKIPPED_PREFIXES)

    if dtype in QUANTIZED:  # the model loads the file itself; only the kept tensors are read here
        tensors = {**stored_tensors(TTSModel.load(cfg, weights, "cpu", dtype)), **load_tensors(weights, wanted=kept)}
    else:
        released = load_tensors(weights, mmap=False)
        rename(released, str(weights), skip_speaker_encoder=cfg.tts_model_type == "base")  # checks every name
        floats = DTYPES[dtype]
        tensors = {n: t if kept(n) or not t.is_floating_point() else t.to(floats) for n, t in released.items()}
        del released
    root = os.path.realpath(files.root)

    def weights_file(directory: str, names: list[str]) -> list[str]:  # only the top-level one
        return [WEIGHTS] if os.path.realpath(directory) == root and WEIGHTS in names else []

    shutil.copytree(files.root, target, ignore=weights_file, dirs_exist_ok=True)
    tensors = {name: t.contiguous() for name, t in tensors.items()}
    save_file(tensors, str(target / WEIGHTS), metadata={"format": FORMAT, "version": VERSION, "dtype": dtype})
    return target


def stored_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """A model loaded with dtype="int8" or "int4" -> the tensors of its prepared file (module names)."""
    from .int4 import Int4Linear
    from .quant import QuantLinear

    out: dict[str, torch.Tensor] = {}
    products = (QuantLinear, Int4Linear)
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            out[f"{name}.qweight"], out[f"{name}.scales"] = module.stored
        elif isinstance(module, Int4Linear):
            out.update({f"{name}.{key}": t for key, t in module.stored.items()})
        if isinstance(module, products) and module.bias is not None:
            out[f"{name}.bias"] = module.bias
    for name, tensor in model.state_dict().items():  # QuantEmbedding tables included, as they are
        if not isinstance(model.get_submodule(name.rpartition(".")[0]), products):
            out[name] = tensor
    return out
