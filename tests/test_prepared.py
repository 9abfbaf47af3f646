"""Prepared checkpoints (`kazeia quantize`): they load without converting anything and speak
exactly like their source loaded in the same precision; they refuse other precisions, and a
broken one names what is wrong."""

import json
import shutil
import struct

import numpy as np
import pytest
import torch
from clone_support import espeak
from conftest import requires_int8
from safetensors.torch import load_file, save_file

from kazeia import Engine, native
from kazeia.cli import main
from kazeia.config import CheckpointError
from kazeia.model import rename
from kazeia.prepare import quantize
from kazeia.prepared import FORMAT, VERSION, prepared_dtype

GREEDY = dict(do_sample=False, subtalker_dosample=False, max_new_tokens=16, seed=3)
NEEDS_INT8 = requires_int8
NEEDS_NATIVE = pytest.mark.skipif(native.library() is None, reason="int4 needs the native library")


def _metadata(path) -> dict:
    with open(path, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(size)).get("__metadata__", {})


@pytest.mark.parametrize(
    "dtype", [pytest.param("int8", marks=NEEDS_INT8), pytest.param("int4", marks=NEEDS_NATIVE), "bfloat16", "float16",
              "float32"],
)  # fmt: skip
def test_a_prepared_checkpoint_speaks_exactly_like_its_source(tiny_checkpoints, tmp_path, dtype):
    source = tiny_checkpoints["0.6B-custom"]
    target = quantize(source, tmp_path / "prepared", dtype)
    assert _metadata(target / "model.safetensors") == {"format": FORMAT, "version": VERSION, "dtype": dtype}
    assert (
        prepared_dtype(target / "model.safetensors") == dtype and prepared_dtype(source / "model.safetensors") is None
    )
    assert (target / "speech_tokenizer" / "model.safetensors").read_bytes() == (
        source / "speech_tokenizer" / "model.safetensors"
    ).read_bytes()
    stored = load_file(target / "model.safetensors")
    if dtype == "int8":  # products stored fused and quantized, as the int8 GEMM multiplies them
        assert stored["talker.layers.0.self_attn.qkv_proj.qweight"].dtype == torch.int8
        assert stored["talker.text_embedding.qweight"].dtype == torch.int8
    elif dtype == "int4":  # packed codes, the group steps and offsets; the heads at 8 bits
        assert stored["talker.layers.0.self_attn.qkv_proj.qweight"].dtype == torch.uint8
        assert stored["talker.layers.0.self_attn.qkv_proj.offsets"].dtype == torch.int8
        assert stored["code_predictor.lm_head.3.qweight"].dtype == torch.int8
        assert stored["talker.layers.1.mlp.down_proj.qweight"].dtype == torch.int8  # int4.eight_bit_products
    else:
        assert {t.dtype for t in stored.values() if t.is_floating_point()} == {getattr(torch, dtype)}
    prepared = Engine.load(target)  # its own precision by default
    original = Engine.load(source, dtype=dtype)
    a = original.synthesize("A prepared checkpoint.", voice="serena", **GREEDY)
    b = prepared.synthesize("A prepared checkpoint.", voice="serena", **GREEDY)
    np.testing.assert_array_equal(a.codes, b.codes)
    np.testing.assert_array_equal(a.audio, b.audio)


@NEEDS_INT8
def test_a_prepared_base_checkpoint_still_clones(tiny_checkpoints, tmp_path):
    source = tiny_checkpoints["0.6B-base"]
    target = quantize(source, tmp_path / "base-int8", "int8")
    ref = espeak(tmp_path / "ref.wav", "A voice to clone from.", "en")
    outputs = []
    for engine in (Engine.load(source, dtype="int8"), Engine.load(target)):
        voice = engine.create_voice(ref, x_vector_only=True)
        outputs.append(engine.synthesize("Cloned, prepared.", voice=voice, **GREEDY))
    np.testing.assert_array_equal(outputs[0].codes, outputs[1].codes)
    np.testing.assert_array_equal(outputs[0].audio, outputs[1].audio)


def test_a_prepared_checkpoint_loads_only_in_its_precision(tiny_checkpoints, tmp_path):
    target = quantize(tiny_checkpoints["0.6B-custom"], tmp_path / "bf16", "bfloat16")
    with pytest.raises(ValueError, match="prepared for bfloat16 .*dtype='bfloat16'"):
        Engine.load(target, dtype="float32")
    with pytest.raises(ValueError, match="already prepared"):
        quantize(target, tmp_path / "again", "int8")
    with pytest.raises(ValueError, match="not an empty directory"):
        quantize(tiny_checkpoints["0.6B-custom"], target, "bfloat16")
    with pytest.raises(ValueError, match="unknown dtype 'int2'"):
        quantize(tiny_checkpoints["0.6B-custom"], tmp_path / "int2", "int2")


