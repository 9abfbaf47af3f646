"""Checkpoints prepared for one precision: `kazeia quantize SRC DST --dtype int8|bfloat16|...`.

A released checkpoint stores bfloat16 weights; loading it as int8 quantizes every product's
weight (seconds at the real sizes), as float32 or float16 converts every tensor. A prepared
checkpoint is the same directory with `model.safetensors` rewritten so that loading converts
nothing:

* float32 / bfloat16 / float16: the released tensors, names unchanged, floating ones in that
  precision;
* int8: the talker's and code predictor's tensors under Kazeia's module names, after the q/k/v and
  gate/up projections are fused: for each product `NAME.qweight` (int8, the int8 GEMM's own
  rounding, see `quant.quantize_weight`) and `NAME.scales` (float32, one per output row), the text
  embedding likewise, everything else float32. Speaker-encoder tensors (Base) keep their released
  names and precision.
* int4: the same names and fusion; each product stores `NAME.qweight` (packed codes), `NAME.steps`,
  `NAME.offsets` and `NAME.factors` (`int4.quantize_weight`), the output heads and the products
  kept at 8 bits (`int4.eight_bit_products`) as int8 products do, the text embedding as for int8.
  Version 1 files stored those kept products as bfloat16 `NAME.weight`; they still load, quantized
  to int8 at load (from a bfloat16 source, as released, the values a version 2 file stores).

The values are those quantizing at load gives, so a prepared checkpoint speaks exactly like its
source loaded in the same precision (tested); they do not depend on the CPU.

The file's safetensors metadata says what it is (`format`, `version`, `dtype`); loading checks it,
and a prepared checkpoint loads only in its own precision (`Engine.load` picks it by default). This
module reads the format (kazeia/model.py loads through it); kazeia/prepare.py writes it.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from . import cpu, int4
from .checkpoint import DTYPES, assign, load_tensors
from .config import CheckpointError
from .quant import QuantEmbedding, QuantLinear

FORMAT, VERSION = "kazeia-prepared", "2"
READABLE = ("1", "2")  # version 1: int4's kept products in bfloat16 (`_product`)
QUANTIZED = ("int8", "int4")  # stored under module names, as the products multiply them
WEIGHTS = "model.safetensors"


def prepared_dtype(path: Path) -> str | None:
    """The precision `path` (a model.safetensors) was prepared for, None for a released file."""
    meta = _metadata(path)
    if meta.get("format") != FORMAT:
        return None
    if meta.get("version") not in READABLE or meta.get("dtype") not in DTYPES:
        raise CheckpointError(
            f"{path} was prepared by another version of Kazeia (format {meta.get('version')!r}, "
            f"dtype {meta.get('dtype')!r}); prepare it again from the released checkpoint"
        )
    return meta["dtype"]


def load_quantized(model: nn.Module, path: Path, dtype: str, lib, skipped: tuple[str, ...] = ()) -> None:
    """Fill `model` (built on the meta device, projections fused) from a prepared int8 or int4
    file: the products become the modules of the stored values (QuantLinear; Int4Linear, or
    QuantLinear for the products int4 keeps at 8 bits), the text embedding a QuantEmbedding, the
    rest is assigned strictly (a missing, unexpected or mis-shaped tensor names itself). Tensors
    whose names start with one of `skipped` are another module's (a Base checkpoint's speaker
    encoder)."""
    tensors = load_tensors(path, mmap=False, wanted=lambda name: not name.startswith(skipped))
    eight = int4.eight_bit_products(model) if dtype == "int4" else set()
    kept = "bfloat16" if _metadata(path).get("version") == "1" else "int8"  # how int4's kept products are stored
    jobs = []  # (parent, attribute, a function making the product)
    for parent_name, parent in list(model.named_modules()):
        for child, linear in list(parent.named_children()):
            if isinstance(linear, nn.Linear):
                name = f"{parent_name}.{child}" if parent_name else child
                stored = kept if name in eight else None
                jobs.append((parent, child, _product(tensors, name, linear, dtype, path, lib, stored)))
    # Packing the weights for the int8 GEMM is most of the time left; torch releases the GIL there.
    with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), cpu.usable_cpus()))) as pool:
        made = list(pool.map(lambda job: job[2](), jobs))
    for (parent, child, _), linear in zip(jobs, made, strict=True):
        setattr(parent, child, linear)
    table = model.talker.text_embedding
    qweight = _take(tensors, "talker.text_embedding.qweight", path)
    scales = _take(tensors, "talker.text_embedding.scales", path)
    if tuple(qweight.shape) != tuple(table.weight.shape) or tuple(scales.shape) != tuple(table.weight.shape[:1]):
        raise CheckpointError(
            f"{path}: talker.text_embedding is stored as {tuple(qweight.shape)}, expected {tuple(table.weight.shape)}"
        )
    model.talker.text_embedding = QuantEmbedding(qweight, scales.float())
    built = {name: t for name, t in model.state_dict().items() if not t.is_meta}
    assign(model, {**tensors, **built}, str(path))


def _product(
    tensors: dict[str, torch.Tensor], name: str, linear: nn.Linear, dtype: str, path: Path, lib, kept: str | None
):
    """The stored tensors of product `name` taken out of `tensors`, checked against the shape of
    `linear`; returns a function that builds its module. `kept`: how an int4 product kept at 8 bits
    (`int4.eight_bit_products`) is stored, "int8" or (version 1) "bfloat16"; None for the others."""
    shape = (linear.out_features, linear.in_features)
    bias = tensors.pop(f"{name}.bias", None)

    def wrong(found: str, expected: str) -> CheckpointError:
        return CheckpointError(f"{path}: {name} is stored as {found}, expected {expected}")

    if kept == "bfloat16":  # a version 1 file's (READABLE): quantized here as version 2 stores it
        weight = _take(tensors, f"{name}.weight", path)
        if tuple(weight.shape) != shape or weight.dtype != torch.bfloat16:
            raise wrong(f"{tuple(weight.shape)} {weight.dtype}", f"{shape} bfloat16")
        return lambda: QuantLinear.from_float(weight.float(), bias, lib)
    if dtype == "int8" or kept:
        qweight, scales = _take(tensors, f"{name}.qweight", path), _take(tensors, f"{name}.scales", path)
        if tuple(qweight.shape) != shape or tuple(scales.shape) != shape[:1] or qweight.dtype != torch.int8:
            raise wrong(f"{tuple(qweight.shape)} {qweight.dtype}", f"{shape} int8")
        return lambda: QuantLinear.from_int8(qweight, scales.float(), bias, lib)
    if not int4.supported(linear.in_features):  # kept float32 (int4.quantize_linears)
        weight = _take(tensors, f"{name}.weight", path)
        if tuple(weight.shape) != shape or weight.dtype != torch.float32:
            raise wrong(f"{tuple(weight.shape)} {weight.dtype}", f"{shape} float32")
        plain = nn.Linear(shape[1], shape[0], bias=bias is not None, device="meta")
        plain.weight, plain.bias = nn.Parameter(weight), None if bias is None else nn.Parameter(bias)
        return lambda: plain
    stored = {key: _take(tensors, f"{name}.{key}", path) for key in ("qweight", "steps", "offsets", "factors")}
    if tuple(stored["qweight"].shape) != (shape[0], shape[1] // 2):
        raise wrong(f"{tuple(stored['qweight'].shape)} codes", f"{(shape[0], shape[1] // 2)} codes")
    try:
        made = int4.Int4Linear(stored, bias, lib)  # checks every tensor's shape and dtype
    except ValueError as e:
        raise CheckpointError(f"{path}: {name}: {e}") from None
    return lambda: made


def _metadata(path: Path) -> dict[str, str]:
    """The safetensors metadata of `path` (a model.safetensors); unreadable: a CheckpointError."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file (truncated or corrupt?): {e}") from None


def _take(tensors: dict[str, torch.Tensor], name: str, path: Path) -> torch.Tensor:
    try:
        return tensors.pop(name)
    except KeyError:
        raise CheckpointError(f"{path}: missing tensor {name}") from None
