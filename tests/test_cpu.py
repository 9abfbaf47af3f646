"""CPU features (kazeia/cpu.py): what KAZEIA_ISA selects, what each path does with it, and the
suite's ISA-sensitive tests run again under every instruction-set level this CPU supports, with
the libraries capped to it as well (a smaller CPU emulated), and under the portable one."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from kazeia import Engine, cpu, native
from kazeia.matmul import can_pack
from kazeia.quant import QuantLinear, int8_supported, needs_reduced_range

ALL = frozenset(cpu.FEATURES)
ZEN3 = frozenset({"avx2"})


def test_native_and_portable():
    assert cpu.parse(None, ALL) == cpu.parse("native", ALL) == ALL
    assert cpu.parse("portable", ALL) == frozenset()
    assert cpu.parse("", ZEN3) == ZEN3


def test_a_list_is_exact_and_signed_words_change_the_detected_set():
    assert cpu.parse("avx2", ALL) == {"avx2"}
    assert cpu.parse("AVX512, avx2", ALL) == {"avx2", "avx512"}
    assert cpu.parse("-vnni,-bf16", ALL) == {"avx2", "avx512", "f16"}
    assert cpu.parse("-f16,+f16", ALL) == ALL


@pytest.mark.parametrize(
    ("value", "have", "message"),
    [
        ("avx512", ZEN3, "asks for avx512, which this CPU does not have"),
        ("+vnni", ZEN3, "asks for vnni"),
        ("sse9", ALL, "unknown feature 'sse9'"),
        ("avx2,-vnni", ALL, "not both"),
        ("avx2,vnni", ALL, "vnni needs avx512"),
        ("-avx2", ALL, "needs avx2"),
    ],
)
def test_what_cannot_be_honoured_is_an_error_naming_it(value, have, message):
    with pytest.raises(ValueError, match=message):
        cpu.parse(value, have)


def test_detection_keeps_only_usable_features(monkeypatch):
    flags = frozenset({"avx2", "fma", "f16c", "avx_vnni", "avx512_vnni"})  # VNNI without AVX-512
    monkeypatch.setattr(cpu, "_cpu_flags", lambda: flags)
    monkeypatch.setattr(cpu, "_x86", lambda: True)
    cpu.detected.cache_clear()
    try:
        assert cpu.detected() == {"avx2"}  # fbgemm's VNNI kernel is an AVX-512 one; AVX-VNNI has none
    finally:
        cpu.detected.cache_clear()


def test_compiler_flags_follow_the_features():
    have = cpu.detected()
    assert cpu.compiler_flags(have) == ("-march=native",)  # all of its own: built for this very CPU
    if cpu._x86():
        portable = cpu.compiler_flags(frozenset())
        assert "-march=x86-64" in portable and not any(f.startswith("-mavx") for f in portable)
        if "avx512" in have:
            assert "-mavx512f" not in cpu.compiler_flags(frozenset({"avx2"}))
            assert "-mavx2" in cpu.compiler_flags(frozenset({"avx2"}))
        if "vnni" in have:  # the int4 products' dot product follows the feature
            assert "-mavx512vnni" not in cpu.compiler_flags(have - {"vnni"})


def test_each_path_follows_kazeia_isa(monkeypatch):
    monkeypatch.setenv("KAZEIA_ISA", "portable")
    assert needs_reduced_range()
    assert not can_pack(torch.bfloat16) and not can_pack(torch.float16)
    assert "AVX2" in int8_supported()
    assert "-march=x86-64" in native.flags() or not cpu._x86()
    monkeypatch.setenv("KAZEIA_ISA", "native")
    assert needs_reduced_range() == ("vnni" not in cpu.detected())


def test_int8_is_refused_with_a_reason_where_it_cannot_run(tiny_checkpoints, monkeypatch):
    """Below AVX2 int8 runs in the native library's plain C kernel; without that library too
    (KAZEIA_NATIVE=0), nothing can run it."""
    monkeypatch.setenv("KAZEIA_ISA", "portable")
    if native.library() is not None:
        model = Engine.load(tiny_checkpoints["0.6B-custom"], dtype="int8").model
        products = [m for m in model.modules() if isinstance(m, QuantLinear)]
        assert products and all(m.native for m in products) and native.library().int8_kernel() == 0
    monkeypatch.setenv("KAZEIA_NATIVE", "0")
    with pytest.raises(ValueError, match="int8.*AVX2"):
        Engine.load(tiny_checkpoints["0.6B-custom"], dtype="int8")


def test_a_bad_kazeia_isa_fails_the_load_with_its_name(tiny_checkpoints, monkeypatch):
    monkeypatch.setenv("KAZEIA_ISA", "avx9000")
    with pytest.raises(ValueError, match="KAZEIA_ISA"):
        Engine.load(tiny_checkpoints["0.6B-custom"])


# -- the suite's ISA-sensitive tests at every level this CPU supports -------------------------------
ISA_SENSITIVE = [
    "test_native.py",
    "test_native_prompt.py",
    "test_quant.py",
    "test_layers.py",
    "test_quality.py",
    "test_vocoder.py",
    "test_vocoder_chunks.py",
    "test_vocoder_int8.py",
    "test_parity.py",
    "test_engine.py",
    "test_streaming.py",
    "test_prepared.py",
    "test_int4.py",
    "test_batch.py::test_the_step_in_one_native_call_equals_the_step_layer_by_layer",
    "test_batch.py::test_a_batched_step_gives_each_request_its_solo_codes",
]
NESTED = "KAZEIA_TEST_ISA_LEVEL"  # set in the runs below, so they do not start runs of their own


def levels() -> list[str]:
    """The portable level, AVX2 alone and AVX2 + AVX-512 without the extensions (the full set is
    the suite's own run): every feature runs once off and once on. The extensions (vnni, bf16, f16)
    are switched off together rather than one level each: each is a path of its own, and a level
    costs minutes of the suite (five levels on a Sapphire Rapids machine took it near 30 minutes)."""
    have = cpu.detected()
    chain = [f for f in cpu.FEATURES if f in have]
    out = ["portable"] + [",".join(chain[:n]) for n in range(1, min(len(chain), 3))]
    return out if have else []


@pytest.mark.skipif(bool(os.environ.get(NESTED)), reason="already inside a level's run")
@pytest.mark.parametrize("level", levels())
def test_the_isa_sensitive_tests_pass_at_every_level(level):
    features = cpu.parse(level, cpu.detected())
    env = {**os.environ, **cpu.library_caps(features), "KAZEIA_ISA": level, NESTED: level}
    tests = Path(__file__).parent
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-x",
            "-p",
            "no:cacheprovider",
            *(str(tests / t) for t in ISA_SENSITIVE),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, f"KAZEIA_ISA={level}:\n{done.stdout[-6000:]}\n{done.stderr[-2000:]}"


def test_a_team_is_the_calling_threads_alone():
    """`cpu.team` gives the calling thread's parallel regions more threads for a block and no other
    thread's, not even one whose first torch call falls inside the block; it undoes itself."""
    if cpu._omp_set_num_threads() is None:
        pytest.skip("torch runs on no OpenMP runtime here")
    seen: dict[str, int] = {}
    inside, measured = threading.Event(), threading.Event()

    def other() -> None:
        inside.wait(10)
        seen["other"] = torch.get_num_threads()
        measured.set()

    thread = threading.Thread(target=other)
    thread.start()
    before = torch.get_num_threads()
    with cpu.team(before + 1):
        seen["inside"] = torch.get_num_threads()
        inside.set()
        measured.wait(10)
    seen["after"] = torch.get_num_threads()
    thread.join()
    assert seen == {"inside": before + 1, "other": before, "after": before}
    with cpu.team(None):
        assert torch.get_num_threads() == before


def test_a_team_given_as_a_callable_is_asked_at_each_product():
    """A prompt's team can change size between its products (kazeia/scheduler.py): `native_threads`
    asks the callable each time, in the calling thread only, and the block undoes it."""
    sizes, seen = iter([3, 1, 2]), {}
    with cpu.team(lambda: next(sizes), openmp=False):
        assert [cpu.native_threads() for _ in range(3)] == [3, 1, 2]
        other = threading.Thread(target=lambda: seen.setdefault("other", cpu.native_threads()))
        other.start()
        other.join()
    assert seen == {"other": 1} and cpu.native_threads() == 1


def test_on_enters_a_team_or_nothing():
    """`cpu.on(Team)` is `cpu.team(*Team)`; `cpu.on(None)` leaves the threads as they are, inside
    another team too."""
    with cpu.on(cpu.Team(3, openmp=False)):
        assert cpu.native_threads() == 3
        with cpu.on(None):
            assert cpu.native_threads() == 3
        with cpu.on(cpu.Team(lambda: 2, openmp=False)):
            assert cpu.native_threads() == 2
        assert cpu.native_threads() == 3
    with cpu.on(None):
        assert cpu.native_threads() == 1


def test_the_vocoders_threads_are_the_stages_outside_a_team():
    """`stage_team` (the vocoder's kernels) is torch's count outside any team, the team's inside one
    (a callable's answer, torch's where it answers None), and torch's again after the team, nested
    or not: a stream's first chunk on the team must leave its later chunks on the stage's threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(3)  # a stage of several threads, whatever this machine's default
    try:
        assert cpu.stage_team() == 3 and cpu.native_threads() == 1
        answers = iter([5, None])
        with cpu.team(lambda: next(answers), openmp=False):
            assert [cpu.stage_team(), cpu.stage_team()] == [5, 3]
            with cpu.team(4, openmp=False):
                assert cpu.stage_team() == 4 and cpu.native_threads() == 4
            with cpu.team(lambda: None, openmp=False):
                assert cpu.native_threads() == 1  # None from the team: one, as outside
        assert cpu.stage_team() == 3 and cpu.native_threads() == 1
    finally:
        torch.set_num_threads(before)
