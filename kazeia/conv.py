"""The vocoder's causal convolutions, its products and SnakeBeta, on time-major activations.

Scope: `TimeMajorConv` (a causal convolution: the decoder's, the pre-conv, the codebooks' 1x1
projection), `TimeMajorTransConv` (a transposed convolution in its polyphase form: the upsampling
and the decoder blocks'), `Depthwise` (ConvNeXt's), each carrying the inputs the next chunk needs
in a tail (a slot of `VocoderState.tails`, kazeia/vocoder.py); `SnakeBeta`, fused into the next
conv's input; `Tiled` and `TiledLinear`, the native products, and `Tiled8`, the int8 one. Tensors only.

Two implementations, chosen once when the vocoder is loaded (`Vocoder.prepare`):

* native (the CPU, with kazeia/native): every product is conv.c's `vconv`, whose every output
  value is the same sum in the same order whatever the call (its chunk, its number of positions,
  the thread count), so any split of a stream into chunks gives the same bits; the depthwise
  convolution and SnakeBeta are vocoder.c's, computed value by value. Activations are float32;
  the weights hold the values of the vocoder's dtype. An int8 vocoder's chosen convolutions are
  conv8.c's `vconv8` instead (`Tiled8`): integer products, each input row quantized alone, so
  chunking still never changes a bit.
* eager (other devices, or no native library): PyTorch's convolutions, which choose their
  blocking by the call's shape, so chunkings agree to float rounding only.

Shapes: B = batch, L = positions of a call, C = channels; a conv with k taps, dilation d carries
keep = (k - 1) * d inputs; a transposed conv with stride s, k = taps * s carries taps - 1.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu
from .products import address

SNAKE_EPS = 1e-9
# How `Tiled` packs a weight (kazeia/native/conv.c's `format`)
FLOAT32, PAIRS_BF16, NARROW_BF16 = 0, 1, 2


class Tiled(nn.Module):
    """A convolution's weight packed for conv.c's `vconv`, and its call.

    weight (N, taps, C_in) (output n, input row t + tap * d, channel c), bias (N,) or None; packed
    once here, as float32 (a float16 vocoder's keep their rounding) unless:

    * `half`: the weight's values are bfloat16 ones (a bfloat16 vocoder). Where the build has
      bfloat16 pair dot products (AVX512_BF16) they are packed so and the inputs rounded to bfloat16
      (PAIRS_BF16), else stored as bfloat16 and widened as read (NARROW_BF16: the bits of float32,
      half the bytes).
    * `narrow`: the weights rounded to bfloat16 and stored so, widened to float32 as read, on every
      build (NARROW_BF16): the float32 product of the rounded weights, bit for bit, at half the
      bytes. For products that read far more weights than they multiply (an int8 vocoder's).

    Every output value is one multiply-add chain over tap-major k, then + bias, then + res: the same
    bits whatever the positions, batch or threads of a call (kazeia/native/conv.c).
    """

    def __init__(
        self,
        lib: ctypes.CDLL,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        dilation: int = 1,
        half: bool = False,
        narrow: bool = False,
    ):
        super().__init__()
        self.lib, self.dilation = lib, dilation
        self.n, self.taps, self.cin = weight.shape
        if half and not narrow and lib.vconv_pairs(self.cin):
            self.format = PAIRS_BF16
        else:
            self.format = NARROW_BF16 if half or narrow else FLOAT32
        rows = weight.detach().float().reshape(self.n, self.taps * self.cin).contiguous()
        packed = torch.empty(lib.vconv_packed_bytes(self.n, rows.shape[1], self.format), dtype=torch.uint8)
        lib.vconv_pack(rows.data_ptr(), self.n, rows.shape[1], self.format, packed.data_ptr())
        self.register_buffer("weight", packed, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous(), persistent=False)

    def forward(self, x: torch.Tensor, res: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, keep + L, C_in) float32 -> (B, L, N), + res (B, L, N) when given."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        if res is not None and res.stride(-1) != 1:
            res = res.contiguous()
        B, rows, _ = x.shape
        L = rows - (self.taps - 1) * self.dilation
        y = x.new_empty(B, L, self.n)
        res_strides = (0, 0) if res is None else (res.stride(0), res.stride(1))
        failed = self.lib.vconv(x.data_ptr(), x.stride(0), x.stride(1), self.weight.data_ptr(), address(self.bias),
                                address(res), *res_strides, y.data_ptr(), y.stride(0), y.stride(1), B, L, self.cin,
                                self.n, self.taps, self.dilation, self.format, cpu.stage_team())  # fmt: skip
        if failed == -2:
            raise MemoryError("vconv: out of memory")
        if failed:
            raise ValueError(f"vconv refused a ({B}, {rows}, {self.cin}) input for {tuple(self.shape)}")
        return y

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.n, self.taps, self.cin


class Tiled8(nn.Module):
    """A convolution as conv8.c's `vconv8`: int8 weights (a scale per output channel), each input
    row quantized to int8 alone (a scale per time step), exact integer sums, float32 out.

    weight (N, taps, C_in), bias (N,) or None: quantized and packed once here. An input row's codes
    depend on that row only and the float steps after the sums are one fixed sequence, so every
    output value has the same bits whatever the positions, batch or threads of a call, and on every
    kernel (AVX-512 VNNI, AVX2, portable C; kazeia/native/conv8.c).
    """

    def __init__(self, lib: ctypes.CDLL, weight: torch.Tensor, bias: torch.Tensor | None, dilation: int = 1):
        super().__init__()
        self.lib, self.dilation = lib, dilation
        self.n, self.taps, self.cin = weight.shape
        rows = weight.detach().float().contiguous()
        packed = torch.empty(lib.vconv8_packed_bytes(self.n, self.taps, self.cin), dtype=torch.uint8)
        lib.vconv8_pack(rows.data_ptr(), self.n, self.taps, self.cin, packed.data_ptr())
        self.register_buffer("weight", packed, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous(), persistent=False)

    def forward(self, x: torch.Tensor, res: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, keep + L, C_in) float32 -> (B, L, N), + res (B, L, N) when given."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        if res is not None and res.stride(-1) != 1:
            res = res.contiguous()
        B, rows, _ = x.shape
        L = rows - (self.taps - 1) * self.dilation
        if L < 0:
            raise ValueError(f"vconv8 refused a ({B}, {rows}, {self.cin}) input: fewer rows than the taps carry")
        y = x.new_empty(B, L, self.n)
        res_strides = (0, 0) if res is None else (res.stride(0), res.stride(1))
        failed = self.lib.vconv8(x.data_ptr(), x.stride(0), x.stride(1), self.weight.data_ptr(), address(self.bias),
                                 address(res), *res_strides, y.data_ptr(), y.stride(0), y.stride(1), B, L, self.cin,
                                 self.n, self.taps, self.dilation, cpu.stage_team())  # fmt: skip
        if failed == -2:
            raise MemoryError("vconv8: out of memory")
        if failed:
            raise ValueError(f"vconv8 refused a ({B}, {rows}, {self.cin}) input for {(self.n, self.taps, self.cin)}")
        return y


class TiledLinear(nn.Module):
    """A Linear's product as a 1-tap `Tiled` (`half`, `narrow`: see there): x (..., in) -> (..., out), float32."""

    def __init__(self, lib: ctypes.CDLL, linear: nn.Linear, half: bool = False, narrow: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.tiled = Tiled(lib, linear.weight[:, None, :], linear.bias, half=half, narrow=narrow)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tiled(x.reshape(1, -1, self.in_features)).view(*x.shape[:-1], self.out_features)


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


class CausalConv(nn.Module):
    """A Conv1d whose (k-1)*d left inputs come from the tail: zeros at the start (the reference's
    pad). The parameters of the time-major convolutions below, under the reference's names."""

    def __init__(self, cin: int, cout: int, kernel: int, dilation: int = 1, groups: int = 1):
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, dilation=dilation, groups=groups)
        self.keep = (kernel - 1) * dilation  # inputs carried to the next chunk
        self.slot = -1  # index into VocoderState.tails, set by Vocoder

    def new_tail(self, batch: int, **like) -> torch.Tensor:
        """The carried inputs at the start of a stream: (B, keep, C_in) zeros."""
        return torch.zeros(batch, self.keep, self.conv.in_channels, **like)


class TimeMajorConv(CausalConv):
    """A causal convolution of act(x) (or x) on time-major activations, (B, L, C_in) -> (B, L, C_out).

    Eager: a (1 x k) conv2d on the channels-last view of x, no copy in or out (oneDNN's fastest
    layout); `store_for_reading` stores the weight in that layout too (same shape and values),
    else PyTorch copies it so on every call. Native: `Tiled` (`use_native`).
    """

    def __init__(self, cin: int, cout: int, kernel: int, dilation: int = 1):
        super().__init__(cin, cout, kernel, dilation)
        self.native: Tiled | Tiled8 | None = None

    @property
    def shape(self) -> tuple[int, int, int]:
        """(C_in, C_out, k), also once `use_native` has dropped conv.weight."""
        return self.conv.in_channels, self.conv.out_channels, self.conv.kernel_size[0]

    def forward(
        self, x: torch.Tensor, tails: list[torch.Tensor], act: SnakeBeta | None = None, res: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x (B, L, C_in) -> conv(act(x)) (B, L, C_out), + res (B, L, C_out) when given."""
        x = _time_major_input(x, tails, self.slot, self.keep, act)  # (B, keep + L, C_in)
        if self.native is not None:
            return self.native(x, res)
        weight = self.conv.weight.unsqueeze(2)  # (C_out, C_in, 1, k); channels-last when stored (C_out, k, C_in)
        y = F.conv2d(x.transpose(1, 2).unsqueeze(2), weight, self.conv.bias, dilation=(1, self.conv.dilation[0]))
        y = y.squeeze(2).transpose(1, 2)  # (B, L, C_out)
        return y if res is None else y.add_(res)

    def store_for_reading(self) -> None:
        """Store the weight (C_out, k, C_in), the order the eager conv reads (`Vocoder.prepare`)."""
        weight = self.conv.weight.detach()
        stored = weight.transpose(1, 2).contiguous().transpose(1, 2)  # a no-op when already so
        if stored.data_ptr() != weight.data_ptr():
            self.conv.weight = nn.Parameter(stored, requires_grad=False)

    @torch.no_grad()
    def use_native(self, lib: ctypes.CDLL, half: bool = False, keep_weight: bool = False, int8: bool = False) -> None:
        """Run as `Tiled` (`half`: see there), or `Tiled8` where `int8`, from now on; conv.weight is
        dropped unless `keep_weight`."""
        weight = self.conv.weight.permute(0, 2, 1)  # (C_out, k, C_in)
        if int8:
            self.native = Tiled8(lib, weight, self.conv.bias, self.conv.dilation[0])
        else:
            self.native = Tiled(lib, weight, self.conv.bias, self.conv.dilation[0], half)
        if not keep_weight:
            self.conv.weight = None


class TimeMajorTransConv(nn.Module):
    """ConvTranspose1d(k, stride s) cut to exactly L*s outputs (the reference's right-only trim),
    of act(x) (or x) on time-major activations: (B, L, C_in) -> (B, L*s, C_out).

    Polyphase: with k = taps * s, output t*s + p is a taps-tap convolution of inputs t - taps + 1
    .. t with the weights of phase p, so the whole is one causal convolution with s * C_out
    output channels (phase-major), whose time-major output is already in time order. Eager: a
    conv2d; native: `Tiled` (`use_native`).
    """

    def __init__(self, cin: int, cout: int, kernel: int, stride: int):
        super().__init__()
        self.conv = nn.ConvTranspose1d(cin, cout, kernel, stride=stride)
        self.stride, self.taps = stride, -(-kernel // stride)
        self.keep = self.taps - 1  # inputs carried to the next chunk
        self.slot = -1
        self.native: Tiled | None = None

    @property
    def shape(self) -> tuple[int, int, int]:
        """conv.weight's (C_in, C_out, k), also once `use_native` has dropped it."""
        return self.conv.in_channels, self.conv.out_channels, self.conv.kernel_size[0]

    def polyphase(self) -> torch.Tensor:
        """The weight as a convolution's: (s * C_out, taps, C_in), output p * C_out + n, tap j on
        input t - (taps - 1) + j, i.e. the transposed conv's kernel position (taps - 1 - j) * s + p."""
        (cin, cout, k), s = self.shape, self.stride
        weight = F.pad(self.conv.weight, (0, self.taps * s - k))  # (C_in, C_out, taps * s)
        weight = weight.view(cin, cout, self.taps, s).permute(3, 1, 2, 0).flip(2)  # (s, C_out, taps, C_in)
        return weight.reshape(s * cout, self.taps, cin)

    def forward(self, x: torch.Tensor, tails: list[torch.Tensor], act: SnakeBeta | None = None) -> torch.Tensor:
        B, L, _ = x.shape
        x = _time_major_input(x, tails, self.slot, self.keep, act)  # (B, keep + L, C_in)
        if self.native is not None:
            y = self.native(x)  # (B, L, s * C_out)
        else:
            weight = self.polyphase().transpose(1, 2).unsqueeze(2)  # (s * C_out, C_in, 1, taps)
            weight = weight.contiguous(memory_format=torch.channels_last)
            y = F.conv2d(x.transpose(1, 2).unsqueeze(2), weight, self.conv.bias.repeat(self.stride))
            y = y.squeeze(2).transpose(1, 2)  # (B, L, s * C_out)
        return y.reshape(B, L * self.stride, self.shape[1])

    def new_tail(self, batch: int, **like) -> torch.Tensor:
        return torch.zeros(batch, self.keep, self.conv.in_channels, **like)

    @torch.no_grad()
    def use_native(self, lib: ctypes.CDLL, half: bool = False) -> None:
        """Run as `Tiled` on the polyphase weight (`half`: see there) from now on; conv.weight is dropped."""
        self.native = Tiled(lib, self.polyphase(), self.conv.bias.repeat(self.stride), half=half)
        self.conv.weight = None


class Depthwise(CausalConv):
    """A causal depthwise convolution (one filter per channel), time-major: (B, L, C) -> (B, L, C).
    Native: vocoder.c's `depthwise_conv`, each value a multiply-add chain over the taps."""

    def __init__(self, dim: int, kernel: int):
        super().__init__(dim, dim, kernel, groups=dim)
        self.lib: ctypes.CDLL | None = None
        self.register_buffer("taps", None, persistent=False)  # (k, C) float32, after `use_native`

    def forward(self, x: torch.Tensor, tails: list[torch.Tensor]) -> torch.Tensor:
        x = _time_major_input(x, tails, self.slot, self.keep, None)  # (B, keep + L, C)
        if self.lib is None:
            y = F.conv1d(x.transpose(1, 2), self.conv.weight, self.conv.bias, groups=self.conv.groups)
            return y.transpose(1, 2)
        B, rows, C = x.shape
        x, L = x.contiguous(), rows - self.keep
        y = x.new_empty(B, L, C)
        taps, bias = self.taps, self.conv.bias
        self.lib.depthwise_conv(x.data_ptr(), x.stride(0), taps.data_ptr(), bias.data_ptr(), y.data_ptr(),
                                y.stride(0), B, L, C, taps.shape[0], self.conv.dilation[0])  # fmt: skip
        return y

    @torch.no_grad()
    def use_native(self, lib: ctypes.CDLL) -> None:
        """Run as vocoder.c's `depthwise_conv` from now on (float32 parameters)."""
        self.lib = lib
        self.taps = self.conv.weight[:, 0].t().float().contiguous()  # (k, C)


class SnakeBeta(nn.Module):
    """x + sin(x·e^α)² / (e^β + 1e-9) per channel; α and β are stored as logs. Time-major.

    `lib`: kazeia/native's library, set when the vocoder is loaded on the CPU (float32): one pass
    of its `snake_beta` (on torch's thread count) instead of five PyTorch passes, as accurate
    against float64, each value computed alone. None: the PyTorch passes."""

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
                                         B, L, C, x.stride(0), out.stride(0), cpu.stage_team())  # fmt: skip
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
