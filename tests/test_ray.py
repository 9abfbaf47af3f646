"""Kazeia on Ray Serve (kazeia/server/rayserve.py, rayapp.py): two replicas of a tiny Base checkpoint
on a two-node Ray cluster on the loopback, against a single-process `kazeia serve` on the same
voices directory: both replicas answer (by `x-kazeia-replica`), with its bytes; a voice made
through one is spoken and deleted through both; a replica killed mid-stream cuts its client's
stream, the other goes on and Ray brings the dead one back; `kazeia serve --replicas 2` stops
what it started on SIGTERM. Every wait is bounded; only processes started here are signalled,
by their ids. Skipped without the `ray` extra."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
pytest.importorskip("fastapi")
import httpx  # noqa: E402
import soundfile  # noqa: E402
from server_support import free_port, sse_audio, sse_events, start_cli_server, stop_process  # noqa: E402
from websockets.exceptions import ConnectionClosed  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

from kazeia.server.rayapp import build  # noqa: E402
from kazeia.server.rayserve import APP_NAME  # noqa: E402

HEADER = "x-kazeia-replica"
VOICE = "shared"
SPEECH = {
    "model": "tiny",
    "input": "Scale out.",
    "voice": VOICE,
    "seed": 7,
    "max_new_tokens": 24,
    "response_format": "pcm",
}
SPEECH_S = 120  # bound of one request (a replica restarting may hold the first ones)
METRICS_S = 90  # bound of the wait for Ray's metrics export to show a replica's figures
METRICS_PORTS: list[int] = []  # the cluster's nodes' metrics endpoints


def reference_wav() -> bytes:
    """Two seconds of a voiced-like signal (x-vector-only cloning needs no transcript)."""
    t = np.arange(48000) / 24000
    audio = 0.3 * np.sin(2 * np.pi * 140 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))
    out = io.BytesIO()
    soundfile.write(out, audio.astype(np.float32), 24000, format="WAV", subtype="PCM_16")
    return out.getvalue()


def create_voice(url: str, name: str) -> httpx.Response:
    files = {"audio": ("ref.wav", reference_wav(), "audio/wav")}
    return httpx.post(url + "/v1/audio/voices", data={"name": name, "x_vector_only": "true"}, files=files, timeout=60)


@pytest.fixture(scope="class")
def cluster():
    """A head and a second node (one CPU each) on the loopback; Ray Serve's proxy on a free port."""
    from ray.cluster_utils import Cluster

    metrics = [free_port(), free_port()]  # each node's Prometheus endpoint (Ray's metrics export)
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "metrics_export_port": metrics[0]})
    try:
        nodes.add_node(num_cpus=1, metrics_export_port=metrics[1])
        ray.init(address=nodes.address)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        METRICS_PORTS[:] = metrics
        yield f"http://127.0.0.1:{port}"
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            nodes.shutdown()


@pytest.fixture(scope="class")
def voices_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("shared-voices")


@pytest.fixture(scope="class")
def service(cluster, tiny_checkpoints, voices_dir) -> str:
    """Two replicas of the tiny Base checkpoint, built as `serve run kazeia.server.rayapp:build` does."""
    args = {"model": tiny_checkpoints["0.6B-base"], "served_model_name": "tiny", "replicas": 2, "threads": 1}
    app = build({**args, "voices_dir": voices_dir, "allow_ignore_eos": "true", "log_level": "warning"})
    serve.run(app, name=APP_NAME, route_prefix="/")
    return cluster


@pytest.fixture(scope="class")
def single(tiny_checkpoints, voices_dir, tmp_path_factory):
    """The same checkpoint and voices directory in one `kazeia serve` process, with one thread."""
    log = tmp_path_factory.mktemp("single") / "serve.log"
    flags = ("--threads", "1", "--voices-dir", str(voices_dir), "--served-model-name", "tiny", "--allow-ignore-eos")
    process, url = start_cli_server(tiny_checkpoints["0.6B-base"], *flags, log=log)
    yield url
    stop_process(process)


@pytest.fixture(scope="class")
def voice(service) -> str:
    r = create_voice(service, VOICE)
    assert r.status_code == 201, r.text
    return r.headers[HEADER]


