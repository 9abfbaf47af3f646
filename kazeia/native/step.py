"""The decoding step of a decoder stack (the talker's, the code predictor's) with the glue between
its products in C: `StackStep`, chosen once per stack when the model is loaded (`stack_step`).

One layer is: the fused q/k/v product, `attend` (q/k norm, rotation, KV-cache write, attention over
the cache), the output product, `add_rms_norm`, the fused gate/up product, `silu_mul`, the down
product, `add_rms_norm` (which also applies the next layer's input norm, or the final one).

Three implementations of a decoder layer exist, with one contract: the same inputs (activations,
cache, positions) give the hidden state of `layers.Block` for each position, written into the same
caches. (1) The eager layers (`layers.Decoder`): PyTorch operations, for prompts (many positions,
torch's threads) where the products are not Kazeia's own, and where nothing native applies.
(2) `StackStep._run`: the C glue above, called
from Python layer by layer, with the products as Python callables (any kind, stock ones included).
(3) `StackStep._run_whole`: the whole stack in one call of stack.c, where every product is native
(`products.product_spec`); the same kernels in the same order as (2), so the same bits; it exists
because a step of ~100 layers made ~8 Python calls a layer in (2). (2) and (3) agree with (1)
within float rounding (tests/test_native.py runs all three on one input).

Several requests step at once (`StackStep.batch`, for kazeia/frame.py): their rows go through each
product together, which needs the products' row-independent forms (`products.row_product`); each
request attends over its own cache at its own position.

Prompts run in (3) too where every product splits a prompt's rows over the calling thread's team
itself (int4, native int8: `products.own_threads`), their attention split the same way: a prompt's
glue in C instead of ~25 PyTorch operations a layer on one thread (benchmarks/first_audio.py's
3-sentence prompt, 56 positions after the voice's, on a 2-vCPU Zen 4, p50 of 15 in turns: int4
326 -> 230 ms, int8 329 -> 232 ms). Stacks of other products (the float GEMV, PyTorch's) keep the
eager layers for prompts: their products are made for one or two rows. Non-goal: building the
library (build.py).
"""

from __future__ import annotations

import ctypes

import torch

from .. import cpu
from ..products import NATIVE_DTYPES, ProductSpec, check, own_threads, product_spec, row_product


class Layer(ctypes.Structure):
    """stack.c's layer: its four products and the addresses of its norms' weights."""

    _fields_ = [
        ("qkv", ProductSpec),
        ("o", ProductSpec),
        ("gate_up", ProductSpec),
        ("down", ProductSpec),
        ("qk_w", ctypes.c_void_p),
        ("post_w", ctypes.c_void_p),
        ("next_w", ctypes.c_void_p),
    ]


# Positions a native step takes at once: one, or the code predictor's two-position first step of
# each frame (otherwise ~125 PyTorch operations per frame); any number in a stack that runs prompts
# (`StackStep.prompts`).
MAX_POSITIONS = 2


