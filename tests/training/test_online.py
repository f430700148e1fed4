"""hidden.mode online: the training job runs the target itself and trains exactly as on the cache.

A tiny random Llama target, two token shards; offline extracts them (eyrie.hidden.extract) and trains on the
cache, online trains on the shards. Same batches, same loss at step 0, same weights after a few steps, same
held-out simulation; the resume identity names the token shards; the DAG has no extract_hidden job.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
import torch
import yaml
from conftest import TINY_CONFIG, snakemake
from factories import tiny_llama
from safetensors.torch import load_file

from eyrie import config as cfg
from eyrie.core.atomic import write_parquet_atomically
from eyrie.core.errors import ConfigError
from eyrie.hidden.extract import extract_shard
from eyrie.plan import planned_outputs
from eyrie.target.aux_layers import default_aux_layer_ids
from eyrie.target.head import target_text_config
from eyrie.target.model import load_model
from eyrie.tokens.shards import TOKENS_SCHEMA
from eyrie.training.errors import TrainingInputError
from eyrie.training.inputs import HiddenCache, read_inputs
from eyrie.training.online import OnlineStates
from eyrie.training.train import train_drafter

TEMPLATE = "a" * 64
FINGERPRINT = "f" * 64
V, H, LAYERS = 96, 32, 8
# Every sample trains and none is cut: the cache's batches (hidden.batch_tokens) are training's batches (train.batch_tokens).
TRAIN = {"epochs": 2, "batch_tokens": 96, "learning_rate": 3e-3, "dtype": "float32", "device": "cpu", "log_every": 1, "attention": "eager"}


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_torch_thread):
    """These models are tiny: one thread is fastest, and immune to a busy machine's oversubscription."""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A full random Llama target, two token shards of 12 samples each, the draft vocabulary, and the bf16 cache of the shards."""
    root = tmp_path_factory.mktemp("online")
    tiny_llama(root / "target", hidden=H, layers=LAYERS, vocab=V, intermediate=64, positions=256, head_dim=H // 4, tie_word_embeddings=False)
    g = torch.Generator().manual_seed(1)
    token_paths = []
    for shard in range(2):
        rows = []
        for k in range(12):
            n = 8 + (7 * k + 3 * shard) % 23
            ids = torch.randint(0, V, (n,), generator=g).tolist()
            mask = [0] * 3 + [1] * (n - 3)
            rows.append({"id": f"s{shard}-{k}", "dataset": "t", "input_ids": ids, "loss_mask": mask, "n_tokens": n,
                         "n_assistant_tokens": n - 3, "truncated": False})
        meta = {"template_sha256": TEMPLATE, "max_seq_len": 256, "stats": {}}
        table = pa.Table.from_pylist(rows, schema=TOKENS_SCHEMA).replace_schema_metadata({b"eyrie": json.dumps(meta).encode()})
        path = root / f"tokens-{shard}.parquet"
        write_parquet_atomically(table, path)
        token_paths.append(str(path))
    model = load_model(root / "target", dtype="float32", device="cpu")
    hidden_paths = []
    for k, tokens in enumerate(token_paths):
        out = root / f"hidden-{k}.safetensors"
        extract_shard(tokens_path=tokens, out_path=str(out), model=model, model_fingerprint=FINGERPRINT, template_sha256=TEMPLATE,
                      aux_layer_ids=default_aux_layer_ids(LAYERS), batch_tokens=TRAIN["batch_tokens"], progress=False)
        hidden_paths.append(str(out))
    return {"root": root, "target_dir": str(root / "target"), "tokens": token_paths, "hidden": hidden_paths,
            "vocab": write_vocab(root / "vocab.safetensors", range(0, V, 2), V, TEMPLATE)}


def write_vocab(path, draft_ids, V, template):
    from safetensors.torch import save_file

    draft_ids = torch.as_tensor(list(draft_ids), dtype=torch.int64)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[draft_ids] = True
    tensors = {"d2t": draft_ids - torch.arange(draft_ids.numel()), "t2d": t2d, "counts": torch.ones(V, dtype=torch.int64), "draft_ids": draft_ids}
    save_file(tensors, str(path), metadata={"manifest": json.dumps({"draft_vocab_size": draft_ids.numel(), "target_vocab_size": V, "template_sha256": template})})
    return str(path)


def online(setup, **kw) -> OnlineStates:
    return OnlineStates(setup["tokens"], target_dir=setup["target_dir"], model_dtype="float32", **kw)


def read(setup, eval_fraction=0.05, **source):
    return read_inputs(vocab_path=setup["vocab"], target_dir=setup["target_dir"], drafter_cfg={"ttt_steps": 3}, batch_tokens=TRAIN["batch_tokens"],
                       template_sha256=TEMPLATE, target_fingerprint=FINGERPRINT, eval_fraction=eval_fraction, **source)


def train(setup, tmp_path, name, mode, train=None, **kw):
    states = (
        {"token_paths": setup["tokens"], "hidden_cfg": {"mode": "online"}, "model_cfg": {"dtype": "float32"}}
        if mode == "online"
        else {"hidden_paths": setup["hidden"]}
    )
    return train_drafter(**states, vocab_path=setup["vocab"], target_dir=setup["target_dir"], out_dir=str(tmp_path / name),
                         state_dir=str(tmp_path / f"{name}.state"), drafter_cfg={"ttt_steps": 3}, train_cfg={**TRAIN, **(train or {})},
                         template_sha256=TEMPLATE, target_fingerprint=FINGERPRINT, progress=False, **kw)


# --------------------------------------------------------------------------- the same inputs


def test_online_holds_the_cache_samples_and_returns_its_batches(setup):
    cached, computed = read(setup, hidden_paths=setup["hidden"]), read(setup, states=online(setup))
    assert isinstance(cached.states, HiddenCache) and isinstance(computed.states, OnlineStates)
    assert computed.samples == cached.samples and computed.batches == cached.batches
    assert computed.held_out == cached.held_out and computed.held_out  # 24 samples: some held out, by the same ids
    assert computed.shape == cached.shape
    for refs in cached.batches + cached.eval_batches:
        a, b = cached.states.batch(refs, "cpu"), computed.states.batch(refs, "cpu")
        assert a.keys() == b.keys() and a["tokens"] == b["tokens"]
        for key in ("input_ids", "loss_mask", "lengths"):
            assert torch.equal(a[key], b[key]), key
        # Training pads other samples together than extraction did (held-out ones are gone): float noise of the
        # forward may move a value across a bf16 rounding boundary, one bf16 step; nearly every value is equal.
        for key in ("aux", "final"):
            assert a[key].dtype == b[key].dtype == torch.float32
            torch.testing.assert_close(b[key], a[key], rtol=2**-7, atol=1e-4)
            assert (a[key] == b[key]).float().mean() > 0.99


def test_the_same_padded_batches_give_the_cache_bits(setup):
    """One shard, nothing held out: training's batches are extraction's, so the shared forward and the cache's own
    encoder give exactly the cache's values."""
    cached = read(setup, hidden_paths=setup["hidden"][:1], eval_fraction=0)
    computed = read(setup, states=OnlineStates(setup["tokens"][:1], target_dir=setup["target_dir"], model_dtype="float32"), eval_fraction=0)
    assert computed.batches == cached.batches
    for refs in cached.batches:
        a, b = cached.states.batch(refs, "cpu", dtype=torch.bfloat16), computed.states.batch(refs, "cpu", dtype=torch.bfloat16)
        for key in ("aux", "final"):
            assert b[key].dtype == torch.bfloat16 and torch.equal(a[key], b[key]), key


def test_online_and_offline_training_give_the_same_loss_and_weights(setup, tmp_path):
    offline = train(setup, tmp_path, "offline", "offline")
    computed = train(setup, tmp_path, "online", "online")
    assert offline["steps"] == computed["steps"] > 2
    log_a = json.loads((tmp_path / "offline" / "training_log.json").read_text())
    log_b = json.loads((tmp_path / "online" / "training_log.json").read_text())
    assert log_a[0]["step"] == log_b[0]["step"] == 1
    assert log_b[0]["loss"] == pytest.approx(log_a[0]["loss"], rel=1e-6)  # step 0's loss
    assert [e["loss"] for e in log_b] == pytest.approx([e["loss"] for e in log_a], rel=1e-4)
    a, b = load_file(str(tmp_path / "offline" / "model.safetensors")), load_file(str(tmp_path / "online" / "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key].float(), a[key].float(), rtol=1e-3, atol=1e-4, msg=key)
    sim_a, sim_b = offline["simulated_acceptance"], computed["simulated_acceptance"]
    assert sim_b["source"] == sim_a["source"] == "held-out cache samples"
    assert sim_b["length"] == pytest.approx(sim_a["length"], abs=1e-6)


def test_online_resumes_its_own_state_and_not_the_cache_runs(setup, tmp_path):
    class Crash(RuntimeError):
        pass

    def crash_at_3(step):
        if step == 3:
            raise Crash

    with pytest.raises(Crash):
        train(setup, tmp_path, "online", "online", save_every_steps=2, on_step=crash_at_3)
    resumed = train(setup, tmp_path, "online", "online")
    assert resumed["resumed_from_step"] == 2
    train(setup, tmp_path, "full", "online")  # the same run, uninterrupted
    a, b = load_file(str(tmp_path / "full" / "model.safetensors")), load_file(str(tmp_path / "online" / "model.safetensors"))
    assert all(torch.equal(a[key], b[key]) for key in a)
    # The identity names the data: an offline run over the cache of the same shards starts over in that state directory.
    (tmp_path / "online").rename(tmp_path / "online-done")
    assert train(setup, tmp_path, "online", "offline")["resumed_from_step"] == 0


def test_online_identity_is_the_token_shards_digests_and_settings(setup):
    states = online(setup)
    assert states.digests == [d for d in states.digests if d.startswith("sha256:")] and len(states.digests) == 2
    assert states.manifests[0]["dtype"] == "bfloat16" and states.manifests[0]["model_dtype"] == "float32"
    assert online(setup, dtype="float32").manifests != states.manifests


# --------------------------------------------------------------------------- refusals


def test_online_refuses_float8_and_another_template(setup):
    with pytest.raises(TrainingInputError, match="float8.*online nothing is"):
        online(setup, dtype="float8_e4m3fn")
    with pytest.raises(TrainingInputError, match=r"tokens-0.parquet: tokenized with chat template 'a+', but the target's template is 'b+'"):
        online(setup).check(target_config=target_text_config(setup["target_dir"]), aux_layer_ids=default_aux_layer_ids(LAYERS),
                            template_sha256="b" * 64, target_fingerprint=FINGERPRINT)


def tiny_config(**hidden) -> dict:
    raw = yaml.safe_load(TINY_CONFIG.read_text())
    raw["hidden"] = {**raw.get("hidden", {}), **hidden}
    return raw


def test_the_schema_knows_hidden_mode():
    assert cfg.validate(tiny_config())["hidden"]["mode"] == "offline"
    assert cfg.validate(tiny_config(mode="online"))["hidden"]["mode"] == "online"
    with pytest.raises(ConfigError, match=r"hidden\.mode: expected one of \['offline', 'online'\]"):
        cfg.validate(tiny_config(mode="sometimes"))
    with pytest.raises(ConfigError, match="hidden.dtype: float8_e4m3fn .* online"):
        cfg.validate(tiny_config(mode="online", dtype="float8_e4m3fn"))
    assert cfg.validate(tiny_config(dtype="float8_e4m3fn"))["hidden"]["dtype"] == "float8_e4m3fn"  # offline it is a storage format


# --------------------------------------------------------------------------- the DAG


def test_online_plans_no_cache_and_trains_from_the_token_shards():
    config = cfg.validate(tiny_config(mode="online"))
    planned = planned_outputs(config)
    assert not [p for p in planned if p.rule == "extract_hidden" or p.path.startswith("results/hidden/")]
    drafter = next(p for p in planned if p.rule == "train_drafter")
    tokens = tuple(p.path for p in planned if p.rule == "tokenize_shard")  # online: a tokenize job of its own per shard
    assert len(tokens) == sum(1 for p in planned if p.path.startswith("results/tokens/"))
    assert drafter.inputs == tokens + ("results/vocab/draft_vocab.safetensors",)


def test_the_online_dag_has_no_extract_hidden_job(tmp_path):
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(tiny_config(mode="online")))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "local.jsonl").write_text('{"id": "x", "messages": [{"role": "user", "content": "hi"}]}\n')
    done = snakemake(tmp_path, "-n", "--quiet", "rules")
    jobs = {line.split()[0] for line in done.stdout.splitlines() if line.strip() and line.split()[-1].isdigit()}
    assert "train_drafter" in jobs and "tokenize_shard" in jobs
    assert "extract_hidden" not in jobs


def test_the_report_says_the_states_were_computed_online(tmp_path):
    from eyrie.report.build import write_report
    from eyrie.report.header import stages_header

    out = tmp_path / "report.html"
    write_report(cfg.validate(tiny_config(mode="online")), [], [], [], str(out))
    assert "<p>hidden.mode online: no cache was written; the training job ran the target" in out.read_text()
    write_report(cfg.validate(tiny_config()), [], [], [], str(out))
    assert "hidden.mode online" not in out.read_text()
    # Once the drafter is built, the header's hidden-states stage is built too, with the mode.
    hidden = {"shards": [], "expected": 0, "mode": "online"}
    stages = stages_header({}, {}, [], [], None, hidden, {"metrics": {}}, {"rows": []})
    assert {"name": "hidden states", "built": True, "detail": "computed in the training job (hidden.mode online), no cache"} in stages
