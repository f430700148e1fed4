"""benchmarks/copy_probe.py's round walk: what the vocab mode's figures rest on."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "copy_probe.py"


def _probe():
    spec = importlib.util.spec_from_file_location("copy_probe", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_round_accepts_the_drafts_up_to_the_first_miss_and_the_next_round_starts_after_the_bonus():
    walk = _probe()._walk
    steps, length = 3, 12
    hit = torch.zeros(steps, length, dtype=torch.bool)
    # Known tokens up to 4 (the first reply token): the round's drafts sit at t = 3. Two right, then a miss.
    hit[0, 3] = hit[1, 3] = True
    # That round emits 3 (two drafts and the bonus): the next knows up to 7, drafts at t = 6, all three right.
    hit[:, 6] = True
    # Then 4 emitted: the next knows up to 11 = length - 1, and the walk stops there.
    assert walk(hit, 4, length) == [3, 4]
    assert walk(torch.zeros(steps, length, dtype=torch.bool), 4, 8) == [1, 1, 1]  # no draft right: one token a round
    # Flipping misses to hits (the vocab mode's "drafted right") only lengthens rounds.
    assert walk(torch.ones(steps, length, dtype=torch.bool), 4, length) == [4, 4]