def replicas_seen(url: str, path: str = "/health", want: int = 2, tries: int = 40) -> dict[str, httpx.Response]:
    """Replica id -> an answer of it, asking until `want` replicas answered (or `tries` asked)."""
    seen: dict[str, httpx.Response] = {}
    for _ in range(tries):
        r = httpx.get(url + path, timeout=SPEECH_S)
        assert r.status_code == 200, r.text
        seen.setdefault(r.headers[HEADER], r)
        if len(seen) >= want:
            break
    return seen


def speech(url: str, **fields) -> httpx.Response:
    return httpx.post(url + "/v1/audio/speech", json={**SPEECH, **fields}, timeout=SPEECH_S)


def ws_pcm(url: str, **session) -> bytes:
    """The PCM of one whole text spoken over the WebSocket."""
    with connect("ws" + url[len("http") :] + "/v1/audio/speech/stream", open_timeout=30, close_timeout=5) as ws:
        fields = {k: v for k, v in SPEECH.items() if k not in ("model", "input", "response_format")}
        ws.send(json.dumps({"type": "session.update", "session": {**fields, **session}}))
        assert json.loads(ws.recv(timeout=SPEECH_S))["type"] == "session.updated"
        ws.send(json.dumps({"type": "input_text", "text": SPEECH["input"]}))
        pcm = b""
        while True:
            message = ws.recv(timeout=SPEECH_S)
            if isinstance(message, bytes):
                pcm += message
            elif (event := json.loads(message))["type"] == "audio.done":
                assert event["status"] == "completed", event
                return pcm


def replica_pid(replica: str) -> int:
    """The process of a replica, from Ray's state API (its actor is named after the replica id)."""
    from ray.util.state import list_actors

    for actor in list_actors(filters=[("state", "=", "ALIVE")], limit=1000):
        if (actor.name or "").endswith("#" + replica):
            return actor.pid
    raise LookupError(f"no live actor for replica {replica}")


