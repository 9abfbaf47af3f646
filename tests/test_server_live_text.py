"""Live text over the WebSocket: `input_text.append` / `input_text.end`, spoken while the text arrives.

A simulated LLM sends its reply token by token to a real uvicorn on 127.0.0.1, holding back the rest
until the first audio has come and the engine waits for more text; the speech must be the exact
audio of the whole text streamed in the streaming text layout with the same seed. The protocol's
edges (ordering, limits, errors, idle timeout, cancel) go through Starlette's TestClient, on a server
whose text_timeout no pause of a test can reach, but for the one test of that timeout.
"""

import json
import threading
import time

import numpy as np
import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient
from server_support import FRAME_BYTES, LiveServer, TextStarved, llm_tokens, whole_text_pcm
from server_support import ws_receive as receive

from kazeia.server import Limits, ServerConfig, create_app

ROUTE = "/v1/audio/speech/stream"
REPLY = "Hello there! I am a language model, and this reply is spoken while I am still writing it."
SESSION = dict(voice="serena", language="english", seed=23, ignore_eos=True, max_new_tokens=48)
FIRST_TOKENS = 4  # sent before the speech starts: "Hello there! I", three stable tokens
LONG_WAIT_S = 120.0  # a text_timeout that no test waits out (but the one that tests it)


def test_simulated_llm_is_spoken_while_it_writes(engines):
    from websockets.sync.client import connect

    engine = engines["0.6B-custom"]
    tokens = llm_tokens(REPLY)
    assert len(tokens) >= 20 and "".join(tokens) == REPLY
    config = ServerConfig("tiny-custom", limits=Limits(max_new_tokens=64), text_timeout=LONG_WAIT_S)
    app = create_app(engine, config)
    heard = threading.Event()  # the first audio has come
    with TextStarved() as starved, LiveServer(app) as live, connect(live.url.replace("http", "ws") + ROUTE) as ws:
        ws.send(json.dumps({"type": "session.update", "session": SESSION}))
        assert json.loads(ws.recv(timeout=10))["type"] == "session.updated"
        held_back = {}

        def llm() -> None:  # the first tokens; the rest once the speech has started; then the end
            for token in tokens[:FIRST_TOKENS]:
                ws.send(json.dumps({"type": "input_text.append", "text": token}))
            held_back["until_audio"] = heard.wait(60)
            starved.clear()  # the engine has spoken what it had and waits for more text
            held_back["until_starved"] = starved.wait(60)
            for token in tokens[FIRST_TOKENS:]:
                ws.send(json.dumps({"type": "input_text.append", "text": token}))
                time.sleep(0.01)  # the pace of a fast LLM
            ws.send(json.dumps({"type": "input_text.end"}))

        writer = threading.Thread(target=llm)
        writer.start()
        events, pcm = [], b""
        while not events or events[-1]["type"] not in ("audio.done", "error"):
            message = ws.recv(timeout=30)
            if isinstance(message, bytes):
                heard.set()
                pcm += message
            else:
                events.append(json.loads(message))
        writer.join(10)
    assert held_back == {"until_audio": True, "until_starved": True}, "speech started only after the last token"
    start, done = events[0], events[-1]
    assert [e["type"] for e in events] == ["audio.start", "audio.done"], events
    assert start["utterance"] == done["utterance"] == 1 and start["seed"] == 23
    assert done["status"] == "completed"
    expected = whole_text_pcm(engine, REPLY, **{k: v for k, v in SESSION.items()})
    assert len(pcm) == 47 * FRAME_BYTES and pcm == expected  # identical codes give identical samples
    m = done["metrics"]
    assert m["frames"] == 47 and m["text_wait_frames"] > 0 and m["first_text_to_audio_s"] > 0


LIMITS = Limits(max_input_chars=40, max_new_tokens=64, max_pending_utterances=2)


@pytest.fixture(scope="module")
def app(engines):
    return create_app(engines["0.6B-custom"], ServerConfig("tiny-custom", limits=LIMITS, text_timeout=LONG_WAIT_S))


@pytest.fixture(scope="module")
def client(app):
    with TestClient(app) as client:
        yield client


def until_closed(ws, count: int, speaking: int | None = None) -> tuple[list[dict], dict[int, bytes]]:
    """Events until `count` utterances have ended (audio.done or an error with a number), and the
    PCM received between each audio.start (or `speaking`, already started) and its end."""
    events, pcm, ended = [], {} if speaking is None else {speaking: b""}, 0
    while ended < count:
        item = receive(ws)
        if isinstance(item, bytes):
            pcm[speaking] += item
            continue
        events.append(item)
        if item["type"] == "audio.start":
            speaking = item["utterance"]
            pcm[speaking] = b""
        elif item["type"] == "audio.done" or (item["type"] == "error" and item["utterance"] is not None):
            ended += 1
    return events, pcm


def append(ws, text) -> None:
    ws.send_json({"type": "input_text.append", "text": text})


