"""eyrie.core.ahead.loaded_ahead: order kept, the next item loading while the caller holds this one, errors at their item."""

import threading

import pytest

from eyrie.core.ahead import loaded_ahead


def test_every_item_is_loaded_once_in_order():
    calls = []

    def load(x):
        calls.append(x)
        return x * 10

    assert list(loaded_ahead(load, range(5))) == [0, 10, 20, 30, 40]
    assert calls == [0, 1, 2, 3, 4]
    assert list(loaded_ahead(load, [])) == []


def test_the_next_item_loads_in_another_thread_while_the_caller_works_on_this_one():
    started = {k: threading.Event() for k in range(3)}
    threads = {}

    def load(k):
        threads[k] = threading.get_ident()
        started[k].set()
        return k

    loads = loaded_ahead(load, range(3))
    assert next(loads) == 0
    # The caller has item 0 and has not asked for item 1: its load has begun (or ended) all the same.
    assert started[1].wait(timeout=10)
    assert threads[1] != threading.get_ident()
    assert list(loads) == [1, 2]


def test_an_error_in_a_load_reaches_the_caller_at_that_item():
    def load(k):
        if k == 2:
            raise ValueError("shard 7 is corrupt")
        return k

    got = []
    with pytest.raises(ValueError, match="shard 7 is corrupt"):
        for value in loaded_ahead(load, range(5)):
            got.append(value)
    assert got == [0, 1]


def test_closing_early_waits_for_the_load_in_flight_and_loads_nothing_more():
    unblock, calls = threading.Event(), []

    def load(k):
        calls.append(k)
        if k == 1:
            unblock.wait(timeout=10)
        return k

    loads = loaded_ahead(load, range(10))
    assert next(loads) == 0
    threading.Timer(0.2, unblock.set).start()
    loads.close()  # returns once item 1's load has finished
    assert calls == [0, 1]
    assert not [t for t in threading.enumerate() if t.name.startswith("eyrie-ahead")]