@pytest.mark.usefixtures("voice")
class TestTwoReplicas:
    def test_every_answer_names_its_replica_and_both_answer(self, service):
        seen = replicas_seen(service)
        assert len(seen) == 2 and all(r.json()["status"] == "ok" for r in seen.values())
        assert all(len(replica) >= 4 and replica.isalnum() for replica in seen)
        models = httpx.get(service + "/v1/models", timeout=30)
        assert models.json()["data"][0]["id"] == "tiny" and models.headers[HEADER] in seen
        page = httpx.get(service + "/", timeout=30)
        assert page.status_code == 200 and "<html" in page.text.lower() and page.headers[HEADER] in seen
        missing = httpx.get(service + "/nowhere", timeout=30)
        assert (
            missing.status_code == 404 and missing.json()["error"]["code"] == "not_found" and HEADER in missing.headers
        )

    def test_same_bytes_as_one_process(self, service, single):
        expected = speech(single)
        assert expected.status_code == 200 and len(expected.content) > 0
        by_replica: dict[str, bytes] = {}
        for _ in range(40):  # both replicas, each the single process's bytes
            r = speech(service, response_format="pcm")
            assert r.status_code == 200 and r.content == expected.content
            by_replica[r.headers[HEADER]] = r.content
            if len(by_replica) == 2:
                break
        assert len(by_replica) == 2
        wav = speech(service, response_format="wav")
        assert wav.content == speech(single, response_format="wav").content
        sse = speech(service, response_format="pcm", stream_format="sse")
        assert sse_audio(sse_events(sse.text)) == expected.content
        assert sse.text == speech(single, response_format="pcm", stream_format="sse").text
        assert ws_pcm(service) == ws_pcm(single) == expected.content

    def test_a_voice_made_on_one_replica_is_spoken_and_deleted_on_both(self, service, voice):
        made_on = voice
        spoken = {}
        for _ in range(40):
            r = speech(service)
            assert r.status_code == 200, r.text
            spoken[r.headers[HEADER]] = r.content
            if len(spoken) == 2:
                break
        assert made_on in spoken and len(spoken) == 2 and len(set(spoken.values())) == 1
        listed = replicas_seen(service, "/v1/audio/voices")
        assert len(listed) == 2 and all(VOICE in [v["id"] for v in r.json()["data"]] for r in listed.values())

        # One name created through both at once: exactly one 201, the other 409.
        results: list[httpx.Response] = []
        gate = threading.Barrier(2)

        def make() -> None:
            gate.wait(30)
            results.append(create_voice(service, "twin"))

        threads = [threading.Thread(target=make) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert sorted(r.status_code for r in results) == [201, 409], [r.text for r in results]

        gone = httpx.delete(service + "/v1/audio/voices/twin", timeout=30)
        assert gone.status_code == 200 and gone.json()["deleted"] is True
        after = replicas_seen(service, "/v1/audio/voices")
        assert len(after) == 2 and all("twin" not in [v["id"] for v in r.json()["data"]] for r in after.values())
        refused = {}
        for _ in range(40):
            r = speech(service, voice="twin")
            assert r.status_code == 400 and "unknown voice" in r.json()["error"]["message"]
            refused[r.headers[HEADER]] = r
            if len(refused) == 2:
                break
        assert len(refused) == 2

    def test_each_replicas_figures_reach_rays_metrics_export(self, service):
        replicas = set()
        for _ in range(40):
            r = speech(service)
            assert r.status_code == 200
            replicas.add(r.headers[HEADER])
            if len(replicas) == 2:
                break
        assert len(replicas) == 2
        ends = time.monotonic() + METRICS_S
        while True:  # every replica's audio seconds, tagged with its id, on a node's endpoint
            text = "".join(httpx.get(f"http://127.0.0.1:{p}/metrics", timeout=30).text for p in METRICS_PORTS)
            lines = [x for x in text.splitlines() if x.startswith("ray_kazeia_audio_seconds_total{")]
            tagged = {replica for replica in replicas for x in lines if f'replica="{replica}"' in x}
            if tagged == replicas or time.monotonic() > ends:
                break
            time.sleep(1)
        assert tagged == replicas, lines
        assert all(float(x.rsplit(" ", 1)[1]) > 0 for x in lines)
        assert any(x.startswith("ray_kazeia_streams_behind{") for x in text.splitlines())

    def test_a_replica_killed_mid_stream(self, service, single):
        long = dict(response_format="pcm", ignore_eos=True, max_new_tokens=4096)  # ~16 MB: outlasts buffers
        short = dict(response_format="pcm", ignore_eos=True, max_new_tokens=40)
        expected_short = speech(single, **short).content
        with httpx.Client(timeout=httpx.Timeout(SPEECH_S, read=30)) as client:
            with client.stream("POST", service + "/v1/audio/speech", json={**SPEECH, **long}) as cut:
                assert cut.status_code == 200
                doomed = cut.headers[HEADER]
                cut_chunks = cut.iter_raw()
                got = next(cut_chunks)
                with client.stream("POST", service + "/v1/audio/speech", json={**SPEECH, **short}) as other:
                    assert other.status_code == 200 and other.headers[HEADER] != doomed  # the idle one
                    survivor = other.headers[HEADER]
                    os.kill(replica_pid(doomed), signal.SIGKILL)
                    killed = time.monotonic()
                    with pytest.raises(httpx.RemoteProtocolError):  # cut: the chunked body never ends
                        for chunk in cut_chunks:
                            got += chunk
                    assert time.monotonic() - killed < 30 and len(got) < 4095 * 3840
                    assert other.read() == expected_short  # the other replica's stream goes on, whole
        after = speech(service, **short)  # at once: the replacement is still loading
        assert after.status_code == 200 and after.content == expected_short and after.headers[HEADER] == survivor
        replaced(service, doomed)
        assert speech(service, **short).content == expected_short

    def test_a_websocket_on_a_killed_replica_is_closed_at_once(self, service):
        """A live text keeps its utterance open (its text has not ended) when the replica dies."""
        with connect("ws" + service[len("http") :] + "/v1/audio/speech/stream", open_timeout=30) as ws:
            doomed = ws.response.headers[HEADER]
            ws.send(json.dumps({"type": "session.update", "session": {"voice": VOICE, "seed": 3}}))
            assert json.loads(ws.recv(timeout=SPEECH_S))["type"] == "session.updated"
            ws.send(json.dumps({"type": "input_text.append", "text": "Hello there, and the text goes on"}))
            assert json.loads(ws.recv(timeout=SPEECH_S))["type"] == "audio.start"
            os.kill(replica_pid(doomed), signal.SIGKILL)
            events = []
            with pytest.raises(ConnectionClosed):  # not a timeout: closed, without a close frame
                while True:
                    message = ws.recv(timeout=30)
                    if isinstance(message, str):
                        events.append(json.loads(message)["type"])
            assert "audio.done" not in events and ws.protocol.close_code == 1006
        replaced(service, doomed)


def replaced(url: str, dead: str) -> None:
    """Wait (at most 180 s) until two live replicas answer, neither of them `dead`."""
    deadline, live = time.monotonic() + 180, set()
    while time.monotonic() < deadline and len(live) < 2:
        r = httpx.get(url + "/health", timeout=SPEECH_S)
        if r.status_code == 200 and r.headers[HEADER] != dead:
            live.add(r.headers[HEADER])
    assert len(live) == 2, f"no replica came back in the place of {dead}: {live}"


def descendants(pid: int) -> set[int]:
    """Processes under `pid` (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        return "Z" not in (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0])
    except OSError:
        return False


def test_kazeia_serve_replicas_stops_what_it_started_on_sigterm(tiny_checkpoints, tmp_path):
    port = free_port()
    command = [sys.executable, "-m", "kazeia", "serve", "--model", str(tiny_checkpoints["0.6B-custom"])]
    command += ["--replicas", "2", "--threads", "1", "--port", str(port), "--log-level", "warning"]
    log = tmp_path / "serve.log"
    process = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    started: set[int] = set()
    try:
        url, deadline, seen = f"http://127.0.0.1:{port}", time.monotonic() + 240, {}
        while time.monotonic() < deadline and len(seen) < 2:
            assert process.poll() is None, log.read_text()
            try:
                r = httpx.get(url + "/health", timeout=5)
                if r.status_code == 200:
                    seen[r.headers[HEADER]] = r
            except httpx.TransportError:
                time.sleep(0.5)
        assert len(seen) == 2, log.read_text()
        started = descendants(process.pid)
        assert started  # the local cluster's processes
        process.send_signal(signal.SIGTERM)
        assert process.wait(90) == 0, log.read_text()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(alive(p) for p in started):
            time.sleep(0.5)
        assert not [p for p in started if alive(p)], "processes of the local cluster outlived kazeia serve"
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health", timeout=5)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)
        for pid in started:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_replicas_that_cannot_load_say_why_and_the_command_fails(tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    command = [sys.executable, "-m", "kazeia", "serve", "--model", str(broken), "--replicas", "1", "--threads", "1"]
    command += ["--port", str(free_port())]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    output = done.stdout + done.stderr
    assert f"cannot load {broken}: CheckpointError" in output and "generation_config.json" in output
    assert "kazeia: error: the replicas could not be deployed" in output


def test_the_autoscaler_hears_streams_behind_real_time():
    """Ray's rule (requests in flight over the target per replica), and one replica more while
    any stream is behind real time; the options pass Ray Serve's own validation."""
    from types import SimpleNamespace

    from ray.serve.config import AutoscalingConfig

    from kazeia.server.rayserve import Scale, engine_policy

    options = Scale(2, 1, max_ongoing=6, target_ongoing=2, min_replicas=1, max_replicas=4).options()
    config = AutoscalingConfig(**options["autoscaling_config"])
    assert config.policy.get_policy() is not None

    def wanted(requests: float, behind: dict, running: int = 2) -> float:
        metrics = {"behind": behind, "streams": {}}
        ctx = SimpleNamespace(current_num_replicas=running, target_num_replicas=running, total_num_requests=requests,
                              config=config, aggregated_metrics=metrics)  # fmt: skip
        return engine_policy(ctx)[0]

    assert wanted(4, {"a": 0.0, "b": 0.0}) == 2  # two per replica: as many as now
    assert wanted(2, {"a": 0.0, "b": 0.0}) == 1 and wanted(8, {}) == 4
    assert wanted(2, {"a": 1.0, "b": 0.0}) == 3  # few requests, but one replica's listeners stall
    assert wanted(8, {"a": 1.0}) == 4
    assert wanted(0, {}, running=0) == 0
