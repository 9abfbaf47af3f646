"""The public API: load a checkpoint once, synthesize many times.

```python
engine = Engine.load("Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice")
speech = engine.synthesize("Bonjour Kazeia.", voice="serena", language="french", seed=7)

base = Engine.load("Qwen/Qwen3-TTS-12Hz-0.6B-Base")  # voice cloning
me = base.create_voice("me.wav", ref_text="What I say in me.wav.")
speech = base.synthesize("Bonjour Kazeia.", voice=me, language="french")
```

Every call is independent (fresh caches, its own `torch.Generator`); the same text, voice, options
and seed give the same codes and the same audio bytes. Bad input raises `ValueError` naming what is
wrong and the valid choices.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterable, Callable, Iterable, Iterator
from dataclasses import dataclass, replace

import numpy as np
import torch

from . import cpu
from .audio import SAMPLE_RATE, load_reference_audio
from .checkpoint import DTYPES, release_freed_memory, resolve
from .config import GenerationDefaults, ModelConfig
from .generate import FrameStats, frames
from .live import LiveText, TextFeed, as_feed, live_trailing
from .model import TTSModel
from .prompt import Clone, Conditioning, build_prompt, icl_cut
from .sampling import SamplingOptions
from .streaming import ChunkSchedule, Metrics, SpeechStream
from .text import TextTokenizer
from .vocoder import Vocoder
from .voices import Cloner, Priming, Voice, copy_state, decode_from


@dataclass(frozen=True)
class Speech:
    """Result of `Engine.synthesize`."""

    audio: np.ndarray  # (samples,) float32 mono in [-1, 1]
    sample_rate: int  # Hz (24000)
    codes: np.ndarray  # (frames, 16) int64 speech-tokenizer codes
    metrics: Metrics


@dataclass(frozen=True)
class Request:
    """One validated synthesis request (what `frames()` needs besides the model)."""

    text_ids: list[int]  # the assistant template's ids (empty while live text has not arrived)
    cond: Conditioning
    options: SamplingOptions
    non_streaming_mode: bool
    seed: int
    live: LiveText | None = None  # text still arriving (engine.stream with a text source)


class Engine:
    """A loaded checkpoint: talker, code predictor, vocoder and text tokenizer."""

    def __init__(
        self,
        cfg: ModelConfig,
        model: TTSModel,
        vocoder: Vocoder,
        tokenizer: TextTokenizer,
        defaults: SamplingOptions,
        device: torch.device,
        cloner: Cloner | None = None,
    ):
        self.cfg, self.model, self.vocoder, self.tokenizer = cfg, model, vocoder, tokenizer
        self.defaults, self.device = defaults, device
        self.cloner = cloner  # Base checkpoints: the speech-tokenizer encoder and the speaker encoder
        self._priming = Priming(vocoder)  # ICL voices: vocoder states after their reference frames

    @classmethod
    def load(
        cls,
        path_or_id: str | os.PathLike,
        device: str = "cpu",
        dtype: str = "float32",
        *,
        vocoder_dtype: str = "float32",
        tokenizer_regex: str = "qwen2",
        offline: bool | None = None,
        threads: int | None = None,
    ) -> Engine:
        """Load a local checkpoint directory or a hub id (downloaded once into the hub cache).

        dtype: talker and code-predictor weights, "float32" | "bfloat16" | "float16" | "int8" (CPU:
            per-channel int8 weights quantized at load, float32 activations sent to the int8 GEMM
            as two 8-bit rows; see kazeia/quant.py).
        vocoder_dtype: the speech-tokenizer decoder; float32 by default for exact audio. "bfloat16"
            runs its convolutions about twice as fast on CPUs with bfloat16 dot products (AVX512_BF16,
            AMX) at ~27 dB SNR against float32 (BENCHMARKS.md); elsewhere half precision is slower.
        tokenizer_regex: "qwen2" (standard) or "reference-local" (the split regex the reference
            package uses when it loads from a local directory; see kazeia/text.py).
        threads: CPU threads for torch's kernels (process-wide: `torch.set_num_threads`). Default:
            torch's choice, one per physical core, which is what batch-1 generation wants.
        """
        cpu.enabled()  # a KAZEIA_ISA that cannot be honoured fails here, naming itself
        if threads is not None:
            if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
                raise ValueError(f"threads must be an integer >= 1, got {threads!r}")
            torch.set_num_threads(threads)
        torch_device = _device(device)
        weights, vocoder_weights = _dtype("dtype", dtype), _dtype("vocoder_dtype", vocoder_dtype)
        if vocoder_weights == "int8":
            raise ValueError("vocoder_dtype 'int8' is not supported; choose float32, bfloat16 or float16")
        files = resolve(path_or_id, offline=offline)
        cfg = ModelConfig.from_file(files["config.json"])
        gen = GenerationDefaults.from_file(files["generation_config.json"])
        defaults = SamplingOptions(**{n: getattr(gen, n) for n in SamplingOptions.names() if hasattr(gen, n)})
        tokenizer = TextTokenizer.from_dir(files.root, regex=tokenizer_regex)
        model = TTSModel.load(cfg, files["model.safetensors"], torch_device, weights)
        vocoder = Vocoder.load(files["speech_tokenizer"], device=torch_device, dtype=vocoder_weights)
        release_freed_memory()
        cloner = Cloner.load(files.root, cfg, torch_device) if cfg.tts_model_type == "base" else None
        return cls(cfg, model, vocoder, tokenizer, defaults, torch_device, cloner)

    # -- what the checkpoint supports -------------------------------------------------------
    @property
    def model_type(self) -> str:
        """ "custom_voice", "voice_design" or "base"."""
        return self.cfg.tts_model_type

    @property
    def voices(self) -> list[str]:
        """Preset speakers (CustomVoice checkpoints); empty for other kinds."""
        return sorted(self.cfg.talker.speaker_ids)

    @property
    def languages(self) -> list[str]:
        """Accepted `language` values: "auto" plus the checkpoint's languages (dialects come with speakers)."""
        dialects = {d for d in self.cfg.talker.speaker_dialects.values() if d}
        return ["auto"] + sorted(k for k in self.cfg.talker.language_ids if k not in dialects)

    # -- voice cloning (Base checkpoints) ------------------------------------------------------
    def create_voice(self, ref_audio, ref_text: str | None = None, x_vector_only: bool = False) -> Voice:
        """Clone the voice of `ref_audio` (a Base checkpoint's job): encode it once into a `Voice`.

        ref_audio: a path (WAV/FLAC/OGG/MP3), the bytes of such a file, a binary file object, or
            `(array, sample_rate)`; mixed down to mono and resampled to 24 kHz. 3-10 s of clean
            speech work best; under 1 s, empty, silent or unreadable audio is a ValueError.
        ref_text: the transcript of `ref_audio`, required in ICL mode (the default): the talker then
            continues the reference's own codes, which copies the voice most closely.
        x_vector_only: use only the speaker embedding (no transcript needed, looser likeness).
        """
        if self.cloner is None:
            raise ValueError(f"voice cloning needs a Base checkpoint; this is a {self.model_type} checkpoint")
        if not isinstance(x_vector_only, bool):
            raise ValueError(f"x_vector_only must be True or False, got {x_vector_only!r}")
        if x_vector_only and ref_text is not None:
            raise ValueError("ref_text is not used with x_vector_only=True; leave it out")
        if not x_vector_only:
            if not isinstance(ref_text, str) or not ref_text.strip():
                raise ValueError(
                    "ref_text, the transcript of the reference audio, is required for ICL cloning "
                    "(or pass x_vector_only=True)"
                )
            self._ref_text_ids(ref_text)
        audio = load_reference_audio(ref_audio, self.cloner.encoder.cfg.sample_rate)
        codes, x_vector = self.cloner.encode(audio)
        if x_vector_only:
            return Voice(x_vector, None, None, self.cloner.model)
        return Voice(x_vector, codes, ref_text, self.cloner.model)

    # -- synthesis --------------------------------------------------------------------------
    def synthesize(
        self,
        text: str,
        voice: str | None = None,
        language: str | None = None,
        instruct: str | None = None,
        seed: int | None = None,
        non_streaming_mode: bool | None = None,
        reference_chunked_decode: bool = False,
        **sampling,
    ) -> Speech:
        """Synthesize `text`; `sampling` takes the `SamplingOptions` fields (reference names).

        The audio is one exact causal decode of all codes. `reference_chunked_decode=True` instead
        reproduces the reference's decode, which restarts every 300 frames (24 s) from 25 frames of
        context: identical up to 300 frames, an approximation after (for comparisons only).
        """
        if not isinstance(reference_chunked_decode, bool):
            raise ValueError(f"reference_chunked_decode must be True or False, got {reference_chunked_decode!r}")
        start = time.perf_counter()
        request = self.request(text, voice, language, instruct, seed, non_streaming_mode, **sampling)
        codes, prefill_s = [], 0.0
        for frame in self.frames(request):
            if not codes:
                prefill_s = time.perf_counter() - start
            codes.append(frame)
        code_matrix = torch.stack(codes)  # (frames, 16)
        audio = self._audio(code_matrix, request.cond.clone, reference_chunked_decode)
        wall = time.perf_counter() - start
        audio_s = len(audio) / SAMPLE_RATE
        metrics = Metrics(len(codes), audio_s, wall, wall / audio_s, prefill_s, wall, 1, request.seed)
        return Speech(audio, SAMPLE_RATE, code_matrix.cpu().numpy(), metrics)

    def stream(
        self,
        text: str | Iterable[str] | AsyncIterable[str] | TextFeed,
        voice: str | None = None,
        language: str | None = None,
        instruct: str | None = None,
        seed: int | None = None,
        non_streaming_mode: bool | None = None,
        first_chunk_frames: int = 1,
        chunk_frames: int = 4,
        text_timeout: float | None = 30.0,
        should_stop: Callable[[], bool] | None = None,
        **sampling,
    ) -> SpeechStream:
        """Like `synthesize`, but yields `AudioChunk`s while generating.

        The first chunk holds `first_chunk_frames` frames (80 ms each), later ones `chunk_frames`.
        The schedule changes only latency and overhead: the codes equal `synthesize`'s for the same
        seed and the concatenated audio equals its audio (within float rounding, ~1e-6). Use it as an
        iterator, ideally in a `with` block; closing it stops generation before the next frame.

        `text` may also be a source of text that is still arriving: an iterable or async iterable of
        deltas, or a `TextFeed` (see kazeia/live.py). Speech then starts with the first complete word
        (streaming text layout, `non_streaming_mode=False`, the default for such sources), and the
        codes and audio equal those of the whole text given at once. A source idle for longer than
        `text_timeout` seconds (None: no limit) fails the stream. `should_stop`: polled before each
        frame; True ends the stream early (an alternative to `close()`).
        """
        started = time.perf_counter()
        schedule = ChunkSchedule(first_chunk_frames, chunk_frames)
        if isinstance(text, str):
            request = self.request(text, voice, language, instruct, seed, non_streaming_mode, **sampling)
        else:  # text still arriving: validate everything else first; the worker waits for the text
            timeout = _text_timeout(text_timeout)
            if non_streaming_mode is None:
                non_streaming_mode = False  # the layout that reads the text while it is generated
            request = self.request("-", voice, language, instruct, seed, non_streaming_mode, **sampling)
            live = LiveText(self.tokenizer, _text_source(text), timeout)  # starts draining the source
            request = replace(request, text_ids=[], live=live)
        clone, state = request.cond.clone, None
        if clone is not None and clone.ref_codes is not None:  # ICL: continue after the reference's audio
            state = copy_state(self._priming.get(clone.ref_codes).state)
        return SpeechStream(
            lambda stop: self.frames(request, _either(stop, should_stop)),
            self.vocoder,
            schedule,
            request.seed,
            started,
            state,
            request.live,
        )

    def request(
        self, text, voice=None, language=None, instruct=None, seed=None, non_streaming_mode=None, **sampling
    ) -> Request:
        """Validate inputs and resolve names to ids; raises ValueError on anything wrong."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a string, got {type(text).__name__}")
        if not text.strip():
            raise ValueError("text is empty")
        cond = self._conditioning(voice, language, instruct)
        options = self._options(sampling)
        if non_streaming_mode is None:
            non_streaming_mode = self.model_type != "base"  # the reference's default per model type
        if not isinstance(non_streaming_mode, bool):
            raise ValueError(f"non_streaming_mode must be True or False, got {non_streaming_mode!r}")
        if seed is None:
            seed = int.from_bytes(os.urandom(6), "little")
        elif isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise ValueError(f"seed must be an integer in [0, 2**63), got {seed!r}")
        return Request(self.tokenizer.assistant_ids(text), cond, options, non_streaming_mode, seed)

    def frames(self, request: Request, should_stop=None, stats: FrameStats | None = None) -> Iterator[torch.Tensor]:
        """The frame generator for a validated request: yields (16,) int64 code frames."""
        if request.live is not None:
            return self._live_frames(request, should_stop, stats)
        m = self.model
        prompt = build_prompt(
            m.talker, self.cfg, request.text_ids, request.cond, request.non_streaming_mode, m.code_predictor
        )
        generator = torch.Generator(device=self.device).manual_seed(request.seed)
        eos = self.cfg.talker.codec_eos_id
        return frames(m.talker, m.code_predictor, prompt, request.options, eos, generator, should_stop, stats)

    def _live_frames(self, request: Request, should_stop, stats) -> Iterator[torch.Tensor]:
        """Frames for live text: wait for the first token (all of the text for the layouts that need
        it whole: `non_streaming_mode=True` and ICL voices), then read one token per frame."""
        live = request.live
        live.should_stop = should_stop
        whole = request.non_streaming_mode or (
            request.cond.clone is not None and request.cond.clone.ref_codes is not None
        )
        if not live.start() or not live.need(1 << 62 if whole else 1):
            return
        if whole:
            yield from self.frames(
                replace(request, text_ids=self.tokenizer.wrap_assistant(live.ids), live=None), should_stop, stats
            )
            return
        m = self.model
        ids = self.tokenizer.wrap_assistant(live.ids[:1])
        prompt = build_prompt(m.talker, self.cfg, ids, request.cond, False, m.code_predictor)
        embed = lambda token: m.talker.embed_text(torch.tensor([[token]], device=self.device))  # noqa: E731
        prompt.text_source = live_trailing(live, embed, prompt.eos, prompt.pad)
        generator = torch.Generator(device=self.device).manual_seed(request.seed)
        eos = self.cfg.talker.codec_eos_id
        yield from frames(m.talker, m.code_predictor, prompt, request.options, eos, generator, should_stop, stats)

    @torch.inference_mode()
    def decode(self, codes: torch.Tensor, reference_chunked: bool = False) -> np.ndarray:
        """codes (frames, 16) -> float32 audio (frames * 1920,): one exact causal decode, or the
        reference's 300-frame restarts with `reference_chunked`."""
        codes = codes.to(self.device)[None]
        audio = self.vocoder.decode_reference_chunked(codes) if reference_chunked else self.vocoder(codes)
        return audio[0].float().cpu().numpy().astype(np.float32, copy=False)

    @torch.inference_mode()
    def _audio(self, codes: torch.Tensor, clone: Clone | None, reference_chunked: bool) -> np.ndarray:
        """The audio of generated codes (frames, 16). ICL voices: like the reference, the decode of
        reference + generated frames with the first `icl_cut(...)` samples dropped; computed as the
        generated frames decoded on the voice's primed vocoder state, after the reference samples
        the cut keeps (0, or 1 by the reference's float rounding)."""
        if clone is None or clone.ref_codes is None:
            return self.decode(codes, reference_chunked=reference_chunked)
        ref_frames, per_frame = clone.ref_codes.shape[0], self.vocoder.cfg.samples_per_frame
        total = ref_frames + codes.shape[0]
        cut = icl_cut(ref_frames, total, total * per_frame)
        if reference_chunked:
            return self.decode(torch.cat((clone.ref_codes.to(codes.device), codes)), reference_chunked=True)[cut:]
        primed = self._priming.get(clone.ref_codes)
        kept = ref_frames * per_frame - cut  # reference samples left in front of the generated audio
        audio = decode_from(self.vocoder, codes.to(self.device), copy_state(primed.state)).float().cpu().numpy()
        return np.concatenate((primed.tail[len(primed.tail) - kept :], audio)).astype(np.float32, copy=False)

    # -- validation -------------------------------------------------------------------------
    def _conditioning(self, voice, language, instruct) -> Conditioning:
        t = self.cfg.talker
        clone, speaker = (self._clone(voice), None) if self.model_type == "base" else (None, self._speaker(voice))
        lang = "auto" if language is None else language
        if not isinstance(lang, str) or lang.strip().lower() not in self.languages:
            raise ValueError(f"unknown language {language!r}; choose one of: {', '.join(self.languages)}")
        lang = lang.strip().lower()
        language_id = None if lang == "auto" else t.language_ids[lang]
        dialect = t.speaker_dialects.get(speaker) if speaker else None
        if dialect and lang in ("chinese", "auto"):
            language_id = t.language_ids[dialect]  # eric -> Sichuan, dylan -> Beijing dialect
        speaker_id = t.speaker_ids[speaker] if speaker else None
        return Conditioning(language_id, speaker_id, self._instruct(instruct), clone)

    def _clone(self, voice) -> Clone:
        """A Base checkpoint's `voice=`: a `Voice`, or the path of a saved one."""
        if voice is None:
            raise ValueError(
                "this Base checkpoint clones voices: pass voice= a Voice from engine.create_voice(...) "
                "or the path of a saved voice file"
            )
        if isinstance(voice, (str, os.PathLike)):
            voice = Voice.load(voice)
        elif not isinstance(voice, Voice):
            raise ValueError(f"voice must be a Voice or the path of a voice file, got {type(voice).__name__}")
        if voice.model != self.cloner.model:
            raise ValueError(
                f"this voice was made with {voice.model.describe()}, but this engine loaded "
                f"{self.cloner.model.describe()}; create the voice again with this checkpoint"
            )
        if voice.ref_codes is None:
            return Clone(voice.x_vector)
        codes, q, size = voice.ref_codes, self.cfg.talker.num_code_groups, self.vocoder.cfg.codebook_size
        if codes.shape[1] != q or int(codes.min()) < 0 or int(codes.max()) >= size:
            raise ValueError(f"voice ref_codes must be (frames, {q}) codes in 0..{size - 1}")
        return Clone(voice.x_vector, codes, tuple(self._ref_text_ids(voice.ref_text)))

    def _ref_text_ids(self, ref_text: str) -> list[int]:
        ids = self.tokenizer.text_ids(ref_text)
        if not ids:
            raise ValueError("ref_text produced no tokens")
        return ids

    def _speaker(self, voice) -> str | None:
        kind = self.model_type
        if isinstance(voice, (Voice, os.PathLike)):
            raise ValueError(f"cloned voices need a Base checkpoint; this is a {kind} checkpoint")
        if kind == "voice_design":
            if voice is not None:
                raise ValueError("VoiceDesign checkpoints have no preset voices: describe the voice with instruct=")
            return None
        if voice is None:
            raise ValueError(f"voice is required; choose one of: {', '.join(self.voices)}")
        name = voice.strip().lower() if isinstance(voice, str) else voice
        if name not in self.cfg.talker.speaker_ids:
            raise ValueError(f"unknown voice {voice!r}; choose one of: {', '.join(self.voices)}")
        return name

    def _instruct(self, instruct) -> tuple[int, ...] | None:
        if instruct is not None and not isinstance(instruct, str):
            raise ValueError(f"instruct must be a string, got {type(instruct).__name__}")
        given = bool(instruct and instruct.strip())
        if given and self.model_type == "base":
            raise ValueError("Base checkpoints take no instruct; the voice comes from voice=")
        if self.model_type == "voice_design" and not given:
            raise ValueError("VoiceDesign checkpoints need instruct=, a description of the voice")
        if given and self.model_type == "custom_voice" and self.cfg.tts_model_size == "0b6":
            raise ValueError("the 0.6B CustomVoice checkpoint does not support instruct; use a 1.7B checkpoint")
        return tuple(self.tokenizer.instruct_ids(instruct)) if given else None

    def _options(self, sampling: dict) -> SamplingOptions:
        unknown = sorted(set(sampling) - set(SamplingOptions.names()))
        if unknown:
            raise ValueError(f"unknown option {unknown[0]!r}; valid options: {', '.join(SamplingOptions.names())}")
        return replace(self.defaults, **{k: v for k, v in sampling.items() if v is not None})


def _text_source(source) -> TextFeed:
    if isinstance(source, (bytes, bytearray)):
        raise ValueError("text must be a string or a source of strings, not bytes")
    return as_feed(source)


def _text_timeout(value: float | None) -> float | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
        raise ValueError(f"text_timeout must be a number of seconds > 0 or None, got {value!r}")
    return value


def _either(a: Callable[[], bool] | None, b: Callable[[], bool] | None) -> Callable[[], bool] | None:
    if a is None or b is None:
        return a or b
    return lambda: a() or b()


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


__all__ = ["Engine", "Speech", "Metrics", "Voice", "SAMPLE_RATE"]
