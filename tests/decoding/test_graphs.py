"""Replay's capture, with CUDA's calls faked: what it does around a capture is host-side and runs anywhere."""

import contextlib
import gc

import pytest
import torch

from eyrie.decoding import graphs


class _Stream:
    def wait_stream(self, other):
        pass


class _Graph:
    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's stream and graph calls replaced; records whether the collector was on inside each capture."""
    collector_on_in_capture = []

    @contextlib.contextmanager
    def capture(graph, pool=None):
        collector_on_in_capture.append(gc.isenabled())
        yield

    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", _Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(torch.cuda, "graph", capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    return collector_on_in_capture


@pytest.fixture
def collector_restored():
    was_enabled = gc.isenabled()
    yield
    if was_enabled:
        gc.enable()
    else:
        gc.disable()


def test_the_collector_is_off_during_a_capture_and_back_on_after(fake_cuda, collector_restored):
    """A collection mid-capture can destroy a finished decoder's graphs and invalidate the capture (seen on the H200)."""
    gc.enable()
    calls = []
    replay = graphs.Replay(lambda: calls.append(1), use_graph=True, failures=[])
    assert fake_cuda == [False]
    assert gc.isenabled()
    assert len(calls) == graphs.WARMUP_REPLAYS + 1  # the warm-up runs, then the captured one
    replay()
    assert replay.graph.replays == 1 and len(calls) == graphs.WARMUP_REPLAYS + 1


def test_a_collector_the_caller_had_off_stays_off(fake_cuda, collector_restored):
    gc.disable()
    graphs.Replay(lambda: None, use_graph=True, failures=[])
    assert fake_cuda == [False]
    assert not gc.isenabled()


def test_a_failed_capture_turns_the_collector_back_on_and_runs_eagerly(fake_cuda, collector_restored, monkeypatch):
    gc.enable()

    @contextlib.contextmanager
    def failing_capture(graph, pool=None):
        raise RuntimeError("operation failed due to a previous error during capture")
        yield

    monkeypatch.setattr(torch.cuda, "graph", failing_capture)
    failures, calls = [], []
    with pytest.warns(UserWarning, match="CUDA graph capture failed 2 times"):
        replay = graphs.Replay(lambda: calls.append(1), use_graph=True, failures=failures)
    assert gc.isenabled()
    assert replay.graph is None and failures == ["RuntimeError: operation failed due to a previous error during capture"]
    replay()
    assert len(calls) == graphs.WARMUP_REPLAYS + 1


def test_a_capture_invalidated_once_is_taken_again_and_replays_as_a_graph(fake_cuda, collector_restored, monkeypatch, recwarn):
    """What the H200 saw (a graph freed mid-capture) fails one capture; the second, after a collection, holds."""
    attempts = []

    @contextlib.contextmanager
    def flaky_capture(graph, pool=None):
        attempts.append(graph)
        if len(attempts) == 1:
            raise RuntimeError("operation failed due to a previous error during capture")
        yield

    monkeypatch.setattr(torch.cuda, "graph", flaky_capture)
    failures, calls = [], []
    replay = graphs.Replay(lambda: calls.append(1), use_graph=True, failures=failures)
    assert len(attempts) == 2 and replay.graph is attempts[1] and failures == []
    assert not [w for w in recwarn if "CUDA graph capture failed" in str(w.message)]
    replay()
    assert replay.graph.replays == 1


def test_replays_given_one_pool_capture_into_it(fake_cuda, monkeypatch):
    """A batched engine's greedy steps and rounds share one memory pool (graphs.shared_pool): the pool reaches every capture."""
    pools = []

    @contextlib.contextmanager
    def capture(graph, pool=None):
        pools.append(pool)
        yield

    monkeypatch.setattr(torch.cuda, "graph", capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: ("pool", 7))
    shared = graphs.shared_pool(use_graphs=True)
    for _ in range(3):
        graphs.Replay(lambda: None, use_graph=True, failures=[], pool=shared)
    graphs.Replay(lambda: None, use_graph=True, failures=[])  # a graph of its own
    assert pools == [("pool", 7)] * 3 + [None]
    assert graphs.shared_pool(use_graphs=False) is None  # eager engines hold no pool
