"""The vocoder's causal convolutions, in the layouts they run fastest in, and its SnakeBeta.

Scope: `CausalConv` and `TransConv` (channel-major, up to the upsampling), `TimeMajorConv` and
`TimeMajorTransConv` (time-major, the SnakeBeta decoder), each carrying the inputs the next chunk
needs in a tail (a slot of `VocoderState.tails`, kazeia/vocoder.py), so any split of a stream into
chunks gives the same outputs; `SnakeBeta`, fused into the next conv's input where it precedes one.
Tensors only. Why each layout and threshold was chosen, with figures: docs/design.md ("Vocoder").

Shapes: B = batch, L = positions of a call, C = channels; a conv with k taps, dilation d carries
keep = (k - 1) * d inputs; a transposed conv with stride s, k = taps * s carries taps - 1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .matmul import LINEAR_POINTWISE, pack_weight

SNAKE_EPS = 1e-9
# Inputs per call from which a transposed conv runs as one polyphase conv (`TimeMajorTransConv`):
# below it, the conv's per-call weight reorder costs more than its faster arithmetic saves.
POLYPHASE_MIN_POSITIONS = 256
# A conv whose weight has this many times more values than its input runs as a matrix product
# over its k-tap windows (`TimeMajorConv`): the conv would reorder the weight on every call.
GEMM_MIN_WEIGHT_RATIO = 64
# Where oneDNN packs matmul weights, a decoder conv or transposed conv with at least this many
# weights, and every 1x1 conv, runs as one product on its packed weight (`pack`) at every call:
# measured on each of the vocoder's at 1, 4 and 32 frames a call, that is then as fast or faster
# (up to 10x for the first conv in 4-frame chunks); the smaller k-tap ones stay oneDNN convs,
# faster from 4 frames on (docs/design.md).
PACK_MIN_WEIGHTS = 2_000_000


def packs_best(module: nn.Module) -> bool:
    """Does `module` (a TimeMajorConv or TimeMajorTransConv) run fastest on a packed weight?"""
    cin, cout, k = module.shape
    return cin * cout * k >= PACK_MIN_WEIGHTS or (isinstance(module, TimeMajorConv) and k == 1)


class CausalConv(nn.Module):
    """Conv1d whose (k-1)*d left inputs come from the tail: zeros at the start (the reference's pad)."""

    def __init__(self, cin: int, cout: int, kernel: int, dilation: int = 1, groups: int = 1):
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, dilation=dilation, groups=groups)
        self.keep = (kernel - 1) * dilation  # inputs carried to the next chunk
        self.slot = -1  # index into VocoderState.tails, set by Vocoder

    def forward(self, x: torch.Tensor, tails: list[torch.Tensor]) -> torch.Tensor:
        """x (B, C_in, L) -> (B, C_out, L)."""
        if self.keep == 0:
            return self.conv(x)
        x = torch.cat((tails[self.slot], x), dim=-1)  # (B, C_in, keep + L)
        tails[self.slot] = x[..., -self.keep :].clone()
        return self.conv(x)

    def new_tail(self, batch: int, **like) -> torch.Tensor:
        return torch.zeros(batch, self.conv.in_channels, self.keep, **like)


def overlap_add(spread: torch.Tensor, keep: int, length: int, cout: int, taps: int, stride: int) -> torch.Tensor:
    """A transposed conv's outputs from each input's spread of k = taps * s outputs:
    spread (B, keep + L, C_out * k) time-major -> (B, L, C_out, s), input t's s outputs in row t."""
    B = spread.shape[0]
    spread = spread.view(B, -1, cout, taps, stride)  # (B, keep + L, C_out, taps, s)
    y = spread[:, keep:, :, 0]
    for tap in range(1, taps):  # input t - tap adds its tap-th block of s outputs
        y = y + spread[:, keep - tap : keep - tap + length, :, tap]
    return y


