"""The batched frame step: `decode_frame` for several requests at once, each result its solo one.

Tensors and per-request state only (generate.Decoding). A batched step reads every weight once for
B requests: the talker's and the code predictor's products take all B rows in one call, attention
runs over each request's own cache at its own position (kazeia/native: `StackStep.batch`), the
code predictor's 15 steps run in lockstep (their positions are the same for all), and each request
samples with its own options and its own `torch.Generator`.

Batch invariance: a request's codes never depend on the others in its batch. Everything between
the products works row by row (norms, rotation, attention, SiLU, sampling). The products are chosen
for it (`row_product`): the float GEMV (gemv.c) reduces each row in the order it uses for one row;
int4 and int8 rows are independent (int4.c; int8.c rounds each row on a grid of its own and sums
exactly in integers). A batched step therefore equals `generate.decode_frame` bit for bit, at
every precision. A model whose products cannot be made row-invariant (oneDNN products when
generation has several threads, the int8 GEMM where there is no native library, a GPU) steps its
requests one after the other (`Batch.rows_shared` is False): the same results, without the shared weight reads.

A step may stop at its `pause` points (after the talker, after each of the predictor's steps) for
other work on the model, e.g. a joining request's prompt (kazeia/scheduler.py); its rows wait
untouched meanwhile, so its results are the same.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .generate import Decoding, decode_frame
from .int4 import HeadLinear, Int4Linear
from .model import TTSModel
from .native import address
from .native.linear import NativeLinear
from .prompt import frame_embedding
from .quant import QuantLinear
from .sampling import sample, talker_scores
from .vocoder import no_pause

MAX_ROWS = 256  # rows one native product takes (gemv.c); a batch of B needs 2 B in the predictor

Product = Callable[[torch.Tensor, int], torch.Tensor]  # (rows (n, in), requests) -> (n, out)


def row_product(module: nn.Module) -> Product | None:
    """`module`'s product for batched steps, where each row's result is independent of the others
    (and, for float and int4 weights, equal to the module's own for that row alone); None where
    there is none. The second argument is the number of requests the rows belong to (in equal,
    consecutive groups)."""
    if isinstance(module, nn.Identity):
        return lambda rows, groups: rows
    if isinstance(module, NativeLinear):
        return _gemv(module)
    if isinstance(module, HeadLinear):
        return _gemv_wide(module)
    if isinstance(module, Int4Linear) or (isinstance(module, QuantLinear) and module.native):
        return lambda rows, groups: module(rows)  # int4.c, int8.c: each row on its own
    return None


def _gemv(linear: NativeLinear) -> Product:
    lib, w, dt, n_out, n_in = linear.lib, linear.weight, linear.dt, linear.out_features, linear.in_features

    def product(rows: torch.Tensor, groups: int) -> torch.Tensor:
        bias = address(linear.bias)  # taken at each call, as in the products below: they hold the module
        rows = rows.reshape(-1, n_in).to(w.dtype).contiguous()
        y = torch.empty(rows.shape[0], n_out, dtype=w.dtype)
        _check(lib.gemv(w.data_ptr(), rows.data_ptr(), bias, y.data_ptr(), n_out, n_in, rows.shape[0], dt), rows)
        return y

    return product


def _gemv_wide(head: HeadLinear) -> Product:
    lib, bits, n_out, n_in = head.lib, head.weight_bits, head.out_features, head.in_features

    def product(rows: torch.Tensor, groups: int) -> torch.Tensor:
        bias = address(head.bias)
        rows = rows.reshape(-1, n_in).float().contiguous()
        y = torch.empty(rows.shape[0], n_out, dtype=torch.float32)
        _check(lib.gemv_wide(bits.data_ptr(), 1, rows.data_ptr(), bias, y.data_ptr(), n_out, n_in, rows.shape[0]), rows)
        return y

    return product


def _check(status: int, rows: torch.Tensor) -> None:
    if status == -2:
        raise MemoryError(f"product of {rows.shape[0]} rows: out of memory")
    if status != 0:
        raise RuntimeError(f"the native product refused {rows.shape[0]} rows (at most {MAX_ROWS})")


class Batch:
    """The batched frame step of one loaded model (`decode_frames`)."""

    def __init__(self, model: TTSModel):
        self.model = model
        talker, predictor = model.talker, model.code_predictor
        steps = (talker.native_step, predictor.native_step)
        heads = [row_product(talker.codec_head), *(row_product(h) for h in predictor.lm_head)]
        self.projection = row_product(predictor.small_to_mtp_projection)
        self.heads = heads
        self.rows_shared = (
            all(s is not None and s.batch_layers is not None for s in steps)
            and all(h is not None for h in heads)
            and self.projection is not None
        )

    @property
    def max_batch(self) -> int:
        """Requests one step may take (the predictor's first step has two rows each)."""
        return MAX_ROWS // 2

    @torch.inference_mode()
    def decode_frames(
        self, states: list[Decoding], texts: list[torch.Tensor], pause: Callable[[], None] = no_pause
    ) -> list[torch.Tensor | None]:
        """`generate.decode_frame` for each request: states[b] steps on its text-track vector
        texts[b] (1, 1, H) -> its next codes (1, 16), or None at its EOS or token limit.
        `pause()`: called between the step's stages (module docstring); the results are the same."""
        if len(states) != len(texts):
            raise ValueError(f"{len(states)} requests but {len(texts)} text vectors")
        if len(states) > self.max_batch:
            raise ValueError(f"a batched step takes at most {self.max_batch} requests, got {len(states)}")
        if not self.rows_shared:
            out: list[torch.Tensor | None] = []
            for state, text in zip(states, texts, strict=True):
                out.append(decode_frame(self.model, state, text))
                pause()
            return out
        out = [None] * len(states)
        going = [b for b, state in enumerate(states) if state.frames + 1 < state.opts.max_new_tokens]
        if not going:
            return out
        talker, predictor = self.model.talker, self.model.code_predictor
        rows, requests = [], []
        for b in going:
            state, n = states[b], states[b].frames
            rows.append(frame_embedding(talker, predictor, state.codes) + texts[b])  # (1, 1, H)
            state.cache.reserve(state.length + n)
            requests.append((state.cache.layers, state.length + n - 1))
        hidden = self._stack(talker, torch.cat(rows), requests)  # (B, 1, H)
        pause()
        logits = self.heads[0](hidden[:, -1], len(going))  # (B, V)
        spoken = []
        for i, b in enumerate(going):
            if self._codebook0(states[b], logits[i : i + 1]):
                spoken.append(i)
        if spoken:
            codes = self._predict([states[going[i]] for i in spoken], hidden[spoken], pause)
            for i, frame in zip(spoken, codes, strict=True):
                state = states[going[i]]
                state.codes, state.frames = frame, state.frames + 1
                out[going[i]] = frame
        return out

    def _stack(self, stack, x: torch.Tensor, requests: list) -> torch.Tensor:
        """x (B, T, H) through `stack`'s batched native step, request b at requests[b] = (its cache, start)."""
        T = x.shape[1]
        spans = [(stack.rotary.span(start, T, x.dtype, x.device), cache, start) for cache, start in requests]
        return stack.native_step.batch(x, spans)

    def _codebook0(self, state: Decoding, logits: torch.Tensor) -> bool:
        """Sample codebook 0 for one request (as generate._frame): False at EOS."""
        opts, n = state.opts, state.frames
        eos = self.model.cfg.talker.codec_eos_id
        scores = talker_scores(logits, state.history[:, :n], opts, eos)
        token = sample(scores, opts.do_sample, opts.temperature, opts.top_k, opts.top_p, state.generator)
        state.history[:, n] = token
        return int(token) != eos

    def _predict(self, states: list[Decoding], hidden: torch.Tensor, pause: Callable[[], None]) -> list[torch.Tensor]:
        """generate.predict_codes in lockstep: hidden (B, 1, H) -> each request's codes (1, 16);
        `pause()` after each of the predictor's steps but the last."""
        talker, predictor = self.model.talker, self.model.code_predictor
        B = len(states)
        first = [state.history[:, state.frames] for state in states]  # (1,) each
        pairs = [torch.cat((hidden[b : b + 1], talker.codec_embedding(t[:, None])), dim=1) for b, t in enumerate(first)]
        x = torch.cat(pairs)  # (B, 2, H)
        codes = [[token] for token in first]
        for g in range(predictor.num_groups):
            if g > 0:
                pause()
                x = torch.cat([predictor.codec_embedding[g - 1](codes[b][-1][:, None]) for b in range(B)])
            start = 0 if g == 0 else g + 1
            projected = self.projection(x, B).view(B, x.shape[1], -1)
            out = self._stack(predictor, projected, [(state.predictor_cache, start) for state in states])
            logits = self.heads[g + 1](out[:, -1], B)
            for b, state in enumerate(states):
                opts = state.opts
                token = sample(
                    logits[b : b + 1].float(), opts.subtalker_dosample, opts.subtalker_temperature,
                    opts.subtalker_top_k, opts.subtalker_top_p, state.generator,
                )  # fmt: skip
                codes[b].append(token)
        return [torch.stack(c, dim=1) for c in codes]
