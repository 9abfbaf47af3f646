"""The voices directory shared by several processes (server/store.py): two `VoiceStore`s on one
directory stand for two replicas. A name is given with a hard link, so of two stores that passed
their checks at once exactly one creates it; the limits count the directory, so a voice that
went over them while another store created one is taken back."""

import io

import numpy as np
import pytest
import soundfile

pytest.importorskip("fastapi")
from kazeia.server import Limits
from kazeia.server.errors import ApiError
from kazeia.server.store import VoiceStore


@pytest.fixture(scope="module")
def voice(engines):
    t = np.arange(48000) / 24000
    out = io.BytesIO()
    soundfile.write(out, (0.3 * np.sin(2 * np.pi * 140 * t)).astype(np.float32), 24000, format="WAV")
    return engines["0.6B-base"].create_voice(out.getvalue(), x_vector_only=True)


def stores(engines, directory, **limits) -> tuple[VoiceStore, VoiceStore]:
    engine = engines["0.6B-base"]
    return VoiceStore(directory, engine, Limits(**limits)), VoiceStore(directory, engine, Limits(**limits))


def test_one_name_made_by_two_stores_at_once_is_made_once(engines, voice, tmp_path):
    a, b = stores(engines, tmp_path)
    a._check_room()  # both passed their checks before either wrote
    b._check_room()
    a._publish("twin", voice)
    first = (tmp_path / "twin.voice").read_bytes()
    with pytest.raises(ApiError) as refused:
        b._publish("twin", voice)
    assert refused.value.status == 409 and refused.value.code == "voice_exists"
    assert (tmp_path / "twin.voice").read_bytes() == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["twin.voice"]  # no temporary file left
    assert b.get("twin").x_vector.equal(voice.x_vector) and a.names() == b.names() == ["twin"]


def test_the_limits_count_every_store_of_the_directory(engines, voice, tmp_path):
    a, b = stores(engines, tmp_path, max_voices=1)
    a._check_room()
    b._check_room()  # the directory was empty for both
    a._publish("first", voice)
    with pytest.raises(ApiError) as refused:
        b._publish("second", voice)
    assert refused.value.status == 409 and refused.value.code == "too_many_voices"
    assert a.names() == b.names() == ["first"]
    with pytest.raises(ApiError):
        b._check_room()  # and now before any work
    a.delete("first")
    with pytest.raises(ApiError) as gone:
        b.get("first")  # its cache checks the file
    assert gone.value.status == 400
