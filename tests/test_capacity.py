"""The server's measured capacity (kazeia/server/capacity.py): how many utterances at once its own
streams have shown it keeps in real time. Every time is an argument, so nothing here reads a clock."""

import pytest

from kazeia.server.capacity import Capacity


def test_a_level_is_let_in_until_it_is_measured_slower_than_real_time():
    capacity = Capacity(4)
    assert all(capacity.holds(level, 0.0) for level in range(1, 5))  # nothing measured: try them
    assert capacity.paces(0.0) == {} and capacity.most_held(0.0) == 4
    capacity.observe(2, audio_s=1.5, waited_s=1.0, now=0.0)  # 1.0 s of waiting: not enough yet
    assert capacity.paces(0.0) == {}
    capacity.observe(2, audio_s=0.5, waited_s=1.5, now=0.0)  # 2 s of audio over 2.5 s of waiting
    assert capacity.paces(0.0) == {2: pytest.approx(0.8)}
    # two at once fell behind: so would three or four (a stream never gains from company)
    assert [capacity.holds(level, 0.0) for level in range(1, 5)] == [True, False, False, False]
    assert capacity.most_held(0.0) == 1


def test_one_utterance_alone_is_always_let_in_and_a_slow_one_rules_out_company():
    capacity = Capacity(3)
    capacity.observe(1, audio_s=1.0, waited_s=4.0, now=10.0)  # alone at a quarter of real time
    capacity.observe(3, audio_s=9.0, waited_s=3.0, now=10.0)  # three at once measured fast
    assert capacity.holds(1, 10.0)
    assert not capacity.holds(2, 10.0) and not capacity.holds(3, 10.0)  # the slower evidence wins


def test_real_time_exactly_holds_and_levels_past_the_most_count_as_the_most():
    capacity = Capacity(2)
    capacity.observe(7, audio_s=3.0, waited_s=3.0, now=0.0)
    assert capacity.paces(0.0) == {2: 1.0} and capacity.holds(2, 0.0)
    capacity.observe(0, audio_s=1.0, waited_s=2.0, now=0.0)  # level 0 is read as 1
    assert capacity.paces(0.0)[1] == pytest.approx(0.5) and not capacity.holds(2, 0.0)


def test_evidence_fades_so_that_a_level_is_tried_again():
    capacity = Capacity(2, half_life_s=60.0, min_evidence_s=2.0)
    capacity.observe(2, audio_s=2.0, waited_s=4.0, now=0.0)
    assert capacity.paces(30.0) == {2: pytest.approx(0.5)}  # fading weighs audio and waits alike
    assert not capacity.holds(2, 59.0)  # 4 s of waiting, faded to just over 2
    assert capacity.holds(2, 61.0) and capacity.paces(61.0) == {}  # under 2 s: let in again
    capacity.observe(2, audio_s=3.0, waited_s=2.0, now=61.0)  # fresh evidence: fast now
    assert capacity.holds(2, 61.0) and capacity.paces(61.0)[2] > 1.0


def test_nonsense_settings_and_samples_are_refused_or_ignored():
    with pytest.raises(ValueError, match="most=0"):
        Capacity(0)
    capacity = Capacity(2)
    capacity.observe(2, audio_s=1.0, waited_s=-3.0, now=0.0)  # a clock that stepped back
    capacity.observe(2, audio_s=float("nan"), waited_s=3.0, now=0.0)
    assert capacity.paces(0.0) == {}
