"""The public API: load a checkpoint once, synthesize many times.

```python
engine = Engine.load("Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice")
speech = engine.synthesize("Bonjour Kazeia.", voice="serena", language="french", seed=7)

base = Engine.load("Qwen/Qwen3-TTS-12Hz-0.6B-Base")  # voice cloning
me = base.create_voice("me.wav", ref_text="What I say in me.wav.")
speech = base.synthesize("Bonjour Kazeia.", voice=me, language="french")
```

Every call is independent (fresh caches, its own `torch.Generator`); the same text, voice, options
and seed give the same codes and the same audio bytes. Bad input raises `RequestError` (a
`ValueError`) naming what is wrong and the valid choices.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import numpy as np
import torch
from typing_extensions import Unpack

from . import cpu, generate
from .audio import SAMPLE_RATE, load_reference_audio
from .checkpoint import DTYPES, release_freed_memory, resolve
from .config import ModelConfig
from .errors import RequestError
from .int4 import Int4Linear
from .model import TTSModel
from .prepared import prepared_dtype
from .quant import QuantLinear
from .request import Request, Rules, TextSource, build_request, ref_text_ids
from .runaway import overall
from .sampling import SamplingKwargs, SamplingOptions
from .scheduler import Scheduler
from .segment import LongTextOptions
from .speed import stretch
from .streaming import ChunkSchedule, Metrics, Segment, SpeechStream, at_speed
from .text import TextTokenizer
from .timeline import FirstPrefill, Running, segments
from .vocoder import OFFLINE_BLOCK, Vocoder
from .voices import Cloner, Priming, Voice


@dataclass(frozen=True)
class Speech:
    """Result of `Engine.synthesize`."""

    audio: np.ndarray  # (samples,) float32 mono in [-1, 1]
    sample_rate: int  # Hz (24000)
    codes: np.ndarray  # (frames, 16) int64 speech-tokenizer codes
    metrics: Metrics
    segments: tuple[Segment, ...] = ()  # the text's segments in order, with their exact samples and finish reasons

    @property
    def finish_reason(self) -> str:
        """Why the utterance ended: the most serious of its segments' reasons (kazeia/runaway.py)."""
        return overall([s.finish_reason for s in self.segments])


