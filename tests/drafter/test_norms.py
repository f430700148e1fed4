"""The EAGLE-3.1 norms (drafter.norm_before_fc, drafter.norm_output) as SGLang 0.5.23's LlamaForCausalLMEagle3 runs and loads them."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest
import torch
from factories import llama_config, tiny_drafter

from eyrie.drafter.checkpoint import check_checkpoint, checkpoint_tensors, load_drafter, write_checkpoint
from eyrie.drafter.model import DraftCache, DrafterShape, Eagle3Drafter

H, V, VD = 32, 120, 40


def drafter(seed=0, **norms) -> Eagle3Drafter:
    """Norm weights away from 1 (0.3 * noise), so that normalising twice or with the wrong weight shows."""
    config = llama_config(hidden=H, layers=8, vocab=V, intermediate=64, positions=512, head_dim=H // 4)
    return tiny_drafter(config, VD, seed=seed, norm_noise=0.3, **norms)


def rms_norm(x, weight, eps):
    """SGLang's RMSNorm.forward_native: float32 statistics, weight applied."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def test_off_by_default_the_drafter_and_its_config_are_as_before():
    model = drafter()
    config = model.shape.sglang_config()
    assert "norm_before_fc" not in config and "norm_output" not in config and "norm_before_fc" not in config["eagle_config"]
    assert "input_norm.weight" not in model.shape.expected_tensors() and model.input_norm is None
    assert not any(name.startswith("input_norm") for name, _ in model.named_parameters())
    aux = torch.randn(2, 5, 3 * H)
    assert torch.equal(model.project_aux(aux), model.fc(aux))
    out = torch.randn(2, 5, H)
    assert torch.equal(model.carried(out), out) and torch.equal(model.head(out), model.lm_head(model.norm(out)))


def test_norm_before_fc_is_one_rms_norm_over_the_concatenated_aux_states_before_fc():
    model = drafter(norm_before_fc=True)
    assert model.shape.expected_tensors()["input_norm.weight"] == ((3 * H,), None)
    assert model.input_norm.weight.shape == (3 * H,) and model.input_norm.eps == model.shape.rms_norm_eps
    aux = torch.randn(2, 5, 3 * H) * torch.tensor([1.0, 10.0, 100.0]).repeat_interleave(H)  # aux layers of very different scales
    expected = model.fc(rms_norm(aux, model.input_norm.weight, model.shape.rms_norm_eps))
    assert torch.allclose(model.project_aux(aux), expected, atol=1e-6)
    # Not SGLang's fc_norm (one norm per aux layer): those would differ on these scales.
    per_chunk = torch.cat([rms_norm(c, w, 1e-5) for c, w in zip(aux.chunk(3, -1), model.input_norm.weight.chunk(3))], -1)
    assert not torch.allclose(model.project_aux(aux), model.fc(per_chunk), atol=1e-3)


