"""The drafter directory serves SGLang and vLLM alike: config.json's fields for both, and every file readable by others."""

from __future__ import annotations

import json
import os
import stat
import warnings

import pytest
import torch

from eyrie.core.atomic import write_json_atomically
from eyrie.drafter.checkpoint import CheckpointError, check_checkpoint, checkpoint_tensors, load_drafter, serving_config, write_checkpoint
from eyrie.drafter.model import DrafterShape, Eagle3Drafter


def shape(aux_layer_ids=(1, 14, 26), **extra) -> DrafterShape:
    return DrafterShape(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
                        vocab_size=50, draft_vocab_size=10, target_hidden_size=32, max_position_embeddings=128,
                        aux_layer_ids=list(aux_layer_ids), **extra)


def drafter(s: DrafterShape) -> Eagle3Drafter:
    torch.manual_seed(0)
    t2d = torch.zeros(s.vocab_size, dtype=torch.bool)
    t2d[: s.draft_vocab_size] = True
    return Eagle3Drafter(s, torch.randn(s.vocab_size, s.hidden_size), torch.zeros(s.draft_vocab_size, dtype=torch.int64), t2d)


def test_config_json_has_each_engines_fields():
    config = serving_config(shape(hidden_act="gelu").sglang_config())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]  # SGLang's ids, as always
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]  # vLLM's: output_hidden_states[L]
    assert config["norm_before_residual"] is False
    assert (config["norm_before_fc"], config["fc_norm"], config["norm_output"]) == (False, False, False)
    assert config["hidden_act"] == "silu"  # the drafter's MLP, whatever the target's activation
    trained = serving_config(shape(norm_before_fc=True, norm_output=True).sglang_config())
    assert (trained["norm_before_fc"], trained["eagle_config"]["norm_before_fc"], trained["norm_output"]) == (True, True, True)
    assert serving_config(config) == config  # completing twice changes nothing


def test_unsorted_or_disagreeing_ids_are_refused():
    with pytest.raises(CheckpointError, match="strictly ascending"):
        serving_config(shape((14, 1, 26)).sglang_config())
    config = serving_config(shape().sglang_config())
    with pytest.raises(CheckpointError, match="disagree"):
        serving_config({**config, "eagle_aux_hidden_state_layer_ids": [1, 14, 26]})  # SGLang's ids written as vLLM's: one layer early
    with pytest.raises(CheckpointError, match="norm_before_residual"):
        serving_config({**config, "norm_before_residual": True})


def test_written_directory_is_complete_and_readable_by_others(tmp_path):
    model = drafter(shape())
    previous = os.umask(0o077)  # a restrictive umask must not leave a file a server under another account cannot read
    try:
        write_checkpoint(tmp_path / "drafter", model.shape.sglang_config(), checkpoint_tensors(model), [{"step": 1}])
    finally:
        os.umask(previous)
    directory = tmp_path / "drafter"
    assert stat.S_IMODE(directory.stat().st_mode) == 0o755
    assert sorted(p.name for p in directory.iterdir()) == ["config.json", "model.safetensors", "training_log.json"]
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o644 for p in directory.iterdir())
    config = json.loads((directory / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27] and config["norm_before_residual"] is False
    load_drafter(directory, torch.randn(50, 32))
    config["eagle_aux_hidden_state_layer_ids"] = [1, 14, 26]
    (directory / "config.json").write_text(json.dumps(config))  # edited by hand: its recorded digest no longer holds
    with pytest.raises(CheckpointError, match=r"config\.json: its content does not match the digest .* --force .*drafter"):
        load_drafter(directory, torch.randn(50, 32))
    write_json_atomically(directory / "config.json", config)  # written with a fresh digest: the ids themselves are refused
    with pytest.raises(CheckpointError, match="disagree"):
        load_drafter(directory, torch.randn(50, 32))


def test_ids_not_starting_at_1_warn_when_written(tmp_path):
    model = drafter(shape((0, 14, 26)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        write_checkpoint(tmp_path / "drafter", model.shape.sglang_config(), checkpoint_tensors(model), [])
    assert any("SGLang versions disagree" in str(w.message) for w in caught)


def test_non_finite_weights_are_refused_naming_the_tensor_and_the_file(tmp_path):
    model = drafter(shape())
    tensors = checkpoint_tensors(model)
    tensors["fc.weight"][0, :3] = float("nan")
    tensors["lm_head.weight"][1, 0] = float("inf")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: .*fc\.weight holds 3 non-finite values.*lm_head\.weight holds 1 non-finite"):
        write_checkpoint(tmp_path / "drafter", model.shape.sglang_config(), tensors, [])
    assert not (tmp_path / "drafter").exists()  # nothing written
    with pytest.raises(CheckpointError, match=r"here\.safetensors: .*fc\.weight holds 3 non-finite"):
        check_checkpoint(tensors, model.shape, "here.safetensors")


def test_training_log_digest_lives_in_config_json_and_is_checked(tmp_path):
    model = drafter(shape())
    directory = tmp_path / "drafter"
    write_checkpoint(directory, model.shape.sglang_config(), checkpoint_tensors(model), [{"step": 1, "loss": 2.0}])
    config = json.loads((directory / "config.json").read_text())
    assert config["eyrie"]["files"]["training_log.json"].startswith("sha256:") and config["eyrie_digest"].startswith("sha256:")
    (directory / "training_log.json").write_text(json.dumps([{"step": 1, "loss": 0.5}]))
    with pytest.raises(CheckpointError, match=r"training_log\.json: its content does not match the digest .*config\.json recorded"):
        load_drafter(directory, torch.randn(50, 32))
