"""Draft vocabulary: counts from assistant tokens only, d2t as offsets, t2d agreeing with d2t."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors import safe_open

from eyrie.core.errors import ContractError
from eyrie.tokens.build_vocab import VocabClippedWarning, build_draft_vocab, resize_draft_vocab
from eyrie.tokens.shards import TOKENS_SCHEMA
from eyrie.tokens.vocab import VocabError, VocabSizeError, check_vocab, load_draft_vocab

V = 20
TEMPLATE = "t" * 64


def write_shard(path, samples, template=TEMPLATE):
    rows = [
        {
            "id": f"s{k}",
            "dataset": "d",
            "input_ids": ids,
            "loss_mask": mask,
            "n_tokens": len(ids),
            "n_assistant_tokens": sum(mask),
            "truncated": False,
        }
        for k, (ids, mask) in enumerate(samples)
    ]
    meta = {"template_sha256": template, "max_seq_len": 64, "stats": {}}
    table = pa.Table.from_pylist(rows, schema=TOKENS_SCHEMA).replace_schema_metadata({b"eyrie": json.dumps(meta).encode()})
    pq.write_table(table, path)
    return str(path)


@pytest.fixture
def shards(tmp_path):
    # Assistant-token counts: 7 -> 4, 3 -> 3, 12 -> 3, 5 -> 2, 2 -> 1, 9 -> 1 (total 14).
    # Id 1 appears 10 times but only under loss_mask 0 (prompt tokens), so it must not count.
    a = write_shard(
        tmp_path / "a.parquet",
        [
            ([1, 1, 1, 1, 1, 7, 7, 3, 12], [0, 0, 0, 0, 0, 1, 1, 1, 1]),
            ([1, 1, 5, 9, 7], [0, 0, 1, 1, 1]),
        ],
    )
    b = write_shard(
        tmp_path / "b.parquet",
        [
            ([1, 1, 1, 3, 3, 12, 12, 5, 2, 7], [0, 0, 0, 1, 1, 1, 1, 1, 1, 1]),
        ],
    )
    return [a, b]


def test_exact_vocab_from_known_counts(shards, tmp_path):
    out = tmp_path / "vocab" / "draft.safetensors"
    manifest = build_draft_vocab(shards, target_vocab_size=V, draft_vocab_size=4, out_path=str(out))
    # Top 4 by count: 7 (4), then 3 and 12 (3 each), then 5 (2); ascending: [3, 5, 7, 12].
    d2t, t2d, loaded = load_draft_vocab(out)
    assert loaded == manifest
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and t2d.shape == (V,)
    assert d2t.tolist() == [3 - 0, 5 - 1, 7 - 2, 12 - 3]  # offsets, not the ids
    assert (torch.arange(4) + d2t).tolist() == [3, 5, 7, 12]
    assert t2d.nonzero().flatten().tolist() == [3, 5, 7, 12]
    with safe_open(str(out), framework="pt") as f:
        counts = f.get_tensor("counts")
        draft_ids = f.get_tensor("draft_ids")
    expected_counts = np.zeros(V, dtype=np.int64)
    for token, n in {7: 4, 3: 3, 12: 3, 5: 2, 2: 1, 9: 1}.items():
        expected_counts[token] = n
    assert counts.tolist() == expected_counts.tolist()
    assert draft_ids.tolist() == [3, 5, 7, 12]
    assert manifest["draft_vocab_size"] == 4 and manifest["requested_draft_vocab_size"] == 4
    assert manifest["target_vocab_size"] == V
    assert manifest["assistant_tokens"] == 14
    assert manifest["coverage"] == pytest.approx(12 / 14)
    assert manifest["template_sha256"] == TEMPLATE
    assert manifest["clipped"] is False
    assert not list(out.parent.glob(".*tmp"))


def test_ties_break_to_the_lower_id(shards, tmp_path):
    # 3 and 12 tie at 3 assistant tokens: with room for two ids, 7 and then 3 are kept.
    manifest = build_draft_vocab(shards, V, 2, str(tmp_path / "v.safetensors"))
    d2t, t2d, _ = load_draft_vocab(tmp_path / "v.safetensors")
    assert (torch.arange(2) + d2t).tolist() == [3, 7]
    assert manifest["coverage"] == pytest.approx(7 / 14)


def test_a_resized_vocab_is_the_one_built_at_that_size_from_the_same_shards(shards, tmp_path):
    """The recipe ablation compares draft vocabulary sizes on one run's cache: the smaller vocabulary comes from the
    built one's stored counts and must be what building at that size writes."""
    built = tmp_path / "built.safetensors"
    build_draft_vocab(shards, V, 6, str(built))
    for size in (4, 2):
        direct, resized = tmp_path / f"direct{size}.safetensors", tmp_path / f"resized{size}.safetensors"
        expected = build_draft_vocab(shards, V, size, str(direct))
        manifest = resize_draft_vocab(str(built), size, str(resized))
        assert manifest == {**expected, "resized_from": str(built)}
        assert all(torch.equal(a, b) for a, b in zip(load_draft_vocab(resized)[:2], load_draft_vocab(direct)[:2]))
    with pytest.raises(VocabSizeError, match="exceeds the target vocabulary"):
        resize_draft_vocab(str(built), V + 1, str(tmp_path / "big.safetensors"))


