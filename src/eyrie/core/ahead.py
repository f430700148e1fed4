"""Work one item ahead: load the next item in a background thread while the caller uses this one.

Training's host work per step (reading a batch's rows from the cache) then overlaps the device's
work on the previous batch instead of leaving the GPU idle while it runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

Item = TypeVar("Item")
Loaded = TypeVar("Loaded")


def loaded_ahead(load: Callable[[Item], Loaded], items: Iterable[Item]) -> Iterator[Loaded]:
    """load(item) for each item in order, the next one loading in one background thread while the caller works.

    An error in load reaches the caller when it asks for that item. Closing the iterator (or leaving it
    behind) waits for the one load in flight, so no thread outlives the loop.
    """
    items = iter(items)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="eyrie-ahead") as pool:
        pending = _submit(pool, load, items)
        while pending is not None:
            current = pending
            pending = _submit(pool, load, items)
            yield current.result()


def _submit(pool: ThreadPoolExecutor, load, items: Iterator):
    for item in items:
        return pool.submit(load, item)
    return None
