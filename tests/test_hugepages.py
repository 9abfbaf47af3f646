"""The weights on huge pages (kazeia/hugepages.py): the same values, shared storages kept shared,
the same audio, and nothing moved when turned off."""

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from kazeia import Engine, hugepages
from kazeia.int4 import Int4Linear
from kazeia.matmul import PackedLinear
from kazeia.native.linear import NativeLinear

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 4096), nn.Linear(4096, 256), nn.LayerNorm(256))  # 4 MB: a whole huge page
    model[1].weight = nn.Parameter(model[0].weight.T)  # a view of another parameter's storage
    model[0].register_buffer("table", torch.arange(4096, dtype=torch.int16).view(64, 64))  # 8 KB
    return model


def _large_storages(model: nn.Module, limit: int) -> int:
    """Bytes of the distinct storages of `limit` bytes or more, each rounded up to a cache line."""
    tensors = [*model.parameters(), *model.buffers()]
    sizes = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(-(-n // 64) * 64 for n in sizes.values() if n >= limit)


def test_weights_move_with_their_values_and_their_sharing():
    model, x = _model(), torch.randn(5, 256)
    expected = model(x)
    before = {name: t.clone() for name, t in [*model.named_parameters(), *model.named_buffers()]}
    storages = _large_storages(model, 4096)
    arena = hugepages.move_to_huge_pages(model, min_bytes=4096)
    if not hugepages.enabled():
        pytest.skip("huge pages cannot be asked for here")
    assert arena is not None
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        assert torch.equal(t, before[name]) and t.dtype == before[name].dtype, name
        large = t.untyped_storage().nbytes() >= 4096
        assert arena.contains(t.data_ptr()) == large, name  # the LayerNorm's 1 KB stay
    assert model[1].weight.data_ptr() == model[0].weight.data_ptr()  # still a view: one copy of it
    assert model[1].weight.stride() == model[0].weight.stride()[::-1]
    assert arena.size == storages
    assert isinstance(model[0].weight, nn.Parameter)
    assert torch.equal(model(x), expected)
    if THP.is_file() and "[never]" not in THP.read_text():  # the mapping is one the kernel may back with 2 MB pages
        smaps = Path("/proc/self/smaps").read_text().split("\n")
        start = arena.bytes.data_ptr()
        header = next(i for i, line in enumerate(smaps) if line.split("-")[0] == f"{start:x}")
        eligible = next(line for line in smaps[header:] if line.startswith("THPeligible:"))
        assert eligible.split()[1] == "1"


def test_turned_off_nothing_moves(monkeypatch):
    monkeypatch.setenv("KAZEIA_HUGEPAGES", "0")
    model = _model()
    addresses = [t.data_ptr() for t in model.parameters()]
    assert hugepages.move_to_huge_pages(model, min_bytes=0) is None
    assert [t.data_ptr() for t in model.parameters()] == addresses


@pytest.mark.parametrize("dtype", ["float32", "int4"])
def test_an_engine_on_huge_pages_speaks_the_same_bytes(tiny_checkpoints, monkeypatch, dtype):
    path = tiny_checkpoints["0.6B-custom"]
    monkeypatch.setattr(hugepages, "MIN_BYTES", 0)  # the tiny model's tensors are small: move them all
    moved = Engine.load(path, dtype=dtype)
    if not hugepages.enabled():
        pytest.skip("huge pages cannot be asked for here")
    model = moved.model
    products = [m for m in model.modules() if isinstance(m, (Int4Linear, NativeLinear, PackedLinear))]
    assert model.arena is not None and products
    # oneDNN's packed weights (PackedLinear, where no native product applies) are opaque: they stay
    plain = [t for m in products for t in m.buffers() if t.layout == torch.strided and not t.is_mkldnn]
    plain = [t for t in plain if t.untyped_storage().nbytes() > 0]
    assert plain and all(model.arena.contains(t.data_ptr()) for t in plain)
    plain = Engine.load(path, dtype=dtype, huge_pages=False)  # `kazeia say`'s
    assert plain.model.arena is None
    options = dict(voice="serena", seed=7, max_new_tokens=12)
    a = moved.synthesize("Huge pages.", **options).audio
    b = plain.synthesize("Huge pages.", **options).audio
    assert a.size > 0 and np.array_equal(a, b)
