"""eyrie.training.batches_ahead: the batches of load then to_device, in order, moved one step ahead (on CUDA on a side stream)."""

from __future__ import annotations

import threading

import pytest
import torch
from factories import random_samples, write_training_cache

from eyrie.hidden.cache import convert_cache
from eyrie.training.batches_ahead import batches_on_device, pins_memory
from eyrie.training.inputs import HiddenCache
from eyrie.training.online import OnlineStates

H = 16


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> HiddenCache:
    """A bf16 shard and an fp8 one (of other samples), so batches cover both stored dtypes and a batch over the two."""
    folder = tmp_path_factory.mktemp("batches_ahead")
    bf16 = write_training_cache(folder / "bf16.safetensors", random_samples(6, [9, 14, 5, 20, 11, 7], 50), H=H, layers=8, seed=1)
    other = write_training_cache(folder / "other.safetensors", random_samples(5, [12, 6, 17, 8, 10], 50, seed=2), H=H, layers=8, seed=2)
    convert_cache(other, folder / "fp8.safetensors", "float8_e4m3fn", rows_per_chunk=7)
    return HiddenCache([bf16, str(folder / "fp8.safetensors")])


def planned_batches(cache: HiddenCache) -> list[list]:
    """Batches of two samples: bf16 only, fp8 only, and one over both shards."""
    samples, _, _ = cache.samples(64)
    bf16, fp8 = [s for s in samples if s[0] == 0], [s for s in samples if s[0] == 1]
    return [bf16[:2], fp8[:2], bf16[2:4], [bf16[4], fp8[2]], fp8[3:5], [fp8[0], bf16[5], bf16[1]]]


def assert_same_batch(got: dict, expected: dict, where) -> None:
    assert set(got) == set(expected), where
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert got[key].device == value.device and got[key].dtype == value.dtype, (where, key)
            assert torch.equal(got[key], value), (where, key)
        else:
            assert got[key] == value, (where, key)


def ahead_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("eyrie-ahead") and t.is_alive()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ahead", [True, False])
def test_the_batches_are_those_of_load_then_to_device_in_order(cache, dtype, ahead):
    plans = planned_batches(cache)
    taken = list(batches_on_device(cache.load, lambda rows: cache.to_device(rows, "cpu", dtype), plans, "cpu", ahead=ahead))
    assert len(taken) == len(plans)
    assert {loaded.aux.dtype for loaded, _ in taken} == {torch.bfloat16, torch.float8_e4m3fn, torch.float32}  # float32: both shards
    for k, (refs, (loaded, batch)) in enumerate(zip(plans, taken)):
        assert loaded.ids.shape == (len(refs), max(n for _, _, n in refs))
        assert_same_batch(batch, cache.to_device(cache.load(refs), "cpu", dtype), (k, refs))
        assert batch["aux"].dtype == dtype and "loss_mask_host" in batch and "lengths_host" in batch


def test_ahead_moves_in_the_background_thread_and_otherwise_in_the_callers():
    def moved_by(ahead: bool) -> set[int]:
        threads = set()

        def to_device(x):
            threads.add(threading.get_ident())
            return {"x": torch.tensor([x])}

        assert [int(batch["x"]) for _, batch in batches_on_device(lambda k: k, to_device, range(4), "cpu", ahead=ahead)] == [0, 1, 2, 3]
        return threads

    assert threading.get_ident() not in moved_by(True)
    assert moved_by(False) == {threading.get_ident()}


def test_only_sources_that_just_copy_move_ahead():
    # The online source runs the target in to_device: that stays in the training thread, on its stream.
    assert HiddenCache.moves_ahead and not OnlineStates.moves_ahead
    assert not pins_memory("cpu")


@pytest.mark.parametrize("ahead", [True, False])
@pytest.mark.parametrize("failing", ["load", "to_device"])
def test_an_error_reaches_the_caller_at_its_item(ahead, failing):
    def load(k):
        if failing == "load" and k == 3:
            raise ValueError("shard 2 is corrupt")
        return k

    def to_device(k):
        if failing == "to_device" and k == 3:
            raise ValueError("shard 2 is corrupt")
        return {"x": torch.full((2,), k)}

    got = []
    with pytest.raises(ValueError, match="shard 2 is corrupt"):
        for k, batch in batches_on_device(load, to_device, range(6), "cpu", ahead=ahead):
            got.append((k, batch["x"].tolist()))
    assert got == [(0, [0, 0]), (1, [1, 1]), (2, [2, 2])]
    assert not ahead_threads()


@pytest.mark.parametrize("ahead", [True, False])
def test_closing_early_joins_the_background_thread(ahead):
    unblock, loaded = threading.Event(), []

    def load(k):
        loaded.append(k)
        if k == 1:
            unblock.wait(timeout=10)
        return k

    batches = batches_on_device(load, lambda k: {"x": torch.tensor([k])}, range(10), "cpu", ahead=ahead)
    assert int(next(batches)[1]["x"]) == 0
    assert ahead_threads()
    threading.Timer(0.2, unblock.set).start()
    batches.close()  # returns once item 1 is loaded (and moved)
    assert loaded == [0, 1]
    assert not ahead_threads()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_the_batches_equal_synchronous_copies_while_the_stream_is_busy(cache, dtype):
    device = torch.device("cuda", torch.cuda.current_device())
    plans = planned_batches(cache) * 3
    busy = torch.randn(4096, 4096, device=device)
    taken = 0
    batches = batches_on_device(lambda refs: cache.load(refs, pin=True), lambda rows: cache.to_device(rows, device, dtype), plans, device)
    for refs in plans:
        for _ in range(8):  # the main stream stays busy while the next batch is copied and taken
            busy = busy @ busy
            busy = busy / busy.norm()
        loaded, batch = next(batches)
        assert all(t.is_pinned() for t in (loaded.ids, loaded.mask, loaded.lengths, loaded.aux, loaded.final))
        assert batch["loss_mask_host"].is_pinned() and batch["lengths_host"].is_pinned()
        batch["aux"].add_(1)  # on the main stream, after the copy: the noise writes aux this way
        expected = cache.to_device(cache.load(refs), device, dtype)
        expected["aux"].add_(1)
        assert_same_batch(batch, expected, refs)
        assert batch["aux"].is_cuda and batch["input_ids"].is_cuda and not batch["loss_mask_host"].is_cuda
        taken += 1
    assert taken == len(plans)
    with pytest.raises(StopIteration):
        next(batches)
    assert not ahead_threads()
    torch.cuda.synchronize(device)
