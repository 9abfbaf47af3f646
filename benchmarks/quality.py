"""Quality guard on a real-size random checkpoint: each reduced precision against float32.

    python benchmarks/quality.py [--size 0.6B] [--tiny | --model DIR] [--frames 50]
                                 [--dtypes bfloat16,float16,int8,int4,q4_k_m,q4_k_m/exact]
                                 [--vocoders bfloat16,float16,int8]

(`DTYPE/VOCODER_DTYPE` in `--dtypes` also runs the vocoder reduced, e.g. `bfloat16/bfloat16`;
`q4_k_m` is the float32 model with GGML's Q4_K_M weights and its products' inputs rounded to Q8_K,
as a GGML engine computes on the CPU; `q4_k_m/exact` keeps the activations exact; both from
kazeia/testing/ggml.py: int4's yardstick.)

Teacher-forced talker and code-predictor logits (relative error, top-1 agreement), free-running
greedy code agreement, and vocoder SNR; then int8's errors as a multiple of bfloat16's (the yardstick:
bfloat16 is the precision the model's authors run it in). The vocoder alone, per `--vocoders` dtype
(int8: kazeia/conv.py's `Tiled8`): SNR in dB and the mean absolute log-mel distance against the
float32 vocoder on the same random codes (`--dtypes ""` runs this part only).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, fields
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Checkpoints, Outcomes, add_checkpoint_options, machine, precisions

from kazeia import Engine
from kazeia.speaker import LogMel
from kazeia.testing.ggml import apply_q4_k_m
from kazeia.testing.quality import Quality, compare
from kazeia.vocoder import Vocoder

TEXT = "The quality guard compares every precision with float32 on the same codes."


def measure(path: Path, baseline: Engine, dtype: str, frames: int) -> dict:
    """One configuration's errors against the float32 `baseline`."""
    if dtype.startswith("q4_k_m"):
        engine = Engine.load(path)
        apply_q4_k_m(engine, "float" if dtype.endswith("/exact") else "q8_k")
    else:
        engine = Engine.load(path, **precisions(dtype))
    return asdict(compare(engine, baseline, TEXT, frames, voice="serena"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_checkpoint_options(parser)
    parser.add_argument("--dtypes", default="bfloat16,float16,int8,int4,q4_k_m,q4_k_m/exact")
    parser.add_argument("--frames", type=int, default=50)
    parser.add_argument("--vocoders", default="bfloat16,float16,int8", help="vocoder dtypes against float32")
    parser.add_argument("--json")
    args = parser.parse_args()
    outcomes, results = Outcomes(), {}
    with Checkpoints(args) as checkpoints:
        path = checkpoints.released
        vocoders = vocoder_quality(path / "speech_tokenizer", args.vocoders.split(","), args.frames)
        print(f"vocoder alone, {args.frames} random frames, against float32; {json.dumps(machine())}")
        print(f"{'vocoder dtype':<18}{'SNR dB':>12}{'log-mel L1':>14}")
        for dtype, v in vocoders.items():
            print(f"vocoder {dtype:<10}{v['snr_db']:>12.2f}{v['log_mel_l1']:>14.4f}")
        baseline = Engine.load(path)
        print(f"{checkpoints.label}, {args.frames} frames; {json.dumps(machine())}")
        keys = [field.name for field in fields(Quality)]
        print(f"{'dtype':<18}" + "".join(f"{k:>22}" for k in keys), flush=True)
        for dtype in args.dtypes.split(","):
            q = outcomes.run(dtype, lambda dtype=dtype: measure(path, baseline, dtype, args.frames))
            if q is not None:
                results[dtype] = q
                print(f"{dtype:<18}" + "".join(f"{q[k]:>22.4f}" for k in keys), flush=True)
    if "int8" in results and "bfloat16" in results:
        b, i = results["bfloat16"], results["int8"]
        print(
            f"int8 / bfloat16 relative error: talker x{i['talker_rel_error'] / b['talker_rel_error']:.2f}, "
            f"code predictor x{i['predictor_rel_error'] / b['predictor_rel_error']:.2f} (target <= 2)"
        )
    if "int4" in results and "q4_k_m" in results:
        i, g = results["int4"], results["q4_k_m"]
        print(
            f"int4 / Q4_K_M relative error: talker x{i['talker_rel_error'] / g['talker_rel_error']:.2f}, "
            f"code predictor x{i['predictor_rel_error'] / g['predictor_rel_error']:.2f} (target <= 1)"
        )
    if args.json:
        payload = {"machine": machine(), "checkpoint": checkpoints.label, "results": results, "vocoders": vocoders}
        Path(args.json).write_text(json.dumps(payload, indent=2))
    outcomes.exit()


@torch.inference_mode()
def vocoder_quality(speech_tokenizer: Path, dtypes: list[str], frames: int) -> dict[str, dict[str, float]]:
    """Per vocoder dtype: SNR (dB) of its audio against float32's and the mean absolute difference of
    their log-mel spectrograms (natural log, 128 bands), on the same random codes."""
    codes = torch.randint(0, 2048, (frames, 16), generator=torch.Generator().manual_seed(1))
    want = Vocoder.load(speech_tokenizer)(codes)
    mel = LogMel(24000)
    out = {}
    for dtype in filter(None, dtypes):
        int8 = dtype == "int8"
        got = Vocoder.load(speech_tokenizer, dtype=torch.float32 if int8 else getattr(torch, dtype), int8=int8)(codes)
        got = got.float()
        snr = 10 * torch.log10(want.pow(2).mean() / (got - want).pow(2).mean())
        distance = (mel(got[None]) - mel(want[None])).abs().mean()
        out[dtype] = {"snr_db": float(snr), "log_mel_l1": float(distance)}
    return out


if __name__ == "__main__":
    main()