class Engine:
    """A loaded checkpoint (talker, code predictor, vocoder, text tokenizer, and for Base checkpoints
    the two encoders) and the calls made on it.

    It orchestrates and holds no per-call state: each call validates its arguments into a
    `Request` (kazeia/request.py), lays out the prompt (prompt.py), drains the one frame loop
    (generate.py) and decodes the codes (the vocoder, continuing an ICL voice's primed state:
    voices.Priming). Streaming runs the same loop in a worker thread (streaming.py).
    """

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
        voice_model = cloner.model if cloner is not None else None
        self.rules = Rules(cfg, tokenizer, defaults, voice_model, vocoder.cfg.codebook_size)
        self._priming = Priming(vocoder)  # ICL voices: vocoder states after their reference frames
        # A request's first prompt, while the engine has no other request or open stream, runs on
        # every core of the two stages: its vocoder has nothing to decode yet (timeline.FirstPrefill).
        self._running = Running()
        threads = torch.get_num_threads()
        prompt_threads = min(cpu.usable_cpus(), 2 * threads)
        alone = device.type == "cpu" and prompt_threads > threads
        # int4.c's and int8.c's products split a prompt over threads of their own
        own = any(
            isinstance(m, Int4Linear) or (isinstance(m, QuantLinear) and m.native) for m in model.talker.modules()
        )
        self._alone = FirstPrefill(self._running, prompt_threads, not own) if alone else generate.SOLO

    @property
    def prompt_team(self) -> tuple[int, bool] | None:
        """(threads, openmp) of a prompt that has the machine to itself (`cpu.team`; a scheduler's
        prompts take it while no stream's audio is being decoded), or None where there is none."""
        threads = self._alone.prompt_threads
        return None if threads is None else (threads, self._alone.openmp)

    @classmethod
    def load(
        cls,
        path_or_id: str | os.PathLike,
        device: str = "cpu",
        dtype: str | None = None,
        *,
        vocoder_dtype: str = "float32",
        tokenizer_regex: str = "qwen2",
        offline: bool | None = None,
        threads: int | None = None,
    ) -> Engine:
        """Load a local checkpoint directory or a hub id (downloaded once into the hub cache).

        dtype: talker and code-predictor weights, "float32" | "bfloat16" | "float16" | "int8" (CPU:
            per-channel int8 weights quantized at load, float32 activations rounded to 16 bits per
            row, exact integer sums; see kazeia/quant.py) | "int4" (CPU with the native library: 4-bit
            groups of 32 weights, the fewest bytes to read a frame; see kazeia/int4.py). Default:
            the precision a checkpoint prepared by `kazeia quantize` was made for (the only one it
            loads in; kazeia/prepared.py), else float32.
        vocoder_dtype: the speech-tokenizer decoder; float32 by default for exact audio. "bfloat16"
            is faster on CPUs with bfloat16 dot products, at ~27 dB SNR against float32
            (BENCHMARKS.md); elsewhere half precision is slower.
        tokenizer_regex: "qwen2" (standard) or "reference-local" (the split regex the reference
            package uses when it loads from a local directory; see kazeia/text.py).
        threads: torch threads for each of the two stages that run side by side, generation and
            the vocoder, each in a thread of its own (process-wide: `torch.set_num_threads`).
            Default on the CPU: half the cores this process may use, at least 1 (`stage_threads`),
            so the stages never share a core and batch-1 generation, hundreds of small parallel
            regions a frame, never waits at a barrier for a thread that is not running. One
            exception: a request's first prefill, while the engine runs nothing else (no other
            request, no other open stream), takes both stages' threads (its vocoder has nothing
            to decode yet; docs/design.md).
        """
        cpu.enabled()  # a KAZEIA_ISA that cannot be honoured fails here, naming itself
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads must be an integer >= 1, got {threads!r}")
        torch_device = _device(device)
        if threads is not None or torch_device.type == "cpu":
            torch.set_num_threads(threads or stage_threads())
        if dtype is not None:
            _dtype("dtype", dtype)  # a bad name fails before any download
        vocoder_weights = _dtype("vocoder_dtype", vocoder_dtype)
        if not isinstance(vocoder_weights, torch.dtype):
            raise ValueError(f"vocoder_dtype {vocoder_dtype!r} is not supported; choose float32, bfloat16 or float16")
        files = resolve(path_or_id, offline=offline)
        weights = _dtype("dtype", dtype or prepared_dtype(files["model.safetensors"]) or "float32")
        cfg = ModelConfig.from_file(files["config.json"])
        defaults = SamplingOptions.from_file(files["generation_config.json"])
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
        return self.rules.model_type

    @property
    def voices(self) -> list[str]:
        """Preset speakers (CustomVoice checkpoints); empty for other kinds."""
        return self.rules.voices

    @property
    def languages(self) -> list[str]:
        """Accepted `language` values: "auto" plus the checkpoint's languages (dialects come with speakers)."""
        return self.rules.languages

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
            raise RequestError("x_vector_only", f"x_vector_only must be True or False, got {x_vector_only!r}")
        if x_vector_only and ref_text is not None:
            raise RequestError("ref_text", "ref_text is not used with x_vector_only=True; leave it out")
        if not x_vector_only:
            if not isinstance(ref_text, str) or not ref_text.strip():
                raise RequestError(
                    "ref_text",
                    "ref_text, the transcript of the reference audio, is required for ICL cloning "
                    "(or pass x_vector_only=True)",
                )
            ref_text_ids(self.rules, ref_text)
        audio = load_reference_audio(ref_audio, self.cloner.encoder.cfg.sample_rate)
        codes, x_vector = self.cloner.encode(audio)
        if x_vector_only:
            return Voice(x_vector, None, None, self.cloner.model)
        return Voice(x_vector, codes, ref_text, self.cloner.model)

    # -- synthesis --------------------------------------------------------------------------
    def synthesize(
        self,
        text: str,
        voice: str | os.PathLike | Voice | None = None,
        language: str | None = None,
        instruct: str | None = None,
        seed: int | None = None,
        non_streaming_mode: bool | None = None,
        reference_chunked_decode: bool = False,
        long_text: LongTextOptions | None = None,
        speed: float = 1.0,
        **sampling: Unpack[SamplingKwargs],
    ) -> Speech:
        """Synthesize `text`; `sampling` takes the `SamplingOptions` fields (reference names).

        A text longer than `long_text.segment_tokens` tokens is spoken in segments, one after the
        other, as one utterance (kazeia/segment.py); every segment is held to a frame budget by the
        runaway guard (kazeia/runaway.py). `speech.segments` says where each one lies and why it
        ended; `LongTextOptions(segment=False, guard=False)` turns both off.

        `speed` (0.25-4.0) changes the pace, not the pitch (kazeia/speed.py): n samples of speech
        become floor(n / speed + 1/2); 1.0 (the default) returns the vocoder's samples untouched.
        Segment times are then in output time too.

        The audio is one exact causal decode of all codes, made side by side with the generation:
        the vocoder decodes each block of OFFLINE_BLOCK frames in this thread while the next ones
        are generated in another (the blocks of `Vocoder.forward`, so the same audio).
        `reference_chunked_decode=True` instead reproduces the reference's decode, which restarts
        every 300 frames (24 s) from 25 frames of context: identical up to 300 frames, an
        approximation after (for comparisons only), made once all frames are generated.
        """
        if not isinstance(reference_chunked_decode, bool):
            raise RequestError(
                "reference_chunked_decode",
                f"reference_chunked_decode must be True or False, got {reference_chunked_decode!r}",
            )
        if not isinstance(text, str):
            raise RequestError("text", f"text must be a string, got {type(text).__name__}")
        start = time.perf_counter()
        request = self.request(
            text, voice, language, instruct, seed, non_streaming_mode, long_text=long_text, speed=speed, **sampling
        )
        ref = request.cond.reference_codes
        if reference_chunked_decode:  # all frames first, then the reference's decode
            frames: list[torch.Tensor] = []
            segments: list[Segment] = []
            for item in self.timeline(request):
                if isinstance(item, Segment):
                    segments.append(item)
                    continue
                frames.append(item)
                if len(frames) == 1:
                    prefill_s = time.perf_counter() - start
            generation_s: float | None = time.perf_counter() - start
            codes = torch.stack(frames)
            if ref is None:
                audio = self.decode(codes, reference_chunked=True)
            else:
                audio = self._priming.reference_chunked(ref, codes)
            if request.speed != 1.0:
                audio = stretch(audio, request.speed, self.vocoder.cfg.sample_rate)
                segments = [at_speed(segment, request.speed) for segment in segments]
        else:
            blocks = ChunkSchedule(OFFLINE_BLOCK, OFFLINE_BLOCK)
            with self.stream_request(request, blocks, started=start) as stream:
                pieces = [chunk.audio for chunk in stream]
            assert stream.metrics is not None and stream.codes is not None  # the last chunk is out
            codes, prefill_s = torch.from_numpy(stream.codes), stream.metrics.prefill_s
            generation_s = stream.metrics.generation_s
            segments = stream.segments
            if ref is not None and request.speed == 1.0:  # the reference samples the reference package's
                pieces.insert(0, self._priming.lead(ref, codes.shape[0]))  # cut keeps (0 or 1), at speed 1
            audio = np.concatenate(pieces).astype(np.float32, copy=False)
        if request.speed == 1.0:  # ICL: the reference samples kept before the audio (0 or 1)
            lead = len(audio) - codes.shape[0] * self.vocoder.cfg.samples_per_frame
            segments = [_shifted(segment, lead) for segment in segments]
        wall = time.perf_counter() - start
        rate = self.vocoder.cfg.sample_rate
        audio_s = len(audio) / rate
        metrics = Metrics(
            codes.shape[0], audio_s, wall, wall / audio_s, prefill_s, wall, 1, request.seed, generation_s=generation_s
        )
        return Speech(audio, rate, codes.cpu().numpy(), metrics, tuple(segments))

    def stream(
        self,
        text: TextSource,
        voice: str | os.PathLike | Voice | None = None,
        language: str | None = None,
        instruct: str | None = None,
        seed: int | None = None,
        non_streaming_mode: bool | None = None,
        first_chunk_frames: int = 1,
        chunk_frames: int = 4,
        max_chunk_frames: int | None = None,
        text_timeout: float | None = 30.0,
        should_stop: Callable[[], bool] | None = None,
        text_deadline: float | None = None,
        long_text: LongTextOptions | None = None,
        speed: float = 1.0,
        scheduler: Scheduler | None = None,
        **sampling: Unpack[SamplingKwargs],
    ) -> SpeechStream:
        """Like `synthesize`, but yields `AudioChunk`s while generating (a long text's segments in
        one stream: each chunk lists the segments that ended by its end; `stream.segments` all).

        The first chunk holds `first_chunk_frames` frames (80 ms each), later ones one frame more
        each up to `chunk_frames`; with `max_chunk_frames`, a later chunk also takes the frames
        already waiting, up to that many, when its consumer has fallen behind (the vocoder catches
        up; streaming.ChunkSchedule says what each costs).
        The schedule changes only latency and overhead: the codes equal `synthesize`'s for the same
        seed and the concatenated audio equals its audio (within float rounding, ~1e-6). Use it as an
        iterator, ideally in a `with` block; closing it stops generation before the next frame.

        `text` may also be a source of text that is still arriving: an iterable or async iterable of
        deltas, or a `TextFeed` (see kazeia/live.py). Speech then starts with the first complete word
        (streaming text layout, `non_streaming_mode=False`, the default for such sources), and the
        codes and audio equal those of the whole text given at once. A source that adds no new text
        (empty or blank deltas do not count) for longer than `text_timeout` seconds, or whose text
        has not ended `text_deadline` seconds after the stream started waiting for it, fails the
        stream (None: no limit). `should_stop`: polled before each
        frame; True ends the stream early (an alternative to `close()`). `speed`: as `synthesize`'s;
        the stretch carries its state from chunk to chunk, so the audio is `synthesize`'s whatever
        the schedule (each chunk lacks what the stretch still holds back, up to ~60 ms, until the next).
        `scheduler`: generate it there, batched with other streams (`Engine.scheduler`); the same
        codes and audio (kazeia/batch.py says which precisions differ from a stream without one).
        """
        started = time.perf_counter()
        schedule = ChunkSchedule(first_chunk_frames, chunk_frames, max_chunk_frames)
        request = self.request(
            text,
            voice,
            language,
            instruct,
            seed,
            non_streaming_mode,
            text_timeout=text_timeout,
            text_deadline=text_deadline,
            long_text=long_text,
            speed=speed,
            **sampling,
        )
        return self.stream_request(request, schedule, should_stop, started, scheduler)

    def stream_request(
        self,
        request: Request,
        schedule: ChunkSchedule | None = None,
        should_stop: Callable[[], bool] | None = None,
        started: float | None = None,
        scheduler: Scheduler | None = None,
    ) -> SpeechStream:
        """`stream` for a request validated before (`request`), e.g. by a server when it was queued."""
        ref = request.cond.reference_codes
        state = None if ref is None else self._priming.state(ref)
        if scheduler is not None and scheduler.engine is not self:
            raise ValueError("the scheduler belongs to another engine")
        if scheduler is not None:
            frames = scheduler.source(request, should_stop)  # SchedulerBusy here: nothing to undo
        self._running.enter()  # until the stream closes: its vocoder works until then
        if scheduler is None:
            frames = lambda stop: segments(self, request, _either(stop, should_stop), self._alone, generate.SOLO)  # noqa: E731
        try:
            stream = SpeechStream(
                frames,
                self.vocoder,
                schedule or ChunkSchedule(),
                request.seed,
                time.perf_counter() if started is None else started,
                state,
                request.live,
                request.speed,
                on_close=self._running.leave,
                lanes=None if scheduler is None else scheduler.lanes,
            )
        except BaseException:  # e.g. no thread could be started: the scheduler's place is given back
            self._running.leave()
            getattr(frames, "release", lambda: None)()
            raise
        if scheduler is not None:
            frames.pace(stream.needs_frames)  # type: ignore[attr-defined]
        return stream

    def request(
        self,
        text: TextSource,
        voice: str | os.PathLike | Voice | None = None,
        language: str | None = None,
        instruct: str | None = None,
        seed: int | None = None,
        non_streaming_mode: bool | None = None,
        text_timeout: float | None = 30.0,
        text_deadline: float | None = None,
        position_limit: int | None = None,
        long_text: LongTextOptions | None = None,
        speed: float = 1.0,
        **sampling: Unpack[SamplingKwargs],
    ) -> Request:
        """Validate a call's arguments and resolve names to ids (kazeia/request.py): a `Request`
        for `frames` or `stream_request`; raises RequestError on anything wrong. A text source
        (not a string) starts being read now. `position_limit`: a bound of the caller's (a
        server's) on prompt + max_new_tokens, below the model's own. `speed`: the pace of its audio."""
        return build_request(
            self.rules,
            text,
            text_timeout,
            text_deadline,
            position_limit,
            long_text,
            voice=voice,
            language=language,
            instruct=instruct,
            seed=seed,
            non_streaming_mode=non_streaming_mode,
            speed=speed,
            **sampling,
        )

    def frames(self, request: Request, should_stop: Callable[[], bool] | None = None) -> Iterator[torch.Tensor]:
        """The frame generator for a validated request: yields (16,) int64 code frames, those of
        all its segments one after the other. Live text is waited for here: the first token, or all
        of the text for layouts that need it whole."""
        for item in self.timeline(request, should_stop):
            if isinstance(item, torch.Tensor):
                yield item

    def timeline(
        self, request: Request, should_stop: Callable[[], bool] | None = None, steps: generate.Steps = generate.SOLO
    ) -> Iterator[torch.Tensor | Segment]:
        """`frames`, each segment's last frame followed by its `Segment`. Segment k speaks with its
        own seed (request.Part), its own talker cache and prompt: the same voice, and with
        `carry_context` the previous segment's text and frames as in-context reference (a segment the
        guard found looping is not continued). A segment the caller stops ends the utterance.
        `steps`: who runs the frame steps (generate.Steps; a scheduler's batch several requests)."""
        self._running.enter()
        try:
            first = self._alone if steps is generate.SOLO else steps  # the first segment's
            yield from segments(self, request, should_stop, first, steps)
        finally:
            self._running.leave()

    def scheduler(
        self,
        max_batch: int = 4,
        max_queue: int = 16,
        on_step: Callable[[int], None] | None = None,
        vocoder_lanes: int | None = None,
        spare_lanes: int = 1,
        prompts_at_once: int | None = None,
    ) -> Scheduler:
        """A scheduler generating up to `max_batch` streams of this engine together (one batched
        frame step for all: kazeia/scheduler.py), `max_queue` more waiting first come first served.
        Each stream's codes and audio do not depend on the others. Close it when done. `on_step`:
        called with each step's number of streams. `vocoder_lanes`: how many of its streams'
        vocoders decode at once (None: as many as fit beside generation's threads, at least one);
        `spare_lanes`: how many more may decode on generation's own cores while it has nothing to
        run (0: none). `prompts_at_once`: how many prompts that wait together run side by side
        (None: as many as the prompt team holds stages' threads, two by default; 1: one after the
        other)."""
        return Scheduler(self, max_batch, max_queue, on_step, vocoder_lanes, spare_lanes, prompts_at_once)

    @torch.inference_mode()
    def decode(self, codes: torch.Tensor, reference_chunked: bool = False) -> np.ndarray:
        """codes (frames, 16) -> float32 audio (frames * 1920,): one exact causal decode, or the
        reference's 300-frame restarts with `reference_chunked`."""
        codes = codes.to(self.device)[None]
        audio = self.vocoder.decode_reference_chunked(codes) if reference_chunked else self.vocoder(codes)
        return audio[0].float().cpu().numpy().astype(np.float32, copy=False)


def stage_threads() -> int:
    """torch threads per stage by default: half the CPUs this process may run on, at least one."""
    return max(1, cpu.usable_cpus() // 2)


def _shifted(segment: Segment, samples: int) -> Segment:
    """`segment` with its samples `samples` later (an ICL voice's lead before the generated audio)."""
    return replace(segment, start_sample=segment.start_sample + samples, end_sample=segment.end_sample + samples)


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


__all__ = ["Engine", "Speech", "Metrics", "Segment", "LongTextOptions", "Voice", "SAMPLE_RATE"]
