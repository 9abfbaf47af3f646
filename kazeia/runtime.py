"""A loaded checkpoint and what every request on it shares: the `Runtime`.

Scope: loading a checkpoint (a local directory or a hub id: the talker and code predictor, the
vocoder, the text tokenizer, and for Base checkpoints the two encoders) with its device and
precision checks, and the state its requests share: what the checkpoint accepts
(`request.Capabilities`), its frame step (kazeia/frame.py), the caches of what voices make (the
talker's keys and values over a voice's prompt positions, ICL voices' primed vocoder states), where
work runs (kazeia/placement.py) and how many requests run now. The engine (kazeia/engine.py), an
utterance's timeline (kazeia/utterance.py) and the scheduler (kazeia/scheduler.py) each take a
Runtime; none of them takes an Engine. Non-goals: per-request state (kazeia/frame.py's Decoding).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from . import cpu, native
from .checkpoint import DTYPES, resolve
from .config import ModelConfig
from .frame import FrameStep, voiced_cache
from .heap import release_freed_memory
from .model import TTSModel
from .placement import Placement, Running, set_stage_threads
from .prepared import prepared_dtype
from .request import Capabilities
from .sampling import SamplingOptions
from .text import TextTokenizer
from .vocoder import Vocoder
from .voices import Cloner, Priming


@dataclass(frozen=True, eq=False)
class Runtime:
    """One loaded checkpoint (`load`) and the state its requests share."""

    cfg: ModelConfig
    model: TTSModel  # talker + code predictor
    vocoder: Vocoder  # the speech-tokenizer decoder
    tokenizer: TextTokenizer
    device: torch.device
    caps: Capabilities  # what the checkpoint accepts
    step: FrameStep  # the frame step, with the model's cache of voice positions
    priming: Priming  # ICL voices: the vocoder's state after their reference frames
    placement: Placement  # where work runs
    running: Running  # requests and open streams now
    decoding: Running  # vocoder decodes running now (SpeechStream: its chunks)
    cloner: Cloner | None = None  # Base checkpoints: the speech-tokenizer encoder and the speaker encoder

    @classmethod
    def build(
        cls,
        cfg: ModelConfig,
        model: TTSModel,
        vocoder: Vocoder,
        tokenizer: TextTokenizer,
        defaults: SamplingOptions,
        device: torch.device,
        cloner: Cloner | None = None,
    ) -> Runtime:
        """The runtime of loaded parts: fresh caches, the placement of the threads set now."""
        voice_model = cloner.model if cloner is not None else None
        caps = Capabilities(cfg, tokenizer, defaults, voice_model, vocoder.cfg.codebook_size)
        step = FrameStep(model, voiced_cache())
        placement = Placement.for_model(model, device)
        counts = Running(), Running()  # requests and streams; decodes
        return cls(cfg, model, vocoder, tokenizer, device, caps, step, Priming(vocoder), placement, *counts, cloner)

    @classmethod
    def load(cls, path_or_id: str | os.PathLike, device: str, dtype: str | None, vocoder_dtype: str,
             tokenizer_regex: str, offline: bool | None, threads: int | None,
             huge_pages: bool) -> Runtime:  # fmt: skip
        """`Engine.load`, which gives every argument (its docstring says what each means); every
        argument is checked before anything is read."""
        cpu.enabled()  # a KAZEIA_ISA that cannot be honoured fails here, naming itself
        torch_device = _device(device)
        set_stage_threads(threads, torch_device)
        if dtype is not None:
            _dtype("dtype", dtype)  # a bad name fails before any download
        int8_vocoder = vocoder_dtype == "int8"  # float32 weights, int8 products (Vocoder.prepare)
        vocoder_weights = torch.float32 if int8_vocoder else _dtype("vocoder_dtype", vocoder_dtype)
        if not isinstance(vocoder_weights, torch.dtype):
            raise ValueError(
                f"vocoder_dtype {vocoder_dtype!r} is not supported; choose float32, bfloat16, float16 or int8"
            )
        if int8_vocoder and (torch_device.type != "cpu" or native.library() is None):
            raise ValueError("vocoder_dtype 'int8' needs the CPU with the native library (kazeia/native)")
        files = resolve(path_or_id, offline=offline)
        weights = _dtype("dtype", dtype or prepared_dtype(files["model.safetensors"]) or "float32")
        cfg = ModelConfig.from_file(files["config.json"])
        defaults = SamplingOptions.from_file(files["generation_config.json"])
        tokenizer = TextTokenizer.from_dir(files.root, regex=tokenizer_regex)
        model = TTSModel.load(cfg, files["model.safetensors"], torch_device, weights, huge_pages)
        vocoder = Vocoder.load(files["speech_tokenizer"], device=torch_device, dtype=vocoder_weights, int8=int8_vocoder)
        release_freed_memory()
        cloner = Cloner.load(files.root, cfg, torch_device) if cfg.tts_model_type == "base" else None
        return cls.build(cfg, model, vocoder, tokenizer, defaults, torch_device, cloner)


def _device(device: str) -> torch.device:
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"unknown device {device!r}: {e}") from None
    if d.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return d


def _dtype(name: str, value: str) -> torch.dtype | str:
    if value not in DTYPES:
        raise ValueError(f"unknown {name} {value!r}; choose one of: {', '.join(DTYPES)}")
    return DTYPES[value]
