"""Kazeia: a Qwen3-TTS 12 Hz speech engine in plain PyTorch."""

from .config import CheckpointError
from .engine import SAMPLE_RATE, Engine, Metrics, Speech
from .errors import RequestError
from .options import StreamOptions, SynthesisOptions
from .sampling import SamplingOptions
from .segment import LongTextOptions, Segment
from .voices import Voice

__all__ = [
    "Engine",
    "Speech",
    "Metrics",
    "Segment",
    "SynthesisOptions",
    "StreamOptions",
    "LongTextOptions",
    "SamplingOptions",
    "Voice",
    "CheckpointError",
    "RequestError",
    "SAMPLE_RATE",
]
__version__ = "0.1.0"