def test_live_and_whole_texts_queue_in_order_and_append_after_end_opens_the_next(client, engines):
    options = dict(voice="ryan", seed=4, max_new_tokens=10, ignore_eos=True)
    with client.websocket_connect(ROUTE) as ws:
        ws.send_json({"type": "session.update", "session": options})
        assert receive(ws)["type"] == "session.updated"
        append(ws, "First, ")  # opens utterance 1
        ws.send_json({"type": "input_text", "text": "Second."})  # queued behind it
        append(ws, "live.")
        ws.send_json({"type": "input_text.end"})
        append(ws, "Third")  # after the end: a new utterance
        ws.send_json({"type": "input_text.end"})
        ws.send_json({"type": "input_text.end"})  # nothing open any more
        events, pcm = until_closed(ws, 3)
    refused = [e for e in events if e["type"] == "error"]
    assert len(refused) == 1 and refused[0]["utterance"] is None and refused[0]["error"]["code"] == "no_open_utterance"
    done = [(e["utterance"], e["status"]) for e in events if e["type"] == "audio.done"]
    assert done == [(1, "completed"), (2, "completed"), (3, "completed")]
    engine = engines["0.6B-custom"]
    assert pcm[1] == whole_text_pcm(engine, "First, live.", **options)
    assert pcm[3] == whole_text_pcm(engine, "Third", **options)
    assert len(pcm[2]) == 9 * FRAME_BYTES  # a whole text, in the session's (default) layout


def test_live_text_over_the_limit_fails_its_utterance_and_the_rest_is_dropped(client, app):
    with client.websocket_connect(ROUTE) as ws:
        ws.send_json(
            {"type": "session.update", "session": {"voice": "aiden", "max_new_tokens": 64, "ignore_eos": True}}
        )
        receive(ws)
        append(ws, "x" * 30)
        append(ws, "y" * 11)  # 41 characters in all: over the limit of 40
        events, _ = until_closed(ws, 1)
        failed = events[-1]
        assert failed["type"] == "error" and failed["utterance"] == 1
        assert failed["error"]["code"] == "string_above_max_length" and "41" in failed["error"]["message"]
        append(ws, "more of the same reply")  # dropped: utterance 1 is still open
        ws.send_json({"type": "input_text.end"})
        ws.send_json({"type": "session.update", "session": {"voice": "aiden", "max_new_tokens": 3}})
        assert receive(ws)["type"] == "session.updated"  # nothing came in between
        append(ws, "   ")
        ws.send_json({"type": "input_text.end"})
        events, _ = until_closed(ws, 1)
    empty = events[-1]
    assert empty["type"] == "error" and empty["utterance"] == 2, events
    assert empty["error"]["param"] == "text" and "input is empty" in empty["error"]["message"]
    assert app.state.kazeia.worker.active == 0


def test_a_live_text_that_stops_arriving_times_out(engines):
    app = create_app(engines["0.6B-custom"], ServerConfig("tiny-custom", limits=LIMITS, text_timeout=0.4))
    with TestClient(app) as client, client.websocket_connect(ROUTE) as ws:
        ws.send_json(
            {"type": "session.update", "session": {"voice": "vivian", "max_new_tokens": 64, "ignore_eos": True}}
        )
        receive(ws)
        started = time.perf_counter()
        append(ws, "Hello there, ")  # and then nothing for longer than text_timeout (0.4 s)
        events, _ = until_closed(ws, 1)
        waited = time.perf_counter() - started
        timeout = events[-1]
        assert timeout["type"] == "error" and timeout["utterance"] == 1, events
        assert timeout["error"]["code"] == "text_timeout" and timeout["error"]["param"] == "text"
        assert "0.4 s" in timeout["error"]["message"] and waited >= 0.4
        append(ws, "too late.")  # dropped
        ws.send_json({"type": "input_text.end"})
        ws.send_json({"type": "session.update", "session": {"voice": "vivian", "max_new_tokens": 3}})
        assert receive(ws)["type"] == "session.updated"
        ws.send_json({"type": "input_text", "text": "Back again."})  # whole: no pause can time it out
        events, _ = until_closed(ws, 1)
    assert (events[-1]["type"], events[-1]["utterance"], events[-1]["status"]) == ("audio.done", 2, "completed")


def test_cancel_stops_a_live_utterance_that_waits_for_text(client, app):
    worker = app.state.kazeia.worker
    with client.websocket_connect(ROUTE) as ws:
        ws.send_json({"type": "session.update", "session": {"voice": "eric", "max_new_tokens": 64, "ignore_eos": True}})
        receive(ws)
        append(ws, "Waiting for the rest of ")
        assert receive(ws)["type"] == "audio.start"
        assert worker.active == 1  # submitted, and waiting for the rest of its text
        jobs = len(worker.records)
        ws.send_json({"type": "cancel"})
        events, pcm = until_closed(ws, 1, speaking=1)
        assert (events[-1]["type"], events[-1]["status"]) == ("audio.done", "cancelled")
        append(ws, "the sentence.")  # still utterance 1, which was cancelled: dropped
        ws.send_json({"type": "input_text.end"})
        append(ws, "A new one.")
        ws.send_json({"type": "cancel"})  # cancels utterance 2 wherever it is
        events, _ = until_closed(ws, 1)
        assert (events[-1]["utterance"], events[-1]["status"]) == (2, "cancelled")
        ws.send_json({"type": "input_text.end"})
    assert len(worker.records) > jobs and worker.records[jobs].status == "cancelled"
    assert np.frombuffer(pcm[1], "<i2").size < 63 * 1920
