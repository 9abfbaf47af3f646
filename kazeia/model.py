"""Build the talker and code predictor of a checkpoint and load `model.safetensors` into them.

Modules are built on the meta device and receive the memory-mapped tensors through one rename table
(released name prefix -> module name prefix); loading is strict. Speaker-encoder tensors of Base
checkpoints are left to kazeia/speaker.py (voice cloning); in any other checkpoint they are unexpected.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from . import native
from .checkpoint import assign, load_tensors
from .code_predictor import CodePredictor
from .config import CheckpointError, ModelConfig
from .heap import release_freed_memory
from .hugepages import Arena, move_to_huge_pages
from .int4 import quantize_linears as int4_linears
from .layers import fuse_projections
from .matmul import can_pack, pack_linears, replace_linears
from .native import linear as native_linear
from .prepared import QUANTIZED, load_quantized, prepared_dtype
from .quant import QuantEmbedding, int8_supported, quantize_linears
from .talker import Talker

# Released prefix -> module prefix, first match wins.
RENAMES = (
    ("talker.code_predictor.model.", "code_predictor."),
    ("talker.code_predictor.", "code_predictor."),
    ("talker.model.", "talker."),
    ("talker.", "talker."),
)
SKIPPED_PREFIXES = ("speaker_encoder.",)  # Base checkpoints only: loaded by kazeia/speaker.py


class TTSModel(nn.Module):
    """Talker + code predictor of one checkpoint."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.arena: Arena | None = None  # the weights' huge pages (kazeia/hugepages.py), once prepared
        self.talker = Talker(cfg.talker)
        self.code_predictor = CodePredictor(
            cfg.code_predictor, cfg.talker.stack.hidden_size, cfg.code_predictor_vocab, cfg.talker.num_code_groups
        )

    @classmethod
    def load(
        cls,
        cfg: ModelConfig,
        path: Path,
        device: torch.device | str,
        dtype: torch.dtype | str,
        huge_pages: bool = False,
    ) -> TTSModel:
        """Load `model.safetensors`; dtype is a float dtype, "int8" (see kazeia/quant.py) or "int4"
        (kazeia/int4.py); `huge_pages`: the weights on huge pages (kazeia/hugepages.py)."""
        quantized = dtype in QUANTIZED  # the file's precision is kept until each weight is quantized
        if quantized and torch.device(device).type != "cpu":
            raise ValueError(f"dtype {dtype!r} runs on the CPU only; use bfloat16 or float16 on a GPU")
        lib = native.library() if torch.device(device).type == "cpu" else None
        if dtype == "int8" and (why := int8_supported(lib)) is not None:
            raise ValueError(f"dtype {dtype!r} cannot run here: {why}; use float32 or bfloat16")
        if dtype == "int4" and lib is None:
            raise ValueError(
                "dtype 'int4' needs the native library (a C compiler, and KAZEIA_NATIVE not 0); use int8 or float32"
            )
        with torch.device("meta"):
            model = cls(cfg)
        prepared = prepared_dtype(path)
        if prepared is not None:
            name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
            if name != prepared:
                raise ValueError(
                    f"{path} is prepared for {prepared} (kazeia quantize): load it with dtype={prepared!r}, "
                    f"or load the released checkpoint for {name}"
                )
        if prepared in QUANTIZED:  # products stored quantized and fused: nothing to convert
            fuse_projections(model)  # on the meta device: the fused shapes
            load_quantized(model, path, prepared, lib, SKIPPED_PREFIXES)
            if huge_pages:  # before the decoding steps take the weights' addresses
                model.arena = move_to_huge_pages(model)
            model.choose_steps(lib)
            return model.eval()
        # Read, not memory-mapped: fusing and quantizing replace most tensors, and a map would keep
        # every page of the file resident next to the replacements until the last tensor is gone.
        base = cfg.tts_model_type == "base"
        kept = None if quantized else dtype  # the precision tensors are read in (None: the file's)
        raw = load_tensors(path, kept, mmap=False)
        tensors = rename(raw, str(path), skip_speaker_encoder=base)
        del raw
        assign(model, tensors, str(path), device=device, dtype=kept, released_name=released_name)
        del tensors
        model.prepare(torch.device(device), dtype, huge_pages)
        return model.eval()

    def prepare(self, device: torch.device, dtype: torch.dtype | str, huge_pages: bool = False) -> None:
        """The loaded weights into the form each step runs fastest in, and the implementations of
        the products and decoding steps chosen once, here (results change by float rounding only).

        Each step frees the weights it replaces; glibc keeps such blocks in its heap, so they are
        handed back after every module, or the unfused and fused copies would add up at the peak.
        """
        cpu = device.type == "cpu"
        lib = native.library() if cpu else None  # None: no compiler, KAZEIA_NATIVE=0, or a GPU
        fuse_projections(self, after_each=release_freed_memory)
        if dtype in QUANTIZED:
            # Products: fbgemm's int8 GEMM on two activation rows (kazeia/quant.py), or 4-bit groups
            # in kazeia/native/int4.c (which `load` made sure is there); an int8 text embedding.
            quantize = quantize_linears if dtype == "int8" else int4_linears
            quantize(self, lib, after_each=release_freed_memory)
            self.talker.text_embedding = QuantEmbedding.from_float_chunked(self.talker.text_embedding.weight)
            self.float()
        elif cpu and native_linear.usable(lib, dtype):
            # Products: the native single-threaded GEMV, for one thread per stage (kazeia/placement.py).
            replace_linears(self, native_linear.converter(lib), after_each=release_freed_memory)
        elif cpu and can_pack(dtype):
            # Products: oneDNN's packed batch-1 matmul (reads weights faster than the stock kernel).
            pack_linears(self, after_each=release_freed_memory)
        if cpu and huge_pages:  # before the decoding steps take the weights' addresses
            self.arena = move_to_huge_pages(self)
        self.choose_steps(lib)

    def choose_steps(self, lib) -> None:
        """Decoding steps (one sequence, 1-2 positions), and prompts where every product splits a
        prompt's rows itself (int4, native int8): the C glue between the products where the native
        library supports these activations, else the eager layers (kazeia/native/step.py)."""
        activations = self.talker.norm.weight.dtype
        for stack in (self.talker, self.code_predictor):
            stack.native_step = native.stack_step(lib, stack.layers, stack.norm, activations)


def rename(
    tensors: Mapping[str, torch.Tensor], where: str, skip_speaker_encoder: bool = True
) -> dict[str, torch.Tensor]:
    """Map released tensor names onto module names; an unknown name is an error naming it.
    Speaker-encoder tensors are skipped (Base checkpoints) or unknown (`skip_speaker_encoder=False`)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if skip_speaker_encoder and name.startswith(SKIPPED_PREFIXES):
            continue
        for released, ours in RENAMES:
            if name.startswith(released):
                out[ours + name[len(released) :]] = tensor
                break
        else:
            raise CheckpointError(f"{where}: unexpected tensor {name}")
    return out


def released_name(name: str) -> str:
    """Inverse of `rename`, for error messages: module name -> released tensor name."""
    head, _, rest = name.partition(".")
    if head == "talker":
        top = rest.startswith(("text_projection.", "codec_head."))
        return ("talker." if top else "talker.model.") + rest
    if head == "code_predictor":
        top = rest.startswith(("lm_head.", "small_to_mtp_projection."))
        return ("talker.code_predictor." if top else "talker.code_predictor.model.") + rest
    return name
