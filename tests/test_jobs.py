"""The helper threads behind the native products' splits (kazeia/native/jobs.c): each calling
thread's own helpers, results equal to one thread's whatever the callers do at once, a forked
child that splits work, and the helpers of a thread that has ended stopped with it."""

import os
import signal
import sys
import threading
import time

import pytest
import torch

from kazeia import cpu, native
from kazeia.int4 import Int4Linear
from kazeia.quant import QuantLinear, int8_supported

LIB = native.library()
pytestmark = pytest.mark.skipif(LIB is None, reason="the helpers are the native library's")
DEADLINE_S = 60  # how long a check waits for a child or for threads to end before it fails


def _layers():
    gen = torch.Generator().manual_seed(7)
    weight, bias = torch.randn(192, 256, generator=gen), torch.randn(192, generator=gen)
    layers = [Int4Linear.from_float(weight, bias, LIB)]
    if int8_supported(LIB) is None:
        layers.append(QuantLinear.from_float(weight, bias, LIB))
    return layers


def _tasks() -> int:
    return len(os.listdir("/proc/self/task"))


def test_callers_at_once_each_get_their_one_thread_results():
    """Four threads, each splitting products over its own team (2, 3, 4 and 5 threads) many times
    over, all at once: every result is the one-thread one, bit for bit."""
    layers = _layers()
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(8))
    with torch.inference_mode():
        alone = [layer(x) for layer in layers]
    start, failures = threading.Barrier(4), []

    def caller(threads: int):
        start.wait()
        with torch.inference_mode(), cpu.team(threads, openmp=False):
            for i in range(50):
                for layer, want in zip(layers, alone, strict=True):
                    rows = 1 + i % 9
                    if not torch.equal(layer(x[:rows]), want[:rows]):
                        failures.append((threads, type(layer).__name__, rows))

    callers = [threading.Thread(target=caller, args=(n,)) for n in (2, 3, 4, 5)]
    for thread in callers:
        thread.start()
    for thread in callers:
        thread.join()
    assert failures == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_splits_work_with_helpers_of_its_own():
    """The parent's helpers stay in the parent: a child forked after they ran starts its own, and
    its split products finish with the one-thread results (they would wait forever on helpers
    that are not there)."""
    layer = Int4Linear.from_float(torch.randn(128, 256), None, LIB)
    x = torch.randn(12, 256)
    with torch.inference_mode():
        alone = layer(x)
        with cpu.team(2, openmp=False):
            assert torch.equal(layer(x), alone)  # the parent's helper started
    pid = os.fork()
    if pid == 0:  # the child: report by exit status only
        code = 1
        try:
            with torch.inference_mode(), cpu.team(2, openmp=False):
                code = 0 if torch.equal(layer(x), alone) else 2
        finally:
            os._exit(code)
    watchdog = threading.Timer(DEADLINE_S, os.kill, (pid, signal.SIGKILL))  # a child that hangs is ended
    watchdog.start()
    try:
        status = os.waitpid(pid, 0)[1]
    finally:
        watchdog.cancel()
    assert os.waitstatus_to_exitcode(status) == 0, f"the forked child's split product did not finish (status {status})"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
def test_the_helpers_of_a_thread_that_ends_stop_with_it():
    """A thread that split products keeps helpers while it lives; once it has ended they are
    stopped and joined: threads that come and go leave no threads behind."""
    layer = Int4Linear.from_float(torch.randn(128, 256), None, LIB)
    x = torch.randn(12, 256)
    before, seen = _tasks(), []

    def split():
        with torch.inference_mode(), cpu.team(4, openmp=False):
            layer(x)
        seen.append(_tasks())

    for _ in range(5):
        thread = threading.Thread(target=split)
        thread.start()
        thread.join()
    assert min(seen) >= before + 4  # the thread itself and its three helpers, while it ran
    deadline = time.monotonic() + DEADLINE_S
    while _tasks() > before and time.monotonic() < deadline:  # the OS thread ends after join returns
        time.sleep(0.01)
    assert _tasks() <= before
