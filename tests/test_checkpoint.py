"""Checkpoint layout and loading: released tensor names, corrupt checkpoints, hub ids and the cache."""

import json
import shutil

import pytest
import torch
from conftest import INT8
from reference import load_reference
from safetensors.torch import load_file, save_file

from kazeia import CheckpointError, Engine
from kazeia.testing import CHECKPOINTS, FILES, model_config, model_tensors


@pytest.mark.parametrize("size,kind", sorted(CHECKPOINTS))
@pytest.mark.parametrize("tiny", [True, False], ids=["tiny", "real"])
def test_generated_tensors_match_the_reference_module_tree(size, kind, tiny):
    """Names and shapes written by kazeia.testing == the reference model's state dict (an independent layout)."""
    load_reference()
    from qwen_tts.core.models import Qwen3TTSConfig, Qwen3TTSForConditionalGeneration

    cfg = model_config(size, kind, tiny)
    with torch.device("meta"):
        ref = Qwen3TTSForConditionalGeneration(Qwen3TTSConfig(**cfg))
    expected = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    ours = {k: tuple(v.shape) for k, v in model_tensors(cfg, None).items()}
    assert ours == expected


def test_generated_vocoder_tensors_match_the_reference_decoder(tiny_checkpoints):
    load_reference()
    from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Config
    from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Model

    folder = tiny_checkpoints["0.6B-custom"] / "speech_tokenizer"
    with torch.device("meta"):
        ref = Qwen3TTSTokenizerV2Model(Qwen3TTSTokenizerV2Config.from_pretrained(folder))
    expected = {k: tuple(v.shape) for k, v in ref.state_dict().items() if k.startswith("decoder.")}
    written = {k: tuple(v.shape) for k, v in load_file(folder / "model.safetensors").items()}
    assert written == expected


@pytest.fixture()
def checkpoint_copy(tiny_checkpoints, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoints["0.6B-custom"], dst)
    return dst


REQUIRED = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "vocab.json",
    "merges.txt",
    "tokenizer_config.json",
    "speech_tokenizer/config.json",
    "speech_tokenizer/model.safetensors",
]


@pytest.mark.parametrize("name", REQUIRED)
def test_missing_file_is_named(checkpoint_copy, name):
    (checkpoint_copy / name).unlink()
    with pytest.raises(CheckpointError, match=f"missing file {name}"):
        Engine.load(checkpoint_copy)


def _edit_tensors(path, edit):
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def test_missing_tensor_is_named(checkpoint_copy):
    key = "talker.model.layers.1.mlp.up_proj.weight"
    _edit_tensors(checkpoint_copy / "model.safetensors", lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match=f"model.safetensors: missing tensor {key}"):
        Engine.load(checkpoint_copy)


def test_unexpected_tensor_is_named(checkpoint_copy):
    def add(t):
        t["talker.model.layers.0.self_attn.extra.weight"] = torch.zeros(2)

    _edit_tensors(checkpoint_copy / "model.safetensors", add)
    with pytest.raises(CheckpointError, match="unexpected tensor talker.model.layers.0.self_attn.extra.weight"):
        Engine.load(checkpoint_copy)


def test_foreign_tensor_is_named(checkpoint_copy):
    def add(t):
        t["lm_head.weight"] = torch.zeros(2)

    _edit_tensors(checkpoint_copy / "model.safetensors", add)
    with pytest.raises(CheckpointError, match="unexpected tensor lm_head.weight"):
        Engine.load(checkpoint_copy)


def test_misshaped_tensor_is_named(checkpoint_copy):
    key = "talker.code_predictor.lm_head.3.weight"

    def shrink(t):
        t[key] = t[key][:-1].clone()

    _edit_tensors(checkpoint_copy / "model.safetensors", shrink)
    with pytest.raises(CheckpointError, match=rf"tensor {key} has shape \(2047, 64\), expected \(2048, 64\)"):
        Engine.load(checkpoint_copy)


def test_missing_vocoder_tensor_is_named(checkpoint_copy):
    key = "decoder.decoder.2.block.3.conv1.conv.weight"
    _edit_tensors(checkpoint_copy / "speech_tokenizer" / "model.safetensors", lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match="decoder.2.block.3.conv1.conv.weight"):
        Engine.load(checkpoint_copy)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", INT8])  # memory-mapped / read and converted
