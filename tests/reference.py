"""Import the reference implementation (`qwen-tts` 0.1.1), the oracle of the parity tests.

Test-only. `import qwen_tts` pulls in the 25 Hz tokenizer, which imports torchaudio, sox and
onnxruntime at module level although the 12 Hz models never use them; empty stand-in modules are
registered for those before the import. Tests that need the reference call `load_reference()`,
which skips the test when the package is not installed.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
import types

import pytest

_STAND_INS = ("torchaudio", "torchaudio.compliance", "torchaudio.compliance.kaldi", "sox", "onnxruntime")


def load_reference():
    """Return the `qwen_tts` module, importing it with stand-ins for its unused audio deps."""
    pytest.importorskip("transformers")
    for name in _STAND_INS:
        if name not in sys.modules:
            try:
                __import__(name)
            except ImportError:
                module = types.ModuleType(name)
                module.__spec__ = importlib.machinery.ModuleSpec(name, None)
                sys.modules[name] = module
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        import qwen_tts
    except ImportError as e:  # pragma: no cover - depends on the test environment
        pytest.skip(f"reference package qwen-tts not importable: {e}")
    return qwen_tts


def run_reference(ref, method: str, options: dict, **kwargs):
    """Call a reference `generate_*` method; return the codes it decoded (frames, 16) and its audio."""
    captured, inner = [], ref.model.generate

    def spy(*args, **kw):
        out = inner(*args, **kw)
        captured.append(out[0][0])
        return out

    ref.model.generate = spy
    try:
        wavs, sr = getattr(ref, method)(**kwargs, **options)
    finally:
        ref.model.generate = inner
    assert sr == 24000
    return captured[0].cpu().numpy(), wavs[0]
