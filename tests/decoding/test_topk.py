"""The top-K the tree rounds take over the draft vocabulary (ranked on CUDA, two stages elsewhere): torch.topk's values
and indices."""

from __future__ import annotations

import pytest
import torch

from eyrie.decoding.topk import chunk_size_for_ranking, chunks_for, ranked_top_k, top_k, two_stage_top_k


@pytest.mark.parametrize("way", [top_k, two_stage_top_k, ranked_top_k])
@pytest.mark.parametrize("width", [32000, 16000, 8192, 4096, 32003])
@pytest.mark.parametrize("rows, k", [(1, 10), (10, 10), (8, 1), (6, 16)])
def test_top_k_is_torch_topk(rows, k, width, way):
    values = torch.randn(rows, width, generator=torch.Generator().manual_seed(width + k))  # distinct values
    expected = values.topk(k, dim=-1)
    got = way(values, k)
    assert torch.equal(got[0], expected.values) and torch.equal(got[1], expected.indices)


def test_long_rows_are_cut_into_single_block_chunks_and_short_or_prime_ones_are_not():
    assert chunks_for(32000, 10) == 16 and 32000 // 16 <= 2048
    assert chunks_for(16000, 10) == 8
    assert chunks_for(4096, 10) == 1  # already one single-block call
    assert chunks_for(32003, 10) == 1  # prime: no equal chunks, one call


def test_ties_give_torch_topks_values_and_indices_that_hold_them():
    values = torch.zeros(3, 32000)
    values[:, 5], values[:, 31999], values[1, 7] = 2.0, 1.0, 1.0  # a tie for second place in row 1
    got_values, got_ids = two_stage_top_k(values, 4)
    assert torch.equal(got_values, values.topk(4, dim=-1).values)
    assert torch.equal(values.gather(1, got_ids), got_values)
    assert got_ids[:, 0].tolist() == [5, 5, 5] and set(got_ids[1, 1:3].tolist()) == {7, 31999}


def test_ranked_top_k_breaks_ties_by_index_and_compiles_to_the_same_result():
    values = torch.zeros(3, 32000)
    values[:, 31000], values[:, 7], values[:, 20000] = 1.0, 2.0, 2.0  # a tie for first, across two chunks
    got_values, got_ids = ranked_top_k(values, 4)
    assert got_values[:, :3].tolist() == [[2.0, 2.0, 1.0]] * 3
    assert got_ids[:, :3].tolist() == [[7, 20000, 31000]] * 3
    assert got_ids[:, 3].tolist() == [0, 0, 0]  # then zeros, the smallest index first
    assert chunk_size_for_ranking(32000, 10) == 50 and chunk_size_for_ranking(32003, 10) is None
    masked = torch.full((1, 32000), float("-inf"))
    masked[0, 900] = 0.5  # -inf (a masked logit) ranks after every finite value and is selected as itself
    got_values, got_ids = ranked_top_k(masked, 3)
    assert got_values.tolist() == [[0.5, float("-inf"), float("-inf")]] and got_ids.tolist() == [[900, 0, 1]]
    default = ranked_top_k(values, 4)
    for chunk in (32, 100, 160):  # any divisor of the width gives the same result
        assert all(torch.equal(a, b) for a, b in zip(ranked_top_k(values, 4, chunk), default))
    rows = torch.log_softmax(torch.randn(10, 8192, generator=torch.Generator().manual_seed(0)), dim=-1)
    compiled = torch.compile(ranked_top_k, dynamic=False)(rows, 10)
    expected = rows.topk(10, dim=-1)
    assert torch.equal(compiled[0], expected.values) and torch.equal(compiled[1], expected.indices)


@pytest.mark.parametrize("rows, on_cuda, way", [(10, True, "ranked"), (32, True, "ranked"), (640, True, "two stages"), (10, False, "two stages")])
def test_the_quadratic_ranking_serves_only_a_few_rows_on_cuda(monkeypatch, rows, on_cuda, way):
    """A batch of trees has K rows per request: beyond a few, the rankings' pairwise comparisons outgrow torch.topk."""
    from types import SimpleNamespace

    import eyrie.decoding.topk as topk

    taken = []
    monkeypatch.setattr(topk, "ranked_top_k", lambda values, k: taken.append("ranked"))
    monkeypatch.setattr(topk, "two_stage_top_k", lambda values, k: taken.append("two stages"))
    topk.top_k(SimpleNamespace(is_cuda=on_cuda, shape=(rows, 32000)), 10)
    assert taken == [way]
