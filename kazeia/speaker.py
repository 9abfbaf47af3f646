"""The speaker encoder of the Base checkpoints: 24 kHz audio -> x-vector (voice cloning).

Scope: the log-mel front end (reflect pad, STFT 1024/256 with a periodic Hann window, magnitude,
128 slaney mel bands up to 12 kHz, log of the clamped energies) and the ECAPA-TDNN network
(TDNN, SE-Res2Net blocks, multi-layer aggregation, attentive statistics pooling, projection to
the talker width), exactly as the reference computes them (spec §7.2). Tensors only; the mel
filterbank is computed here once with numpy (the test suite checks it against librosa's).
Non-goals: batches of unequal lengths, training.

Shapes: B = batch, C = channels, T = mel frames (one per 256 samples).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .checkpoint import assign, load_tensors
from .config import SpeakerEncoderConfig

N_FFT = 1024  # STFT size and Hann window length, samples at 24 kHz
HOP = 256  # samples between mel frames
N_MELS = 128
FMIN, FMAX = 0.0, 12000.0  # Hz, mel filterbank range
MAGNITUDE_EPS = 1e-9  # added to |STFT|^2 before the square root
LOG_FLOOR = 1e-5  # mel energies are clamped to this before the log
STATS_EPS = 1e-12  # variance floor of the attentive statistics pooling
RELEASED_PREFIX = "speaker_encoder."  # tensor names in model.safetensors


def mel_filterbank(sample_rate: int, n_fft: int, n_mels: int, fmin: float, fmax: float) -> np.ndarray:
    """(n_mels, n_fft // 2 + 1) float32 triangular filters on the slaney mel scale with slaney
    area normalisation, computed with the same float64 steps and float32 roundings as
    `librosa.filters.mel` (the reference's filterbank)."""
    freqs = np.fft.rfftfreq(n=n_fft, d=1.0 / sample_rate)
    mels = np.linspace(_hz_to_mel(fmin), _hz_to_mel(fmax), n_mels + 2)
    edges = _mel_to_hz(mels)  # (n_mels + 2,) Hz
    widths = np.diff(edges)
    ramps = np.subtract.outer(edges, freqs)
    weights = np.zeros((n_mels, len(freqs)), dtype=np.float32)
    for i in range(n_mels):
        lower = -ramps[i] / widths[i]
        upper = ramps[i + 2] / widths[i + 1]
        weights[i] = np.maximum(0, np.minimum(lower, upper))
    weights *= (2.0 / (edges[2 : n_mels + 2] - edges[:n_mels]))[:, None]
    return weights


_F_SP = 200.0 / 3  # Hz per mel below 1 kHz (slaney scale)
_MIN_LOG_HZ = 1000.0
_MIN_LOG_MEL = _MIN_LOG_HZ / _F_SP
_LOGSTEP = np.log(6.4) / 27.0  # log-spaced above 1 kHz


def _hz_to_mel(hz: float) -> float:
    return _MIN_LOG_MEL + np.log(hz / _MIN_LOG_HZ) / _LOGSTEP if hz >= _MIN_LOG_HZ else hz / _F_SP


def _mel_to_hz(mels: np.ndarray) -> np.ndarray:
    hz = _F_SP * mels
    log_part = mels >= _MIN_LOG_MEL
    hz[log_part] = _MIN_LOG_HZ * np.exp(_LOGSTEP * (mels[log_part] - _MIN_LOG_MEL))
    return hz


class LogMel(nn.Module):
    """audio (B, L) float32 at 24 kHz -> log-mel (B, 128, T), T = (L + 768 - 1024) // 256 + 1."""

    def __init__(self, sample_rate: int):
        super().__init__()
        self.sample_rate = sample_rate
        self.register_buffer("filters", torch.empty(N_MELS, N_FFT // 2 + 1), persistent=False)
        self.register_buffer("window", torch.empty(N_FFT), persistent=False)
        self.init_buffers()

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the derived buffers, e.g. after the module was built on the meta device."""
        filters = mel_filterbank(self.sample_rate, N_FFT, N_MELS, FMIN, FMAX)
        self.filters = torch.from_numpy(filters).to(device)
        self.window = torch.hann_window(N_FFT, device=device)

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        pad = (N_FFT - HOP) // 2
        audio = F.pad(audio[:, None], (pad, pad), mode="reflect")[:, 0]
        spec = torch.stft(
            audio, N_FFT, hop_length=HOP, win_length=N_FFT, window=self.window, center=False, return_complex=True
        )  # (B, 513, T)
        magnitude = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + MAGNITUDE_EPS)
        return torch.log(torch.clamp(torch.matmul(self.filters, magnitude), min=LOG_FLOOR))


def _conv(cin: int, cout: int, kernel: int = 1, dilation: int = 1) -> nn.Conv1d:
    """Conv1d with "same" reflect padding, as every conv of the network."""
    return nn.Conv1d(cin, cout, kernel, dilation=dilation, padding="same", padding_mode="reflect")


class TDNN(nn.Module):
    """relu(conv(x))."""

    def __init__(self, cin: int, cout: int, kernel: int = 1, dilation: int = 1):
        super().__init__()
        self.conv = _conv(cin, cout, kernel, dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(x))


class Res2Net(nn.Module):
    """Split the channels into `scale` groups; group i > 0 goes through a TDNN after adding the
    previous group's output (group 1 alone); group 0 passes through."""

    def __init__(self, dim: int, scale: int, kernel: int, dilation: int):
        super().__init__()
        self.scale = scale
        self.blocks = nn.ModuleList(TDNN(dim // scale, dim // scale, kernel, dilation) for _ in range(scale - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = list(torch.chunk(x, self.scale, dim=1))
        out = [parts[0], self.blocks[0](parts[1])]
        for i in range(2, self.scale):
            out.append(self.blocks[i - 1](parts[i] + out[-1]))
        return torch.cat(out, dim=1)


class SqueezeExcite(nn.Module):
    """Scale each channel by sigmoid(conv2(relu(conv1(time mean))))."""

    def __init__(self, dim: int, bottleneck: int):
        super().__init__()
        self.conv1 = _conv(dim, bottleneck)
        self.conv2 = _conv(bottleneck, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.conv2(F.relu(self.conv1(x.mean(dim=2, keepdim=True)))))  # (B, C, 1)
        return x * gate


class SERes2Net(nn.Module):
    """x + SE(tdnn2(Res2Net(tdnn1(x))))."""

    def __init__(self, cin: int, cout: int, scale: int, se: int, kernel: int, dilation: int):
        super().__init__()
        self.tdnn1 = TDNN(cin, cout)
        self.res2net_block = Res2Net(cout, scale, kernel, dilation)
        self.tdnn2 = TDNN(cout, cout)
        self.se_block = SqueezeExcite(cout, se)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x))))


def _statistics(x: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted mean and std over time: x (B, C, T), weights (B, C|1, T) summing to 1 -> (B, C) each."""
    mean = (weights * x).sum(2)
    std = torch.sqrt((weights * (x - mean[:, :, None]).pow(2)).sum(2).clamp(STATS_EPS))
    return mean, std


class StatsPooling(nn.Module):
    """Attentive statistics pooling: (B, C, T) -> (B, 2C, 1), attention from [x, mean, std]."""

    def __init__(self, dim: int, attention: int):
        super().__init__()
        self.tdnn = TDNN(3 * dim, attention)
        self.conv = _conv(attention, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[-1]
        uniform = torch.ones(x.shape[0], 1, T, dtype=x.dtype, device=x.device)
        mean, std = _statistics(x, uniform / uniform.sum(dim=2, keepdim=True))
        context = torch.cat((x, mean[:, :, None].repeat(1, 1, T), std[:, :, None].repeat(1, 1, T)), dim=1)
        attention = F.softmax(self.conv(torch.tanh(self.tdnn(context))), dim=2)  # (B, C, T)
        mean, std = _statistics(x, attention)
        return torch.cat((mean, std), dim=1)[:, :, None]


class SpeakerEncoder(nn.Module):
    """audio (B, L) at 24 kHz -> x-vectors (B, enc_dim), float32."""

    def __init__(self, cfg: SpeakerEncoderConfig):
        super().__init__()
        ch, k, d = cfg.channels, cfg.kernel_sizes, cfg.dilations
        self.cfg = cfg
        self.mel = LogMel(cfg.sample_rate)
        blocks: list[nn.Module] = [TDNN(cfg.mel_dim, ch[0], k[0], d[0])]
        for i in range(1, len(ch) - 1):
            blocks.append(SERes2Net(ch[i - 1], ch[i], cfg.res2net_scale, cfg.se_channels, k[i], d[i]))
        self.blocks = nn.ModuleList(blocks)
        self.mfa = TDNN(sum(ch[1:-1]), ch[-1], k[-1], d[-1])
        self.asp = StatsPooling(ch[-1], cfg.attention_channels)
        self.fc = _conv(2 * ch[-1], cfg.enc_dim)

    @classmethod
    def load(cls, cfg: SpeakerEncoderConfig, path: Path, device: torch.device | str = "cpu") -> SpeakerEncoder:
        """Build on the meta device and load the `speaker_encoder.*` tensors of `model.safetensors`
        strictly, in float32 (a missing one is a CheckpointError naming it)."""
        with torch.device("meta"):
            encoder = cls(cfg)
        tensors = speaker_tensors(load_tensors(path))
        released = lambda name: RELEASED_PREFIX + name  # noqa: E731
        assign(encoder, tensors, str(path), device=device, dtype=torch.float32, released_name=released)
        return encoder.eval()

    def mel_frames(self, samples: int) -> int:
        """Mel frames of `samples` samples of audio."""
        return (samples + 2 * ((N_FFT - HOP) // 2) - N_FFT) // HOP + 1

    @torch.inference_mode()
    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        x = self.mel(audio.float())  # (B, 128, T)
        outputs = []
        for block in self.blocks:
            x = block(x)
            outputs.append(x)
        x = self.mfa(torch.cat(outputs[1:], dim=1))  # (B, C_mfa, T)
        return self.fc(self.asp(x))[:, :, 0]


def speaker_tensors(released: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """model.safetensors tensors -> `SpeakerEncoder` state_dict names (the `speaker_encoder.` ones, prefix stripped)."""
    n = len(RELEASED_PREFIX)
    return {name[n:]: tensor for name, tensor in released.items() if name.startswith(RELEASED_PREFIX)}
