"""Speak through a running `kazeia serve` with the official OpenAI SDK (`pip install openai`).

    kazeia serve --model Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice &
    python examples/openai_client.py --base-url http://127.0.0.1:8000/v1 "Hello from Kazeia." -o hello.wav

The audio streams as it is generated; Kazeia's own options (seed, language, sampling) travel in
`extra_body`.
"""

from __future__ import annotations

import argparse

from openai import OpenAI


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("text")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--voice", default="ryan")
    parser.add_argument("-o", "--output", default="speech.wav")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--max-new-tokens", type=int, help="frame cap (random-weight checkpoints rarely stop)")
    args = parser.parse_args()

    client = OpenAI(base_url=args.base_url, api_key="not-needed")  # the server asks for no key
    model = client.models.list().data[0].id  # the one model this server serves
    extra = {"seed": args.seed, "language": "english"}
    if args.max_new_tokens:
        extra["max_new_tokens"] = args.max_new_tokens
    with client.audio.speech.with_streaming_response.create(
        model=model, voice=args.voice, input=args.text, response_format="wav", extra_body=extra
    ) as response:
        response.stream_to_file(args.output)
    print(f"{args.output}: seed {response.headers['x-kazeia-seed']}")


if __name__ == "__main__":
    main()
