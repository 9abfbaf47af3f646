"""Shared fixtures: tiny random-weight checkpoints (written once per session) and import paths."""

import pathlib
import sys
from collections.abc import Iterator

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from kazeia import native
from kazeia.quant import int8_supported
from kazeia.testing import write_checkpoint

# int8 products need fbgemm's kernels (AVX2 and up): skipped, with the reason, where they cannot run
# (e.g. KAZEIA_ISA=portable).
INT8_UNSUPPORTED = int8_supported(native.library())
requires_int8 = pytest.mark.skipif(INT8_UNSUPPORTED is not None, reason=str(INT8_UNSUPPORTED))
INT8 = pytest.param("int8", marks=requires_int8)

TINY = {
    "0.6B-custom": ("0.6B", "custom_voice"),
    "1.7B-custom": ("1.7B", "custom_voice"),
    "1.7B-design": ("1.7B", "voice_design"),
    "0.6B-base": ("0.6B", "base"),
    "1.7B-base": ("1.7B", "base"),
}


class HeldNeighbours:
    """kazeia/neighbours.py's verdict as a test holds it (`busy`): whether other processes take
    this process's CPUs, whatever the machine's other work does meanwhile."""

    def __init__(self) -> None:
        self.held = False

    def busy(self, unknown: bool = True) -> bool:
        return self.held


@pytest.fixture(autouse=True)
def held_neighbours() -> Iterator[HeldNeighbours]:
    """No other process takes the CPUs, for every test (which teams run where is decided by what
    the machine does, kazeia/placement.py; a test sets `.held = True` for a busy neighbour). Its
    own patch: a test's `monkeypatch.undo()` leaves it."""
    from kazeia import placement

    held = HeldNeighbours()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(placement, "NEIGHBOURS", held)
        yield held


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, pathlib.Path]:
    """name -> directory of a tiny random checkpoint in the released layout."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {
        name: write_checkpoint(root / name, size, kind, tiny=True, seed=i)
        for i, (name, (size, kind)) in enumerate(TINY.items())
    }


@pytest.fixture(scope="session")
def engines(tiny_checkpoints):
    """name -> a loaded Engine (loaded once per session; tests must not mutate it)."""
    from kazeia import Engine

    return {name: Engine.load(path) for name, path in tiny_checkpoints.items()}