@pytest.mark.parametrize("name", ["model.safetensors", "speech_tokenizer/model.safetensors"])
def test_truncated_safetensors(checkpoint_copy, name, dtype):
    path = checkpoint_copy / name
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        Engine.load(checkpoint_copy, dtype=dtype)


def test_converting_read_equals_memory_mapped_conversion(tiny_checkpoints):
    from kazeia.checkpoint import load_tensors

    path = tiny_checkpoints["1.7B-custom"] / "model.safetensors"
    mapped = load_tensors(path)
    converted = load_tensors(path, torch.bfloat16)
    assert mapped.keys() == converted.keys()
    for name, tensor in mapped.items():
        assert converted[name].dtype == torch.bfloat16
        assert torch.equal(converted[name], tensor.to(torch.bfloat16)), name


def test_tensors_can_be_picked_by_name_mapped_or_read(tiny_checkpoints):
    from kazeia.checkpoint import load_tensors

    path = tiny_checkpoints["0.6B-custom"] / "speech_tokenizer" / "model.safetensors"
    everything = load_tensors(path)
    wanted = lambda name: name.startswith("decoder.upsample.")  # noqa: E731
    for picked in (load_tensors(path, wanted=wanted), load_tensors(path, mmap=False, wanted=wanted)):
        assert picked.keys() == {name for name in everything if wanted(name)} and picked
        assert all(torch.equal(picked[name], everything[name]) for name in picked)


def test_wrong_model_type(checkpoint_copy):
    cfg = json.loads((checkpoint_copy / "config.json").read_text())
    cfg["model_type"] = "llama"
    (checkpoint_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="model_type is 'llama', expected 'qwen3_tts'"):
        Engine.load(checkpoint_copy)


def test_corrupt_json_and_missing_key(checkpoint_copy):
    (checkpoint_copy / "speech_tokenizer" / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="speech_tokenizer/config.json"):
        Engine.load(checkpoint_copy)
    cfg = json.loads((checkpoint_copy / "config.json").read_text())
    del cfg["talker_config"]["codec_eos_token_id"]
    (checkpoint_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="talker_config: missing key 'codec_eos_token_id'"):
        Engine.load(checkpoint_copy)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint directory"):
        Engine.load(tmp_path / "nowhere")
    (tmp_path / "file.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="is a file"):
        Engine.load(tmp_path / "file.bin")


def test_hub_id_loads_from_the_offline_cache(tiny_checkpoints, tmp_path, monkeypatch):
    """A hub id resolves through huggingface_hub's cache layout; offline use needs no network."""
    cache = tmp_path / "hub"
    repo = cache / "models--Qwen--Qwen3-TTS-12Hz-0.6B-CustomVoice"
    revision = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(tiny_checkpoints["0.6B-custom"], repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    engine = Engine.load("Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice", offline=True)
    local = Engine.load(tiny_checkpoints["0.6B-custom"])
    a = engine.synthesize("Hello.", voice="serena", seed=3, max_new_tokens=6)
    b = local.synthesize("Hello.", voice="serena", seed=3, max_new_tokens=6)
    assert a.audio.tobytes() == b.audio.tobytes()
    with pytest.raises(CheckpointError, match="not in the local cache"):
        Engine.load("Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice", offline=True)


def test_committed_reference_files_are_complete():
    for name in CHECKPOINTS.values():
        for f in ["config.json", "generation_config.json", "tokenizer_config.json", "speech_tokenizer/config.json"]:
            assert (FILES / name / f).is_file()
    assert (FILES / "text-tokenizer" / "vocab.json").stat().st_size > 2_000_000


def test_generation_config_gives_the_defaults_and_the_reference_fallbacks(checkpoint_copy):
    """Fields the file sets are the defaults; a field it leaves out falls back as in the reference
    (max_new_tokens: 2048, not the released files' 8192); a bad value names the file."""
    path = checkpoint_copy / "generation_config.json"
    config = json.loads(path.read_text())
    config.pop("max_new_tokens")
    config["top_k"] = 7
    config["unrelated_key"] = "the file's own business"
    path.write_text(json.dumps(config))
    defaults = Engine.load(checkpoint_copy).defaults
    assert defaults.max_new_tokens == 2048 and defaults.top_k == 7
    config["temperature"] = "hot"
    path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="generation_config.json.*temperature"):
        Engine.load(checkpoint_copy)