class StackStep:
    """One position (or up to MAX_POSITIONS) through a stack of fused `layers.Block`s and its final
    norm, for one request (`__call__`) or several (`batch`), in the activation dtype it was built for.

    Built once per stack when the model is loaded (`stack_step`); holds the norms' weights and the
    products, so it describes the weights of that moment. Products' inputs are (rows, features)
    buffers of T rows a request (one per position) that the C code writes.
    """

    def __init__(self, lib: ctypes.CDLL, layers, norm, dtype: torch.dtype):
        self.lib, self.dtype, self.dt = lib, dtype, NATIVE_DTYPES[dtype]
        first = layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = first.heads, first.kv_heads, first.head_dim
        self.hidden = layers[0].mlp.down_proj.out_features
        self.inner = layers[0].mlp.down_proj.in_features
        self.eps = layers[0].input_layernorm.eps
        self.qk_eps = first.q_norm.eps
        norms = [layer.input_layernorm.weight for layer in layers] + [norm.weight]
        self.keep = []  # the tensors whose addresses are held below
        self.first_norm = self._address(norms[0])
        products = [(layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
                    for layer in layers]  # fmt: skip
        self.layers = self._layers(layers, products, norms)  # the modules' own products, one request
        # Several requests' rows at once: each product's row-independent form, or None where some
        # product has none (a frame step then runs that model's requests one by one: kazeia/frame.py).
        rows = [[row_product(p) for p in four] for four in products]
        complete = all(f is not None for four in rows for f in four)
        self.batch_layers = self._layers(layers, rows, norms) if complete else None
        # The whole step in one call (stack.c) where every product is native in these activations:
        # the same kernels as `layers` and `batch_layers`, in the same order.
        self.whole = self._whole(layers, products, norms)
        # Prompts too (module docstring): stack.c with products that split many rows themselves.
        self.prompts = self.whole is not None and all(own_threads(p) for four in products for p in four)

    def _whole(self, layers, products, norms):
        """stack.c's layers (a ctypes array), or None where some product is not native here."""
        specs = [[product_spec(p, self.dtype) for p in four] for four in products]
        if not all(spec is not None for four in specs for spec in four):
            return None
        made = (Layer * len(layers))()
        for i, (layer, four) in enumerate(zip(layers, specs, strict=True)):
            made[i].qkv, made[i].o, made[i].gate_up, made[i].down = four
            made[i].qk_w = self._address(layer.self_attn.qk_norm_weight)
            made[i].post_w = self._address(layer.post_attention_layernorm.weight)
            made[i].next_w = self._address(norms[i + 1])
        self.keep.extend(p for four in products for p in four)  # the modules whose weights it addresses
        return made

    def _layers(self, layers, products, norms) -> list[tuple]:
        """Per layer: its four products (callables of an input buffer) and the addresses of its
        norm weights, in the order `_run` takes them."""
        out = []
        for i, (layer, (qkv, o_proj, gate_up, down)) in enumerate(zip(layers, products, strict=True)):
            qk_w = self._address(layer.self_attn.qk_norm_weight)
            post_w = self._address(layer.post_attention_layernorm.weight)
            out.append((qkv, qk_w, o_proj, post_w, gate_up, down, self._address(norms[i + 1])))
        return out

    def _address(self, t: torch.Tensor) -> int:
        if t.dtype != self.dtype or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"expected a contiguous CPU {self.dtype} tensor, got {t.dtype} {tuple(t.shape)}")
        self.keep.append(t)
        return t.data_ptr()

    def applies(self, x: torch.Tensor, cache) -> bool:
        """One sequence at 1..MAX_POSITIONS positions (any number where `prompts`) in this step's
        dtype, over float32 caches."""
        return (
            x.shape[0] == 1
            and 1 <= x.shape[1]
            and (x.shape[1] <= MAX_POSITIONS or self.prompts)
            and x.dtype == self.dtype
            and cache[0].k.dtype == torch.float32
            and cache[0].k.shape[0] == 1
        )

    def __call__(self, x: torch.Tensor, rope, cache, start: int, last: bool = False) -> torch.Tensor:
        """x (1, T, H) at positions [start, start + T) -> final-normed hidden (1, T, H), or (1, 1, H)
        for the last position alone where `last` (stack.c then skips the last layer's output
        product and MLP for the others: a prompt's); fills each layer's cache. T is 1, 2 for the
        code predictor's first step of a frame (MAX_POSITIONS), or a prompt's length (`prompts`)."""
        T = x.shape[1]
        if self.whole is not None:
            out = self._run_whole(x.reshape(T, self.hidden), T, [(rope, cache, start)], last)
        else:
            out = self._run(x.reshape(T, self.hidden), T, [(rope, cache, start)], self.layers)
        return out[-1:].view(1, 1, -1) if last else out.view(1, T, -1)

    def batch(self, x: torch.Tensor, requests: list) -> torch.Tensor:
        """Several requests' step at once: x (B, T, H), request b at positions [start_b, start_b + T)
        of its own cache, `requests[b]` = (its rope (cos, sin) (T, 1, hd), its cache, start_b) ->
        final-normed hidden (B, T, H). The products take all B * T rows at once (`batch_layers`,
        each row's result that of the request alone); attention runs over each request's cache."""
        B, T, H = x.shape
        if self.whole is not None:
            return self._run_whole(x.reshape(B * T, H), T, requests).view(B, T, H)
        return self._run(x.reshape(B * T, H), T, requests, self.batch_layers).view(B, T, H)

    def _check_room(self, T: int, requests: list) -> None:
        """An error if T positions overflow any of the caches of `requests`."""
        for _, cache, start in requests:
            if start + T > cache[0].k.shape[2]:
                raise RuntimeError(f"KV cache overflow: position {start + T} > capacity {cache[0].k.shape[2]}")

    def _run_whole(self, x: torch.Tensor, T: int, requests: list, last: bool = False) -> torch.Tensor:
        """`_run` in one call of stack.c: x (B * T, H), B = len(requests) -> final-normed (B * T, H),
        of whose rows only the last is computed where `last` (one request). Each product splits its
        weight rows over the calling thread's team (`cpu.native_threads`: a prompt's first frame;
        one thread otherwise), with the same results."""
        dtype, H, nq, nkv, hd, inner = self.dtype, self.hidden, self.heads, self.kv_heads, self.head_dim, self.inner
        self._check_room(T, requests)
        B, L, n = len(requests), len(self.whole), x.shape[0]
        h = x.clone()  # the residual stream, updated in place
        # normed (the result), attended, activated, then the products' outputs: qkv, o or down, gate/up
        widths = (H, nq * hd, inner, (nq + 2 * nkv) * hd, H, 2 * inner)
        buffers = [torch.empty(n, width, dtype=dtype) for width in widths]
        pointers = ctypes.c_void_p * B
        cos = pointers(*(c.data_ptr() for (c, _), _, _ in requests))
        sin = pointers(*(s.data_ptr() for (_, s), _, _ in requests))
        keys = (ctypes.c_void_p * (B * L))(*(layer.k.data_ptr() for _, cache, _ in requests for layer in cache))
        values = (ctypes.c_void_p * (B * L))(*(layer.v.data_ptr() for _, cache, _ in requests for layer in cache))
        caps = (ctypes.c_int * B)(*(cache[0].k.shape[2] for _, cache, _ in requests))
        starts = (ctypes.c_int * B)(*(start for _, _, start in requests))
        status = self.lib.stack_step(self.whole, L, self.first_norm, h.data_ptr(), *(b.data_ptr() for b in buffers),
                                     B, T, cos, sin, keys, values, caps, starts, nq, nkv, hd, H, inner,
                                     self.eps, self.qk_eps, self.dt, cpu.native_threads(), int(last))  # fmt: skip
        check(status, f"the native step of {n} rows")
        return buffers[0]

    def _run(self, x: torch.Tensor, T: int, requests: list, layers: list) -> torch.Tensor:
        """x (B * T, H), B = len(requests), request-major -> final-normed (B * T, H)."""
        lib, dt, dtype = self.lib, self.dt, self.dtype
        H, nq, nkv, hd = self.hidden, self.heads, self.kv_heads, self.head_dim
        B = len(requests)
        self._check_room(T, requests)
        h = x.clone()  # the residual stream, updated in place
        rows = B * T
        normed = torch.empty(rows, H, dtype=dtype)
        attended = torch.empty(rows, nq * hd, dtype=dtype)
        activated = torch.empty(rows, self.inner, dtype=dtype)
        hp, np_, ap, mp = (t.data_ptr() for t in (h, normed, attended, activated))
        threads = cpu.native_threads()
        ropes = [(cos.data_ptr(), sin.data_ptr()) for (cos, sin), _, _ in requests]
        width, out_width = (nq + 2 * nkv) * hd * dtype.itemsize, nq * hd * dtype.itemsize  # bytes a row
        eps, qk_eps = self.eps, self.qk_eps
        lib.add_rms_norm(hp, None, self.first_norm, np_, rows, H, eps, dt)
        for index, (qkv, qk_w, o_proj, post_w, gate_up, down, next_w) in enumerate(layers):
            y = qkv(normed)
            yp = y.data_ptr()
            for b, ((cos, sin), (_, cache, start)) in enumerate(zip(ropes, requests, strict=True)):
                k, v = cache[index].k, cache[index].v
                status = lib.attend(
                    yp + b * T * width,
                    qk_w,
                    cos,
                    sin,
                    k.data_ptr(),
                    v.data_ptr(),
                    ap + b * T * out_width,
                    T,
                    nq,
                    nkv,
                    hd,
                    k.shape[2],
                    start,
                    qk_eps,
                    dt,
                    threads,
                )
                check(status, f"the native attention of {T} positions")
            # Each product's output is held in a name until the call returns (a temporary's memory
            # would be freed as soon as its address is taken).
            y = o_proj(attended)
            lib.add_rms_norm(hp, y.data_ptr(), post_w, np_, rows, H, eps, dt)
            y = gate_up(normed)
            lib.silu_mul(y.data_ptr(), mp, rows, self.inner, dt)
            y = down(activated)
            lib.add_rms_norm(hp, y.data_ptr(), next_w, np_, rows, H, eps, dt)
        return normed


def stack_step(lib: ctypes.CDLL | None, layers, norm, dtype: torch.dtype) -> StackStep | None:
    """The native step for a loaded stack whose activations are `dtype`, or None where it does not
    apply (no library, a dtype without C support, unfused layers or unsupported head shapes)."""
    if lib is None or dtype not in NATIVE_DTYPES or not _supported(layers, dtype):
        return None
    if dtype == torch.float16 and not lib.has_float16():
        return None
    return StackStep(lib, layers, norm, dtype)


def _supported(layers, dtype: torch.dtype) -> bool:
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.qkv_proj is None or mlp.gate_up_proj is None or attn.qk_norm_weight is None:
            return False
        if attn.heads % attn.kv_heads or attn.head_dim % 2:
            return False
        if layer.input_layernorm.weight.dtype != dtype or layer.input_layernorm.weight.device.type != "cpu":
            return False
    return True