def sglang_chain(model: Eagle3Drafter, aux, ids, norm_before_fc: bool, norm_output: bool, steps: int):
    """SGLang's LlamaModel.forward (llama_eagle3.py), written out: draft extend over the prompt's aux states, then a chain of
    steps fed the returned aux hidden state; logits = lm_head(norm(h + residual)) and the state fed on is norm_output's pick.
    Returns the logits of the last prompt position and of each chained step."""
    layer, attn, eps = model.midlayer, model.midlayer.self_attn, model.shape.rms_norm_eps
    keys, values, logits = [], [], []

    def step(hidden_states, token_ids, positions):
        embeds = torch.nn.functional.embedding(token_ids, model.embed_weight)
        if hidden_states.shape[-1] != embeds.shape[-1]:  # target aux states: (input_norm), fc
            if norm_before_fc:
                hidden_states = rms_norm(hidden_states, model.input_norm.weight, eps)
            hidden_states = model.fc(hidden_states)
        residual = hidden_states  # the input layer: residual is the incoming state, then hidden_norm / input_layernorm
        x = torch.cat([rms_norm(embeds, layer.input_layernorm.weight, eps), rms_norm(hidden_states, layer.hidden_norm.weight, eps)], -1)
        cos, sin = model.rotary(x, positions)
        q, k, v = attn.project(x, cos, sin)
        keys.append(k)
        values.append(v)
        k_all, v_all = torch.cat(keys, 2), torch.cat(values, 2)
        total = k_all.shape[2]
        mask = torch.ones(1, 1, positions.shape[1], total, dtype=torch.bool).tril(total - positions.shape[1])
        h = attn.attend(q, [(k_all, v_all, mask)])
        residual = h + residual  # post_attention_layernorm(h, residual): fused add
        h = layer.mlp(rms_norm(residual, layer.post_attention_layernorm.weight, eps))
        to_aux = h + residual  # norm(h, residual): (normed, h + residual)
        to_logits = rms_norm(to_aux, model.norm.weight, eps)
        logits.append(model.lm_head(to_logits)[:, -1])
        return (to_logits if norm_output else to_aux)[:, -1:]

    n = aux.shape[1]
    fed = step(aux, ids[:, 1 : n + 1], torch.arange(n)[None])  # extend: aux states of positions 0..n-1, the token after each
    for j in range(1, steps):  # chain: the fed state and the next token, one position on
        fed = step(fed, ids[:, n + j : n + j + 1], torch.tensor([[n - 1 + j]]))
    return logits


@pytest.mark.parametrize("norm_before_fc, norm_output", [(False, False), (True, False), (False, True), (True, True)])
def test_decode_runs_the_chain_as_sglang_does(norm_before_fc, norm_output):
    """Eagle3Drafter.decode (and so every eyrie decoder: project_aux, layer_output, head) against SGLang's forward written out:
    the head reads norm(out) once; norm_output feeds norm(out), weight included, to the next step."""
    model = drafter(seed=3, norm_before_fc=norm_before_fc, norm_output=norm_output)
    torch.manual_seed(4)
    n, steps = 7, 3
    aux = torch.randn(1, n, 3 * H) * 4
    ids = torch.randint(0, V, (1, n + steps))
    with torch.no_grad():
        expected = sglang_chain(model, aux, ids, norm_before_fc, norm_output, steps)
        cache = DraftCache()
        logits, out = model.decode(model.project_aux(aux), ids[:, 1 : n + 1], torch.arange(n)[None], cache)
        got = [logits[:, -1]]
        hidden = out[:, -1:]
        for j in range(1, steps):
            logits, hidden = model.decode(hidden, ids[:, n + j : n + j + 1], torch.tensor([[n - 1 + j]]), cache)
            got.append(logits[:, -1])
    for j, (a, b) in enumerate(zip(got, expected)):
        assert torch.allclose(a, b, atol=1e-5), j
    if norm_output:  # not vacuous: feeding the pre-norm state gives other chained logits
        with torch.no_grad():
            plain = sglang_chain(model, aux, ids, norm_before_fc, False, steps)
        assert not torch.allclose(plain[-1], expected[-1], atol=1e-3)


@pytest.mark.parametrize("norm_before_fc, norm_output", [(True, False), (False, True), (True, True)])
def test_config_and_tensors_round_trip_through_the_checkpoint(tmp_path, norm_before_fc, norm_output):
    model = drafter(norm_before_fc=norm_before_fc, norm_output=norm_output)
    config = model.shape.sglang_config(torch_dtype="float32")
    assert config.get("norm_before_fc", False) is norm_before_fc and config["eagle_config"].get("norm_before_fc", False) is norm_before_fc
    assert config.get("norm_output", False) is norm_output
    tensors = checkpoint_tensors(model, torch.float32)  # checked key by key: input_norm.weight exactly when norm_before_fc
    assert ("input_norm.weight" in tensors) is norm_before_fc
    write_checkpoint(tmp_path / "drafter", config, tensors, [])
    loaded = load_drafter(tmp_path / "drafter", model.embed_weight)
    assert (loaded.shape.norm_before_fc, loaded.shape.norm_output) == (norm_before_fc, norm_output)
    aux, ids = torch.randn(1, 6, 3 * H), torch.randint(0, V, (1, 6))
    with torch.no_grad():
        for a, b in zip(model.decode(model.project_aux(aux), ids, torch.arange(6)[None], DraftCache()),
                        loaded.decode(loaded.project_aux(aux), ids, torch.arange(6)[None], DraftCache())):
            assert torch.equal(a, b)
    # A checkpoint without the norm's tensor is refused, not loaded with a silently missing norm.
    if norm_before_fc:
        with pytest.raises(Exception, match="missing input_norm.weight"):
            check_checkpoint({k: v for k, v in tensors.items() if k != "input_norm.weight"}, model.shape)


