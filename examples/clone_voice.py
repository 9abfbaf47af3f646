"""Clone a voice once with a Base checkpoint, save it, and speak with it again later.

    python examples/clone_voice.py --model Qwen/Qwen3-TTS-12Hz-0.6B-Base --audio me.wav \
        --transcript "The words I say in me.wav." "Bonjour, c'est ma voix." -o cloned.wav
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kazeia import Engine, Voice
from kazeia.audio import write_audio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("text")
    parser.add_argument("--model", required=True, help="a Base checkpoint (directory or hub id)")
    parser.add_argument("--audio", required=True, help="3-10 s of one speaker (WAV/FLAC/OGG/MP3)")
    parser.add_argument("--transcript", required=True, help="what the reference audio says")
    parser.add_argument("--voice-file", default="me.voice", help="where the voice is kept")
    parser.add_argument("-o", "--output", default="cloned.wav")
    parser.add_argument("--seed", type=int, help="the same seed gives the same audio")
    parser.add_argument("--max-new-tokens", type=int, help="frame cap (random-weight checkpoints rarely stop)")
    args = parser.parse_args()

    engine = Engine.load(args.model)
    if not Path(args.voice_file).exists():  # encode the reference once...
        engine.create_voice(args.audio, ref_text=args.transcript).save(args.voice_file)
    voice = Voice.load(args.voice_file)  # ...and reuse it as often as needed
    speech = engine.synthesize(args.text, voice=voice, seed=args.seed, max_new_tokens=args.max_new_tokens)
    write_audio(args.output, speech.audio, speech.sample_rate)
    print(f"{args.output}: {speech.metrics.audio_s:.2f} s in the voice of {args.audio} ({voice.ref_frames} frames)")


if __name__ == "__main__":
    main()
