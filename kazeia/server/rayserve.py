"""`kazeia serve --replicas N`: the application `kazeia serve` runs, as N replicas on Ray Serve.

Each replica is one process with one `Engine` and the app `create_app` builds for it, exactly as
one `kazeia serve` process builds it (no endpoint is defined here): Ray Serve's HTTP proxy routes
requests to the replicas, health-checks them, restarts a dead one and, with autoscaling, adds and
removes them. Every response names its replica in the `x-kazeia-replica` header. Saved voices are
shared through the voices directory, which every node must see (server/store.py makes its writes
atomic and its limits count the directory). Needs the `ray` extra; nothing else in the package
imports this module. The autoscaler, when asked for, also hears each replica's streams behind real
time (`engine_policy`). Non-goals: a second copy of any route, the Wyoming server (one process).
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import FIFOMixin, RequestRouter

from .config import ServerConfig

log = logging.getLogger("kazeia.server")
APP_NAME = "kazeia"  # the Ray Serve application
DEPLOYMENT = "Kazeia"  # its one deployment: the replicas
REPLICA_HEADER = b"x-kazeia-replica"
HEALTH_PERIOD_S = 5.0  # Ray asks each replica `check_health` this often
DEPLOY_POLL_S = 0.5  # how often the deployment's state is read until it runs
STOP_S = 5.0  # streams still open this long after a replica is told to stop are cut (as `kazeia serve`'s)


@dataclass(frozen=True)
class Scale:
    """How many replicas, and how big each is."""

    replicas: int  # replicas at start (with autoscaling: the initial count)
    threads: int  # CPUs Ray reserves for a replica, and torch threads of its engine
    max_ongoing: int  # requests one replica takes at once (Ray queues more at the proxy)
    target_ongoing: int  # autoscaling: requests in flight per replica the autoscaler aims at
    min_replicas: int | None = None  # autoscaling bounds (both None: a fixed count)
    max_replicas: int | None = None
    gpus: int = 0  # GPUs Ray reserves for a replica (1 with --device cuda: one replica per GPU)

    def __post_init__(self) -> None:
        for name in ("replicas", "threads", "max_ongoing", "target_ongoing"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        low, high = self.min_replicas, self.max_replicas
        if (low is None) != (high is None):
            raise ValueError("--min-replicas and --max-replicas go together (autoscaling between them)")
        if low is not None and high is not None and not 0 <= low <= self.replicas <= high:
            raise ValueError(
                f"autoscaling needs 0 <= --min-replicas ({low}) <= --replicas ({self.replicas}) "
                f"<= --max-replicas ({high})"
            )

    def options(self) -> dict:
        """The deployment's options (Ray Serve's names)."""
        options: dict = dict(
            name=DEPLOYMENT,
            ray_actor_options={"num_cpus": self.threads, **({"num_gpus": self.gpus} if self.gpus else {})},
            max_ongoing_requests=self.max_ongoing,
            health_check_period_s=HEALTH_PERIOD_S,
            graceful_shutdown_timeout_s=STOP_S,
            request_router_config=RequestRouterConfig(request_router_class=SpreadRouter),
        )
        if self.min_replicas is None:
            return {**options, "num_replicas": self.replicas}
        autoscaling = {
            "min_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
            "initial_replicas": self.replicas,
            "target_ongoing_requests": self.target_ongoing,
            "policy": {"policy_function": f"{__name__}:engine_policy"},
        }
        return {**options, "autoscaling_config": autoscaling}


def engine_policy(ctx) -> tuple[float, dict]:
    """Replicas wanted (Ray Serve's custom autoscaling policy; its bounds, delays and smoothing
    still apply): Ray's own rule, requests in flight against `target_ongoing_requests` per replica,
    and at least one more while any replica has a stream behind real time (`behind`, from the
    replicas' `record_autoscaling_stats`): its listeners are stalling however few requests it holds."""
    running = ctx.current_num_replicas
    if running == 0:
        return ctx.target_num_replicas, {}
    wanted = ctx.total_num_requests / ctx.config.get_target_ongoing_requests()
    behind = sum((ctx.aggregated_metrics or {}).get("behind", {}).values())
    if behind > 0:
        wanted = max(wanted, running + 1)
    return wanted, {}


class SpreadRouter(FIFOMixin, RequestRouter):
    """Ray Serve's power of two choices over every replica, wherever it runs: two drawn at random,
    the one with fewer requests in flight taken. Ray's default router first tries the replicas on
    the proxy's own node, which piles compute-bound speech onto them while other nodes idle."""

    async def choose_replicas(self, candidate_replicas: list, pending_request=None) -> list[list]:
        drawn = list(candidate_replicas)
        random.shuffle(drawn)  # (the order breaks ties)
        return [drawn[:2]]


def scale_from(args: argparse.Namespace, config: ServerConfig, cpus: int | None) -> Scale:
    """The scale the flags ask for. Threads default to this machine's cores shared among the
    replicas (`cpus`: the local cluster's), or 1 on a cluster joined (its nodes are unknown here)."""
    replicas = args.replicas
    threads = args.threads or (max(1, cpus // max(1, replicas)) if cpus else 1)
    return Scale(
        replicas,
        threads,
        max_ongoing=config.max_batch + config.queue_size,
        target_ongoing=config.max_batch,
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        gpus=1 if str(getattr(args, "device", "cpu")).startswith("cuda") else 0,
    )


class ReplicaHeader:
    """ASGI middleware: `x-kazeia-replica: ID` on every HTTP response and WebSocket handshake."""

    def __init__(self, app, replica: str):
        self.app, self.value = app, replica.encode("ascii")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)

        async def tagged(message) -> None:
            if message["type"] in ("http.response.start", "websocket.accept", "websocket.http.response.start"):
                message = {**message, "headers": [*message.get("headers", ()), (REPLICA_HEADER, self.value)]}
            await send(message)

        await self.app(scope, receive, tagged)


class RayMetrics:
    """A replica's own figures (server/metrics.py) mirrored into Ray's metrics API every `period`
    seconds, so Ray's metrics export (each node's Prometheus endpoint) aggregates them over the
    replicas, tagged with the replica's id; Ray Serve's own request and latency metrics sit
    beside them."""

    OUTCOMES = ("completed", "cancelled", "failed")

    def __init__(self, state, replica: str, period: float = 5.0):
        from ray.util import metrics

        self.state, self.tags, self.period = state, {"replica": replica}, period
        keys = ("replica",)
        self.gauges = {
            name: metrics.Gauge(f"kazeia_{name}", help, tag_keys=keys)
            for name, help in (
                ("streams_active", "Utterances admitted and not finished, per replica."),
                ("queue_depth", "Utterances waiting for a serving thread, per replica."),
                ("streams_behind", "Streams behind real time now (a 250 ms buffer would be dry), per replica."),
            )
        }
        self.audio = metrics.Counter("kazeia_audio_seconds", "Seconds of audio generated.", tag_keys=keys)
        self.behind = metrics.Counter("kazeia_streams_fell_behind", "Utterances that fell behind.", tag_keys=keys)
        self.ended = metrics.Counter(
            "kazeia_utterances", "Utterances that ended, by outcome.", tag_keys=("replica", "outcome")
        )
        self._sent: dict[str, float] = {}  # counters' values already added
        threading.Thread(target=self._run, name="kazeia-ray-metrics", daemon=True).start()

    def _add(self, counter, key: str, value: float, **tags: str) -> None:
        delta = value - self._sent.get(key, 0.0)
        if delta > 0:
            counter.inc(delta, tags={**self.tags, **tags})
            self._sent[key] = value

    def publish(self) -> None:
        worker, figures = self.state.worker, self.state.metrics
        values = {"streams_active": worker.active, "queue_depth": worker.queue_depth, "streams_behind": worker.behind}
        for name, value in values.items():
            self.gauges[name].set(value, tags=self.tags)
        self._add(self.audio, "audio", figures.audio_seconds.value())
        self._add(self.behind, "behind", figures.fell_behind.value())
        for outcome in self.OUTCOMES:
            self._add(self.ended, outcome, figures.utterances.value(outcome=outcome), outcome=outcome)

    def _run(self) -> None:
        while True:
            try:
                self.publish()
            except Exception:  # a metrics hiccup must never stop the replica
                log.exception("replica metrics not published")
            time.sleep(self.period)


class Replica:
    """One replica: the engine `load(args)` gives, served by `create_app(engine, config)`."""

    def __init__(self, load: Callable, args: argparse.Namespace, config: ServerConfig):
        # Ray's id of this replica (random letters and digits: no host name, address or pid).
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.config = config
        level = getattr(args, "log_level", "info").upper()  # one line per utterance, as `kazeia serve`
        logging.basicConfig(format="%(levelname)s:     %(name)s: %(message)s", level=level)
        try:
            self.engine = load(args)
        except Exception as e:  # the reason goes to the replica's log; Ray marks it failed and retries
            log.error("replica %s cannot load %s: %s: %s", self.replica, args.model, type(e).__name__, e)
            raise
        self.state = None

    def __serve_build_asgi_app__(self):
        from .app import create_app

        app = create_app(self.engine, self.config)
        app.add_middleware(ReplicaHeader, replica=self.replica)
        self.state = app.state.kazeia
        self.metrics = RayMetrics(self.state, self.replica)
        log.info("replica %s ready: %s (process %d)", self.replica, self.config.model_name, os.getpid())
        return app

    def record_autoscaling_stats(self) -> dict[str, float]:
        """The engine's own load, for `engine_policy` (Ray reads it every few seconds): utterances
        in flight and streams behind real time."""
        if self.state is None:
            return {}
        return {"streams": float(self.state.worker.active), "behind": float(self.state.worker.behind)}

    def check_health(self) -> None:
        """Ray routes nothing to a replica whose check raises, and restarts it."""
        if self.state is None or not self.state.worker.running:
            raise RuntimeError(f"replica {self.replica}: the worker has stopped")


def application(load: Callable, args: argparse.Namespace, config: ServerConfig, scale: Scale):
    """The Ray Serve application: `scale.replicas` replicas of `Replica(load, args, config)`."""
    args = argparse.Namespace(**{**vars(args), "threads": scale.threads})
    deployment = serve.deployment(serve.ingress()(Replica))
    return deployment.options(**scale.options()).bind(load, args, config)


def run(load: Callable, args: argparse.Namespace, config: ServerConfig) -> None:
    """Deploy on the cluster at `args.ray_address` (or a local one started here), serve on
    --host:--port until SIGTERM or Ctrl-C, then remove what was started here: the whole local
    cluster, or on a cluster joined only this application."""
    import ray

    local = args.ray_address is None
    cpus = os.cpu_count() or 1
    scale = scale_from(args, config, cpus if local else None)
    if local and scale.replicas * scale.threads > cpus:
        raise ValueError(
            f"{scale.replicas} replicas of {scale.threads} threads need {scale.replicas * scale.threads} CPUs; "
            f"this machine has {cpus} (lower --threads or --replicas, or join a cluster with --ray-address)"
        )
    stop = threading.Event()
    ray.init(address="local" if local else args.ray_address, num_cpus=cpus if local else None)
    # After ray.init, which sets a SIGTERM handler of its own: a signal only sets `stop`.
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        serve.start(http_options={"host": args.host, "port": args.port}, proxy_location="HeadOnly")
        target = serve.RunTarget(application(load, args, config, scale), name=APP_NAME, route_prefix="/")
        serve.run_many([target], wait_for_ingress_deployment_creation=False, wait_for_applications_running=False)
        while not stop.wait(DEPLOY_POLL_S):  # deploying; a signal stops it
            state = serve.status().applications.get(APP_NAME)
            if state is not None and state.status == "DEPLOY_FAILED":  # the replicas' log says why
                raise ValueError(f"the replicas could not be deployed: {state.message}")
            if state is not None and state.status == "RUNNING":
                log.info("serving %d replicas on http://%s:%d", scale.replicas, args.host, args.port)
                break
        stop.wait()
    finally:
        try:
            if local:
                serve.shutdown()
            else:
                serve.delete(APP_NAME)
        finally:
            ray.shutdown()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