class TransConv(nn.Module):
    """ConvTranspose1d(k, stride s) cut to exactly L*s outputs, the reference's right-only trim.

    Output m depends on inputs m//s back to m//s - (ceil(k/s) - 1), so the tail keeps that many
    previous inputs: one for k = 2s, none for k = s.
    """

    def __init__(self, cin: int, cout: int, kernel: int, stride: int):
        super().__init__()
        self.conv = nn.ConvTranspose1d(cin, cout, kernel, stride=stride)
        self.stride = stride
        self.keep = -(-kernel // stride) - 1
        self.slot = -1

    def forward(self, x: torch.Tensor, tails: list[torch.Tensor]) -> torch.Tensor:
        """x (B, C_in, L) -> (B, C_out, L*s).

        One matrix product over the inputs (each spreads k outputs) and an `overlap_add` of the
        `keep` previous inputs' spill-over: the sums of ConvTranspose1d, without its slow
        small-input kernel on the CPU.
        """
        B, _, L = x.shape
        s, (cin, cout, k) = self.stride, self.conv.weight.shape
        if self.keep > 0:
            x = torch.cat((tails[self.slot], x), dim=-1)  # (B, C_in, keep + L)
            tails[self.slot] = x[..., -self.keep :].clone()
        spread = torch.matmul(x.transpose(1, 2), self.conv.weight.reshape(cin, cout * k))  # (B, keep + L, C_out*k)
        y = overlap_add(spread, self.keep, L, cout, k // s, s)
        y = y.permute(0, 2, 1, 3).reshape(B, cout, L * s)  # (B, C_out, L*s), a fresh copy
        return y.add_(self.conv.bias[:, None])

    def new_tail(self, batch: int, **like) -> torch.Tensor:
        return torch.zeros(batch, self.conv.in_channels, self.keep, **like)


def _time_major_input(x: torch.Tensor, tails: list[torch.Tensor], slot: int, keep: int, act: SnakeBeta | None):
    """(B, keep + L, C): the `keep` positions carried in tails[slot], then act(x) (or x), written
    straight into one buffer; its last `keep` positions become the new tail. With nothing
    carried (keep = 0): act(x), or x."""
    if keep == 0:
        return x if act is None else act(x)
    B, L, C = x.shape
    padded = x.new_empty(B, keep + L, C)
    padded[:, :keep] = tails[slot]
    if act is None:
        padded[:, keep:] = x
    else:
        act(x, out=padded[:, keep:])
    tails[slot] = padded[:, -keep:].clone()
    return padded


class _TimeMajorTail:
    """The carried inputs of a time-major conv: (B, keep, C_in)."""

    keep: int
    conv: nn.Module

    def new_tail(self, batch: int, **like) -> torch.Tensor:
        return torch.zeros(batch, self.keep, self.conv.in_channels, **like)


class TimeMajorConv(_TimeMajorTail, CausalConv):
    """`CausalConv` on time-major activations, (B, L, C_in) -> (B, L, C_out), of act(x) when given.

    Runs as a (1 x k) conv2d on the channels-last view of x, with no copy in or out: oneDNN's
    convolutions are faster in that layout. `store_for_reading` stores the weight in that layout
    too (same shape and values), else PyTorch copies it so on every call. After `pack`, and for a
    weight much larger than the call's input (GEMM_MIN_WEIGHT_RATIO), it is instead one matrix
    product over the k-tap windows, as the conv would reorder the weight on every call.
    """

    def __init__(self, cin: int, cout: int, kernel: int, dilation: int = 1):
        super().__init__(cin, cout, kernel, dilation)
        self.register_buffer("packed", None, persistent=False)  # (C_out, k*C_in) packed, after `pack`

    @property
    def shape(self) -> tuple[int, int, int]:
        """(C_in, C_out, k), also once `pack` has dropped conv.weight."""
        return self.conv.in_channels, self.conv.out_channels, self.conv.kernel_size[0]

    def forward(self, x: torch.Tensor, tails: list[torch.Tensor], act: SnakeBeta | None = None) -> torch.Tensor:
        x = _time_major_input(x, tails, self.slot, self.keep, act)  # (B, keep + L, C_in)
        conv, (B, positions, _) = self.conv, x.shape
        if self.packed is not None:
            y = LINEAR_POINTWISE(self._windows(x), self.packed, conv.bias, "none", [], "")
            return y.view(B, positions - self.keep, conv.out_channels)
        cout, cin, k = conv.weight.shape
        if conv.weight.numel() >= GEMM_MIN_WEIGHT_RATIO * x.numel():
            # The weight, stored (C_out, k, C_in), is read in place, with no per-call reorder.
            y = torch.addmm(conv.bias, self._windows(x), conv.weight.transpose(1, 2).reshape(cout, k * cin).t())
            return y.view(B, positions - self.keep, cout)
        weight = conv.weight.unsqueeze(2)  # (C_out, C_in, 1, k); channels-last when stored (C_out, k, C_in)
        y = F.conv2d(x.transpose(1, 2).unsqueeze(2), weight, conv.bias, dilation=(1, conv.dilation[0]))
        return y.squeeze(2).transpose(1, 2)  # (B, L, C_out)

    def _windows(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, keep + L, C_in) -> its L k-tap windows (B * L, k * C_in): a strided view, copied once."""
        (B, positions, cin), (k, d) = x.shape, (self.conv.kernel_size[0], self.conv.dilation[0])
        x, L = x.contiguous(), positions - self.keep
        if k == 1:
            return x.view(B * L, cin)
        return x.as_strided((B, L, k, cin), (x.stride(0), cin, d * cin, 1)).reshape(B * L, k * cin)

    @torch.no_grad()
    def pack(self) -> None:
        """Put the weight, as the (C_out, k*C_in) matrix of the windows' product, in oneDNN's packed
        matmul layout (as `TimeMajorTransConv.pack`) in place of conv.weight: every call is then
        that product."""
        cin, cout, k = self.shape
        self.packed = pack_weight(self.conv.weight.transpose(1, 2).reshape(cout, k * cin))
        self.conv.weight = None

    def store_for_reading(self) -> None:
        """Store the weight (C_out, k, C_in), the order the conv reads (`Vocoder.load` does this)."""
        weight = self.conv.weight.detach()
        stored = weight.transpose(1, 2).contiguous().transpose(1, 2)  # a no-op when already so
        if stored.data_ptr() != weight.data_ptr():
            self.conv.weight = nn.Parameter(stored, requires_grad=False)


class TimeMajorTransConv(_TimeMajorTail, TransConv):
    """`TransConv` on time-major activations: (B, L, C_in) -> (B, L*s, C_out), of act(x) when given.

    With k = taps * s, output t*s + p is a k=taps convolution of inputs t - taps + 1 .. t with the
    weights of phase p. For calls of at least POLYPHASE_MIN_POSITIONS inputs it runs so, as one
    oneDNN conv with s * C_out output channels (phase-major) whose output is already in time order;
    shorter ones run as `TransConv` does (one product, an overlap-add). After `pack` (Vocoder.load,
    where `packs_best`), every call is that product, on a weight packed for oneDNN's matmul.
    """

    def __init__(self, cin: int, cout: int, kernel: int, stride: int):
        super().__init__(cin, cout, kernel, stride)
        self.register_buffer("packed", None, persistent=False)  # (C_out*k, C_in) packed, after `pack`

    @property
    def shape(self) -> tuple[int, int, int]:
        """conv.weight's (C_in, C_out, k), also once `pack` has dropped it."""
        return self.conv.in_channels, self.conv.out_channels, self.conv.kernel_size[0]

    @torch.no_grad()
    def pack(self) -> None:
        """Put the weight in oneDNN's packed matmul layout (CPU, float32 or bfloat16; see
        `matmul.can_pack`) in place of conv.weight; the polyphase path, which needs the original,
        is then off."""
        cin, cout, k = self.shape
        weight = self.conv.weight.reshape(cin, cout * k).t()  # (C_out*k, C_in), a Linear's (a view: no copy)
        self.packed = pack_weight(weight)
        self.conv.weight = None

    def forward(self, x: torch.Tensor, tails: list[torch.Tensor], act: SnakeBeta | None = None) -> torch.Tensor:
        B, L, _ = x.shape
        s, (cin, cout, k) = self.stride, self.shape
        x = _time_major_input(x, tails, self.slot, self.keep, act)  # (B, keep + L, C_in)
        taps = k // s
        if self.packed is not None:
            spread = LINEAR_POINTWISE(x.reshape(-1, cin), self.packed, None, "none", [], "").view(B, -1, cout * k)
        elif L >= POLYPHASE_MIN_POSITIONS and taps * s == k:
            # weight[c_in, c_out, tap*s + p] for input t - tap -> kernel (s*C_out, C_in, 1, taps),
            # kernel position j = keep - tap, in the channels-last layout the conv reads
            w = self.conv.weight.view(cin, cout, taps, s).permute(3, 1, 0, 2).flip(-1)  # (s, C_out, C_in, taps)
            w = w.reshape(s * cout, cin, 1, taps).contiguous(memory_format=torch.channels_last)
            y = F.conv2d(x.transpose(1, 2).unsqueeze(2), w, self.conv.bias.repeat(s))  # (B, s*C_out, 1, L)
            return y.squeeze(2).transpose(1, 2).reshape(B, L * s, cout)
        else:
            spread = torch.matmul(x, self.conv.weight.reshape(cin, cout * k))  # (B, keep + L, C_out*k)
        y = overlap_add(spread, self.keep, L, cout, taps, s)
        y = y.transpose(2, 3).reshape(B, L * s, cout)  # (B, L*s, C_out), a fresh copy
        return y.add_(self.conv.bias)


class SnakeBeta(nn.Module):
    """x + sin(x·e^α)² / (e^β + 1e-9) per channel; α and β are stored as logs. Time-major.

    `lib`: kazeia/native's library, set when the vocoder is loaded on the CPU (float32): one pass
    of its `snake_beta` (on torch's thread count) instead of five PyTorch passes, as accurate
    against float64. None: the PyTorch passes."""

    def __init__(self, dim: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(dim))
        self.beta = nn.Parameter(torch.zeros(dim))
        self.lib = None

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, L, C) -> (B, L, C), written into `out` (same shape; may be a window of a wider
        buffer) when given."""
        if self.lib is not None and _native_snake(x, out, self.alpha, self.beta):
            out = torch.empty_like(x) if out is None else out
            B, L, C = x.shape
            failed = self.lib.snake_beta(x.data_ptr(), out.data_ptr(), self.alpha.data_ptr(), self.beta.data_ptr(),
                                         B, L, C, x.stride(0), out.stride(0), torch.get_num_threads())  # fmt: skip
            if failed:
                raise MemoryError("snake_beta: out of memory")
            return out
        # x + 1/(β+eps) · sin(x·α)², in place on one temporary (fewer passes over 24 kHz activations)
        alpha = self.alpha.exp()
        s = torch.mul(x, alpha, out=out) if out is not None else x * alpha
        s.sin_()
        s.mul_(s).mul_(1.0 / (self.beta.exp() + SNAKE_EPS))
        return s.add_(x)


def _native_snake(x: torch.Tensor, out: torch.Tensor | None, *params: torch.Tensor) -> bool:
    """Can `snake_beta` take these: float32 CPU (B, L, C) tensors whose positions are contiguous
    rows within each batch entry, and contiguous float32 parameters?"""
    for t in (x,) if out is None else (x, out):
        if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 3:
            return False
        if t.stride(2) != 1 or (t.shape[1] > 1 and t.stride(1) != t.shape[2]):
            return False
    return all(p.dtype == torch.float32 and p.device.type == "cpu" and p.is_contiguous() for p in params)
