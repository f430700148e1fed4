"""Training keeps some held-out samples' prompts and walked first replies for the benchmark to serve (eyrie.training.parity_samples)."""

from __future__ import annotations

import json

import pytest
import torch
from factories import tiny_setup, train_tiny

from eyrie.drafter.checkpoint import CheckpointError, read_parity_samples


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_torch_thread):
    """Tiny models: one thread is fastest."""


def two_turn_samples(n: int, V: int = 120, seed: int = 3) -> list[tuple[list[int], list[int]]]:
    """Samples of a 2-token prompt, a 5-token first reply, a 3-token user turn and a second reply of 10 to 19 tokens."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        length = 20 + i % 10
        samples.append((torch.randint(0, V, (length,), generator=g).tolist(), [0] * 2 + [1] * 5 + [0] * 3 + [1] * (length - 10)))
    return samples


def test_the_parity_samples_are_held_out_prompts_whose_walks_add_up_to_the_first_turn_prediction(tmp_path):
    """Each kept sample is a held-out one: its prompt is the tokens before its first reply, its walks per k are the terms
    of the simulation's walked_first_turn_length (all held-out samples kept here: their sums are that record's)."""
    samples = two_turn_samples(24)
    inputs = tiny_setup(tmp_path, samples=samples, V=120)
    train_tiny(tmp_path, inputs, train={"batch_tokens": 200, "eval_fraction": 0.5, "learning_rate": 3e-3})
    record = read_parity_samples(tmp_path / "drafter")
    summary = json.loads((tmp_path / "drafter" / "config.json").read_text())["eyrie"]["simulated_acceptance"]
    assert record["k"] == [1, 2, 3] and record["source"] == "held-out cache samples"
    assert 8 <= len(record["samples"]) == summary["eval_samples"] <= 16
    prompts = {tuple(tokens[:2]) for tokens, _ in samples}
    for sample in record["samples"]:
        assert tuple(sample["prompt_ids"]) in prompts and sample["reply_tokens"] == 5
    for k in range(3):
        rounds = sum(s["rounds"][k] for s in record["samples"])
        emitted = sum(s["emitted"][k] for s in record["samples"])
        assert rounds == summary["walked_first_turn_rounds"][k] > 0
        assert emitted / rounds == pytest.approx(summary["walked_first_turn_length"][k])


def test_a_changed_parity_file_is_refused_by_name(tmp_path):
    inputs = tiny_setup(tmp_path, samples=two_turn_samples(24), V=120)
    train_tiny(tmp_path, inputs, train={"batch_tokens": 200, "eval_fraction": 0.5})
    path = tmp_path / "drafter" / "parity_samples.json"
    data = json.loads(path.read_text())
    data["samples"][0]["emitted"][0] += 1
    path.chmod(0o644)
    path.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="parity_samples.json"):
        read_parity_samples(tmp_path / "drafter")


def test_a_cache_too_small_to_hold_samples_out_keeps_none(tmp_path):
    inputs = tiny_setup(tmp_path, samples=two_turn_samples(6), V=120)
    train_tiny(tmp_path, inputs, train={"batch_tokens": 200})
    assert read_parity_samples(tmp_path / "drafter") is None
    assert not (tmp_path / "drafter" / "parity_samples.json").exists()
