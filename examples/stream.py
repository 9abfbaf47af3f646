"""Stream speech while it is generated: to the speaker when `sounddevice` is installed, else into a
WAV file that grows chunk by chunk (`-o`).

    python examples/stream.py --model Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice "Hello from Kazeia."
    python examples/stream.py --model demo-checkpoint -o hello.wav --max-new-tokens 40 "Hello."
"""

from __future__ import annotations

import argparse

from kazeia import Engine
from kazeia.audio import open_audio_writer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("text")
    parser.add_argument("--model", required=True, help="checkpoint directory or hub id")
    parser.add_argument("--voice", default="ryan")
    parser.add_argument("-o", "--output", help="write a WAV file instead of playing")
    parser.add_argument("--seed", type=int, help="the same seed gives the same audio")
    parser.add_argument("--max-new-tokens", type=int, help="frame cap (random-weight checkpoints rarely stop)")
    args = parser.parse_args()

    engine = Engine.load(args.model)
    stream = engine.stream(args.text, voice=args.voice, seed=args.seed, max_new_tokens=args.max_new_tokens)
    if args.output:
        with stream, open_audio_writer(args.output) as wav:
            for chunk in stream:  # the first chunk comes after one frame (80 ms of audio)
                wav.write(chunk.audio)
    else:
        import sounddevice  # optional: pip install sounddevice

        with stream, sounddevice.OutputStream(samplerate=24000, channels=1, dtype="float32") as speaker:
            for chunk in stream:
                speaker.write(chunk.audio)
    m = stream.metrics  # set once the last chunk is out
    if m is not None:
        print(f"{m.audio_s:.2f} s of audio, first audio after {m.ttfb_s:.2f} s, RTF {m.rtf:.2f}")


if __name__ == "__main__":
    main()