def test_flags_are_read_where_sglang_reads_them():
    """norm_before_fc: eagle_config's, else the top level's; norm_output: the top level's only."""
    base = drafter().shape.sglang_config()

    def shape(**changes):
        config = {**base, "eagle_config": dict(base["eagle_config"])}
        for key, value in changes.items():
            if key.startswith("eagle_"):
                config["eagle_config"][key.removeprefix("eagle_")] = value
            else:
                config[key] = value
        return DrafterShape.from_sglang_config(config)

    assert shape(eagle_norm_before_fc=True).norm_before_fc and shape(norm_before_fc=True).norm_before_fc
    assert not shape(eagle_norm_before_fc=False, norm_before_fc=True).norm_before_fc  # eagle_config wins, as in SGLang
    assert shape(norm_output=True).norm_output and not shape(eagle_norm_output=True).norm_output
    assert not shape().norm_before_fc and not shape().norm_output


def _sglang_eagle3_source() -> Path | None:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "srt" / "models" / "llama_eagle3.py"
    return path if path.is_file() else None


def test_sglangs_eagle3_module_reads_these_names():
    """SGLang's llama_eagle3.py (read, not imported: it needs triton): LlamaModel owns input_norm (loaded by name as
    model.input_norm.weight), applies it before fc, reads norm_before_fc from eagle_config then the config and
    norm_output from the config."""
    path = _sglang_eagle3_source()
    if path is None:
        pytest.skip("sglang is not installed (pip install --no-deps sglang==0.5.23)")
    source = path.read_text()
    tree = ast.parse(source)
    model_class = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "LlamaModel")
    attributes = {target.attr for node in ast.walk(model_class) if isinstance(node, ast.Assign)
                  for target in node.targets if isinstance(target, ast.Attribute)}
    assert {"input_norm", "fc", "norm", "norm_output", "norm_before_fc"} <= attributes
    assert 'eagle_config.get("norm_before_fc", getattr(config, "norm_before_fc", False))' in source
    assert 'getattr(config, "norm_output", False)' in source
    forward = next(node for node in model_class.body if isinstance(node, ast.FunctionDef) and node.name == "forward")
    text = ast.unparse(forward)
    assert text.index("self.input_norm(hidden_states)") < text.index("self.fc(hidden_states)")
    assert "hidden_states_to_logits if self.norm_output else hidden_states_to_aux" in text


def test_sglangs_draft_layer_takes_its_mlp_width_from_the_drafters_own_config():
    """drafter.intermediate_size is served as trained: SGLang's draft decoder layer sizes its MLP from the draft config
    (config.json's intermediate_size), not from the target's."""
    path = _sglang_eagle3_source()
    if path is None:
        pytest.skip("sglang is not installed (pip install --no-deps sglang==0.5.23)")
    tree = ast.parse(path.read_text())
    layer = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "LlamaDecoderLayer")
    init = ast.unparse(next(node for node in layer.body if isinstance(node, ast.FunctionDef) and node.name == "__init__"))
    assert "inter_size = config.intermediate_size" in init
    assert "self.mlp = LlamaMLP(config.hidden_size, inter_size" in init
