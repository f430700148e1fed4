"""Training's batches one step ahead, on the device: the next batch read and moved while the caller's step computes.

eyrie.core.ahead reads the next batch's rows in a background thread; here that thread also moves them to the
device. On CUDA the rows are read into pinned host memory and copied on a side stream without blocking, so the
copy overlaps the step instead of following its host sync; the caller's stream waits for the copy on the GPU
(an event, no host sync). Elsewhere the batches are the same, moved in the background thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

import torch

from eyrie.core.ahead import loaded_ahead

Item = TypeVar("Item")
Loaded = TypeVar("Loaded")
Batch = dict  # tensors (on the device, or host copies), and other values


def pins_memory(device) -> bool:
    """Whether batches for device are read into pinned host memory: on CUDA only, as pinning needs its runtime."""
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def batches_on_device(
    load: Callable[[Item], Loaded], to_device: Callable[[Loaded], Batch], items: Iterable[Item], device, *, ahead: bool = True,
) -> Iterator[tuple[Loaded, Batch]]:
    """(load(item), to_device(that)) for each item in order, the next item's load, and with ahead its to_device too,
    running in one background thread while the caller works on this one.

    With ahead on CUDA, to_device runs on a side stream and the batch is handed over once the caller's current
    stream waits for its copies; its device tensors are recorded on that stream, so their memory is not reused
    while the step still reads them. Without ahead (a to_device that runs a model) to_device runs in the caller's
    thread as each item is taken. An error in load or to_device reaches the caller at its item; closing the
    iterator waits for the item in flight, its copies included, so no thread or copy outlives the loop.
    """
    if not ahead:
        with contextlib.closing(loaded_ahead(load, items)) as loads:
            for loaded in loads:
                yield loaded, to_device(loaded)
        return
    side = torch.cuda.Stream(_cuda_device(device)) if pins_memory(device) else None

    def load_and_move(item):
        loaded = load(item)
        return (loaded, *_moved_on(side, to_device, loaded))

    with contextlib.closing(loaded_ahead(load_and_move, items)) as moves:
        for loaded, batch, copied in moves:
            if copied is not None:
                _hand_over(batch, copied, side.device)
            yield loaded, batch


def _cuda_device(device) -> torch.device:
    """device with its index: the background thread's current device need not be the caller's."""
    device = torch.device(device)
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def _moved_on(side, to_device: Callable[[Loaded], Batch], loaded: Loaded) -> tuple[Batch, torch.cuda.Event | None]:
    """to_device(loaded), and on CUDA (side: a stream) the event its copies and conversions end with."""
    if side is None:
        return to_device(loaded), None
    copied = torch.cuda.Event(blocking=True)  # blocking: this thread sleeps, rather than spins, while it waits
    with torch.cuda.device(side.device), torch.cuda.stream(side):
        try:
            batch = to_device(loaded)
        finally:
            copied.record(side)
            # The pinned host rows may be freed once the copies have read them, and closing leaves none in flight.
            copied.synchronize()
    return batch, copied


def _hand_over(batch: Batch, copied: torch.cuda.Event, device: torch.device) -> None:
    """Order the caller's stream after the batch's copies, on the GPU, and tie the batch's memory to that stream."""
    stream = torch.cuda.current_stream(device)
    stream.wait_event(copied)
    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.is_cuda:
            value.record_stream(stream)
