"""What train.fused_loss, train.fused_norms and train.fused_pointwise share (eyrie.core.fused_pieces): auto fuses on CUDA only, and none is
part of the run identity, since each computes the same steps up to rounding."""

from __future__ import annotations

import pytest
import torch

from eyrie.drafter.rms_norm import fuses_norms
from eyrie.drafter.pointwise import fuses_pointwise
from eyrie.training.draft_loss import fuses_loss
from eyrie.training.state import run_identity

SETTLE = {"fused_loss": fuses_loss, "fused_norms": fuses_norms, "fused_pointwise": fuses_pointwise}


@pytest.mark.parametrize("key", sorted(SETTLE))
@pytest.mark.parametrize("setting, device, fused", [("auto", "cuda", True), ("auto", "cuda:1", True), ("auto", "cpu", False),
                                                     (True, "cpu", True), (False, "cuda", False)])
def test_auto_fuses_on_cuda_only(key, setting, device, fused):
    assert SETTLE[key](setting, device) is fused


@pytest.mark.parametrize("key, other", [("fused_loss", False), ("fused_norms", True), ("fused_pointwise", True)])
def test_a_run_resumes_across_the_setting(key, other):
    """No part of the run identity that a saved state must match."""

    def identity(train):
        return run_identity([{"ids": ["a"]}], torch.zeros(4, dtype=torch.int64), {}, train, "t" * 64, "f" * 64)

    assert identity({"epochs": 1, key: "auto"}) == identity({"epochs": 1, key: other}) == identity({"epochs": 1})
    assert identity({"epochs": 1, key: "auto"}) != identity({"epochs": 2, key: "auto"})