def test_clipped_when_fewer_tokens_were_seen_and_padded_to_a_multiple_of_8(shards, tmp_path):
    """Every seen id is kept, and the lowest never-seen ids pad the head's rows to a multiple of 8 (GPU products)."""
    with pytest.warns(VocabClippedWarning, match="only 6 distinct.*padded with 2 never-seen ids to 8, a multiple of 8"):
        manifest = build_draft_vocab(shards, V, 10, str(tmp_path / "v.safetensors"))
    assert manifest["clipped"] is True and manifest["unseen_padding"] == 2
    assert manifest["draft_vocab_size"] == 8 and manifest["requested_draft_vocab_size"] == 10
    assert manifest["coverage"] == 1.0
    d2t, t2d, _ = load_draft_vocab(tmp_path / "v.safetensors")
    assert (torch.arange(8) + d2t).tolist() == [0, 1, 2, 3, 5, 7, 9, 12]
    assert int(t2d.sum()) == 8


def test_padding_never_exceeds_the_requested_size(shards, tmp_path):
    with pytest.warns(VocabClippedWarning, match=r"only 6 distinct.*padded with 1 never-seen ids to 7 \(a multiple of 8 would exceed the limit\)"):
        manifest = build_draft_vocab(shards, V, 7, str(tmp_path / "v.safetensors"))
    assert manifest["draft_vocab_size"] == 7 and manifest["unseen_padding"] == 1


def test_from_prompts_keeps_the_ids_the_target_read_before_never_seen_ones(shards, tmp_path):
    """The target copies from its prompt tokens it never wrote in training: with from_prompts they come after every
    written id, the most read first, where never-seen ids would pad, and they count as seen when clipping."""
    extra = write_shard(tmp_path / "c.parquet", [([4, 4, 6, 6, 6, 7], [0, 0, 0, 0, 0, 1])])  # 6 read 3x, 4 read 2x
    written = [2, 3, 5, 7, 9, 12]
    with pytest.warns(VocabClippedWarning, match="padded with 1 never-seen ids"):
        plain = build_draft_vocab([*shards, extra], V, 7, str(tmp_path / "plain.safetensors"))
    assert (torch.arange(7) + load_draft_vocab(tmp_path / "plain.safetensors")[0]).tolist() == sorted([0, *written])
    assert plain["from_prompts"] is False and plain["prompt_only_ids"] == 0
    # Room for one read-only id: 1 (read 10 times) beats 6 (3) and 4 (2).
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        manifest = build_draft_vocab([*shards, extra], V, 7, str(tmp_path / "v.safetensors"), from_prompts=True)
    d2t, t2d, loaded = load_draft_vocab(tmp_path / "v.safetensors")
    assert (torch.arange(7) + d2t).tolist() == sorted([1, *written])
    assert manifest == loaded and manifest["from_prompts"] is True and manifest["prompt_only_ids"] == 1
    assert manifest["clipped"] is False and manifest["distinct_assistant_tokens"] == 6
    assert manifest["coverage"] == 1.0  # of assistant tokens, as before
    with safe_open(str(tmp_path / "v.safetensors"), framework="pt") as f:
        assert f.get_tensor("prompt_counts")[[1, 4, 6, 7]].tolist() == [10, 2, 3, 0]
    # Room for more than was seen anywhere: every read id is kept, then clipped to the 9 seen, padded to 16 at most.
    with pytest.warns(VocabClippedWarning, match=r"only 9 distinct tokens \(assistant or prompt\) were seen"):
        wide = build_draft_vocab([*shards, extra], V, 12, str(tmp_path / "w.safetensors"), from_prompts=True)
    ids = (torch.arange(wide["draft_vocab_size"]) + load_draft_vocab(tmp_path / "w.safetensors")[0]).tolist()
    assert {1, 4, 6, *written} <= set(ids) and wide["draft_vocab_size"] == 12 and wide["prompt_only_ids"] == 3
    # A smaller vocabulary chosen later from the stored counts ranks read-only ids the same way.
    resized = resize_draft_vocab(str(tmp_path / "w.safetensors"), 8, str(tmp_path / "r.safetensors"))
    assert (torch.arange(8) + load_draft_vocab(tmp_path / "r.safetensors")[0]).tolist() == sorted([1, 6, *written])
    assert resized["prompt_only_ids"] == 2