@NEEDS_INT8
def test_a_broken_prepared_file_names_what_is_wrong(tiny_checkpoints, tmp_path):
    target = quantize(tiny_checkpoints["0.6B-custom"], tmp_path / "int8", "int8")
    path = target / "model.safetensors"
    tensors, meta = load_file(path), _metadata(path)
    name = "code_predictor.layers.1.mlp.gate_up_proj.qweight"
    save_file({k: v for k, v in tensors.items() if k != name}, path, metadata=meta)
    with pytest.raises(CheckpointError, match=f"missing tensor {name}"):
        Engine.load(target)
    save_file({**tensors, name: tensors[name][:, :-1].contiguous()}, path, metadata=meta)
    with pytest.raises(CheckpointError, match="code_predictor.layers.1.mlp.gate_up_proj is stored as"):
        Engine.load(target)
    save_file({**tensors, "talker.extra": torch.zeros(2)}, path, metadata=meta)
    with pytest.raises(CheckpointError, match="unexpected tensor talker.extra"):
        Engine.load(target)
    save_file(tensors, path, metadata={**meta, "version": "0"})
    with pytest.raises(CheckpointError, match="another version of Kazeia"):
        Engine.load(target)


@NEEDS_NATIVE
def test_a_broken_prepared_int4_file_names_what_is_wrong(tiny_checkpoints, tmp_path):
    target = quantize(tiny_checkpoints["1.7B-custom"], tmp_path / "int4", "int4")
    path = target / "model.safetensors"
    tensors, meta = load_file(path), _metadata(path)
    name = "talker.layers.0.mlp.down_proj"
    save_file({k: v for k, v in tensors.items() if k != f"{name}.steps"}, path, metadata=meta)
    with pytest.raises(CheckpointError, match=f"missing tensor {name}.steps"):
        Engine.load(target)
    save_file({**tensors, f"{name}.steps": tensors[f"{name}.steps"].to(torch.int8)}, path, metadata=meta)
    with pytest.raises(CheckpointError, match=f"{name}: int4 steps is .* torch.int8, expected .* torch.uint8"):
        Engine.load(target)
    head = "code_predictor.lm_head.0.qweight"
    save_file({**tensors, head: tensors[head].float()}, path, metadata=meta)
    with pytest.raises(CheckpointError, match="code_predictor.lm_head.0 is stored as .* torch.float32, expected"):
        Engine.load(target)


@NEEDS_NATIVE
def test_a_version_1_int4_file_loads_its_bfloat16_heads_as_version_2_stores_them(tiny_checkpoints, tmp_path):
    """Version 1 of the format kept int4's 8-bit products (int4.eight_bit_products) as bfloat16
    weights: such a file still loads, those products quantized at load, and speaks exactly like
    the version 2 file of the same (bfloat16, as released) source."""
    source = tmp_path / "released"
    shutil.copytree(tiny_checkpoints["0.6B-custom"], source)
    weights = source / "model.safetensors"
    save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_file(weights).items()}, weights)
    target = quantize(source, tmp_path / "int4", "int4")
    path = target / "model.safetensors"
    tensors, meta = load_file(path), _metadata(path)
    released = rename(load_file(weights), str(weights))  # module names (these products are not fused)
    kept = {k.removesuffix(".scales") for k in tensors if k.endswith(".scales") and "embedding" not in k}
    assert "talker.codec_head" in kept and "talker.layers.1.mlp.down_proj" in kept and len(kept) == 17
    old = {k: v for k, v in tensors.items() if k.rpartition(".")[0] not in kept}
    old |= {f"{name}.weight": released[f"{name}.weight"] for name in kept}
    assert {old[f"{name}.weight"].dtype for name in kept} == {torch.bfloat16}
    new = Engine.load(target)
    a = new.synthesize("A prepared checkpoint.", voice="serena", **GREEDY)
    save_file(old, path, metadata={**meta, "version": "1"})
    b = Engine.load(target).synthesize("A prepared checkpoint.", voice="serena", **GREEDY)
    np.testing.assert_array_equal(a.codes, b.codes)
    np.testing.assert_array_equal(a.audio, b.audio)
    first = {**meta, "version": "1"}
    save_file({**old, "talker.codec_head.weight": old["talker.codec_head.weight"].float()}, path, metadata=first)
    with pytest.raises(CheckpointError, match="talker.codec_head is stored as .* torch.float32, expected .* bfloat16"):
        Engine.load(target)
    save_file(old, path, metadata=meta)  # version 2 stores them as int8
    with pytest.raises(CheckpointError, match="missing tensor .*qweight"):
        Engine.load(target)


def test_kazeia_quantize_command(tiny_checkpoints, tmp_path, capsys):
    target = tmp_path / "cli-f16"
    assert main(["quantize", str(tiny_checkpoints["0.6B-custom"]), str(target), "--dtype", "float16"]) == 0
    assert (
        "prepared for float16" in capsys.readouterr().err and prepared_dtype(target / "model.safetensors") == "float16"
    )
    assert main(["quantize", str(tiny_checkpoints["0.6B-custom"]), str(target), "--dtype", "float16"]) == 2
    assert "not an empty directory" in capsys.readouterr().err
    assert main(["say", "Hi.", "--model", str(target), "--dtype", "bfloat16", "-o", str(tmp_path / "x.wav")]) == 2
    assert "prepared for float16" in capsys.readouterr().err