def test_no_warning_when_not_clipped(shards, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_draft_vocab(shards, V, 6, str(tmp_path / "v.safetensors"))


def test_draft_larger_than_target_refused(shards, tmp_path):
    with pytest.raises(VocabSizeError, match="exceeds the target vocabulary"):
        build_draft_vocab(shards, V, V + 1, str(tmp_path / "v.safetensors"))
    assert not (tmp_path / "v.safetensors").exists()


def test_templates_must_agree(shards, tmp_path):
    other = write_shard(tmp_path / "other.parquet", [([4, 4], [1, 1])], template="o" * 64)
    with pytest.raises(ContractError) as excinfo:
        build_draft_vocab([*shards, other], V, 3, str(tmp_path / "v.safetensors"))
    message = str(excinfo.value)
    assert "other.parquet" in message and "a.parquet" in message and "b.parquet" in message
    assert not (tmp_path / "v.safetensors").exists()


def test_ids_outside_the_target_vocab_refused(tmp_path):
    bad = write_shard(tmp_path / "bad.parquet", [([1, 25], [1, 1])])
    with pytest.raises(VocabError, match="outside the target vocabulary"):
        build_draft_vocab([bad], V, 2, str(tmp_path / "v.safetensors"))


def test_check_vocab_catches_index_instead_of_offset():
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[[3, 5, 7, 12]] = True
    check_vocab(torch.tensor([3, 4, 5, 9]), t2d)
    with pytest.raises(VocabError, match="offsets"):
        check_vocab(torch.tensor([3, 5, 7, 12]), t2d)  # the field bug: target ids stored as d2t
    with pytest.raises(VocabError):
        check_vocab(torch.tensor([3, 4, 5]), t2d)  # t2d marks one more id
    with pytest.raises(VocabError, match="int64"):
        check_vocab(torch.tensor([3, 4, 5, 9], dtype=torch.int32), t2d)


def test_real_token_shard(tokenizer, tmp_path):
    """A shard tokenized with the real template: assistant tokens only, counted in the real vocab size."""
    from eyrie.target.chat_template import tokenize_conversation
    from eyrie.target.model import template_fingerprint

    conversation = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi there, hi!"}]
    tokens = tokenize_conversation(tokenizer, conversation, 128)
    path = write_shard(tmp_path / "real.parquet", [(tokens.input_ids, tokens.loss_mask)], template_fingerprint(tokenizer))
    assistant = {t for t, m in zip(tokens.input_ids, tokens.loss_mask) if m}
    assert 0 < sum(tokens.loss_mask) < len(tokens.input_ids)
    manifest = build_draft_vocab([path], len(tokenizer), len(assistant) - 1, str(tmp_path / "v.safetensors"))
    d2t, t2d, _ = load_draft_vocab(tmp_path / "v.safetensors")
    assert t2d.shape == (len(tokenizer),)
    assert set(t2d.nonzero().flatten().tolist()) < assistant
    assert manifest["assistant_tokens"] == sum(tokens.loss_mask)
