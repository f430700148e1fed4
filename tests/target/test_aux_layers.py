"""The aux-layer convention against each engine's own code and transformers' output_hidden_states.

eyrie trains on output_hidden_states[i + 1] for SGLang-convention id i (eyrie.target.aux_layers.capture_indices)
and writes the ids twice in the drafter's config.json: nested for SGLang, top level in vLLM's convention. Here a
tiny random Llama gives the residual stream entering every layer; SGLang 0.5.23's set_eagle3_layers_to_capture
(read from the installed sglang) and vLLM 0.33.0's aux-layer resolution and capture bookkeeping (cut out of its
wheel) are run on the ids eyrie writes, and what each engine would capture must be what eyrie trained on.
"""

from __future__ import annotations

import re
import types
import warnings

import pytest
import torch
from factories import tiny_llama
from target.engine_sources import function_from, function_source, sglang_file, vllm_file

from eyrie.config import validate
from eyrie.core.errors import ConfigError
from eyrie.drafter.checkpoint import serving_config
from eyrie.drafter.model import DrafterShape
from eyrie.target.aux_layers import AuxLayerError, capture_indices, default_aux_layer_ids, sglang_version_caveat, vllm_layer_ids

LAYERS = 8


def test_vllm_ids_are_the_capture_indices():
    assert vllm_layer_ids([1, 14, 26], 30) == capture_indices([1, 14, 26], 30) == [2, 15, 27]
    assert vllm_layer_ids([1, 14, 26]) == [2, 15, 27]  # the target's depth unknown: no range check
    with pytest.raises(AuxLayerError, match="outside"):
        vllm_layer_ids([1, 14, 29], 30)


@pytest.mark.parametrize("ids", [[14, 1, 26], [1, 26, 14], [26, 14, 1]])
def test_unsorted_ids_are_refused_everywhere(ids):
    """Both engines capture in layer order: unsorted ids would permute fc's input between training and serving."""
    with pytest.raises(AuxLayerError, match="strictly ascending"):
        capture_indices(ids, 30)
    with pytest.raises(ConfigError, match=r"drafter\.aux_layer_ids: .*strictly ascending"):
        validate({"model": {"name": "m", "path": "/m"}, "datasets": {"d": {"source": {"file": "x.jsonl"}}}, "drafter": {"aux_layer_ids": ids}})


def test_ids_not_starting_at_1_warn_that_sglang_versions_disagree():
    assert sglang_version_caveat([1, 14, 26]) is None
    assert "SGLang versions disagree" in sglang_version_caveat([0, 14, 26])
    base = {"model": {"name": "m", "path": "/m"}, "datasets": {"d": {"source": {"file": "x.jsonl"}}}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        validate({**base, "drafter": {"aux_layer_ids": [1, 3, 5]}})
        validate(base)
        assert not caught
        validate({**base, "drafter": {"aux_layer_ids": [2, 3, 5]}})
    assert len(caught) == 1 and "SGLang versions disagree" in str(caught[0].message)


@pytest.fixture(scope="module")
def streams():
    """A tiny random Llama: output_hidden_states, and the residual stream entering / leaving every decoder layer."""
    model = tiny_llama(hidden=32, layers=LAYERS, vocab=64, intermediate=64, positions=64)
    entering, leaving = {}, {}
    hooks = []
    for index, layer in enumerate(model.model.layers):
        hooks.append(layer.register_forward_pre_hook(lambda m, args, kwargs, i=index: entering.__setitem__(i, (args[0] if args else kwargs["hidden_states"]).detach()), with_kwargs=True))
        hooks.append(layer.register_forward_hook(lambda m, args, out, i=index: leaving.__setitem__(i, (out[0] if isinstance(out, tuple) else out).detach())))
    with torch.no_grad():
        out = model(input_ids=torch.randint(0, 64, (1, 12)), output_hidden_states=True)
    for hook in hooks:
        hook.remove()
    hidden_states = [h.detach() for h in out.hidden_states]
    # What the tests below rely on: transformers' index L is the stream entering decoder layer L (0: the embeddings).
    for index in range(LAYERS):
        assert torch.equal(hidden_states[index], entering[index])
        if index + 1 < LAYERS:
            assert torch.equal(leaving[index], entering[index + 1])
    return {"hidden_states": hidden_states, "entering": entering, "leaving": leaving, "embeddings": hidden_states[0]}


def drafter_config(aux_layer_ids) -> dict:
    """config.json as eyrie writes it (DrafterShape.sglang_config completed by checkpoint.serving_config)."""
    shape = DrafterShape(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
                         vocab_size=64, draft_vocab_size=16, target_hidden_size=32, max_position_embeddings=64, aux_layer_ids=list(aux_layer_ids))
    return serving_config(shape.sglang_config())


def trained_on(streams, aux_layer_ids) -> list[torch.Tensor]:
    return [streams["hidden_states"][c] for c in capture_indices(aux_layer_ids, LAYERS)]


def sglang_capture(streams, source: str, cls: str, nested_ids) -> list[torch.Tensor]:
    """What SGLang captures: its own set_eagle3_layers_to_capture, then the stream entering each layer it names, in layer order."""
    set_layers = function_from(source, f"{cls}.set_eagle3_layers_to_capture")
    fake = types.SimpleNamespace(pp_group=types.SimpleNamespace(is_last_rank=True), config=types.SimpleNamespace(num_hidden_layers=LAYERS),
                                 model=types.SimpleNamespace())
    set_layers(fake, nested_ids)
    return [streams["entering"][i] for i in range(LAYERS) if i in fake.model.layers_to_capture]


def vllm_capture(streams, top_level_ids) -> list[torch.Tensor]:
    """What vLLM captures: EagleModelMixin's own bookkeeping, called where vLLM's LlamaModel.forward calls it."""
    interfaces = vllm_file("model_executor/models/interfaces.py")
    set_layers = function_from(interfaces, "EagleModelMixin._set_aux_hidden_state_layers")
    maybe_add = function_from(interfaces, "EagleModelMixin._maybe_add_hidden_state")
    mixin = types.SimpleNamespace(_cache_aux_pp_layout=lambda: None)
    set_layers(mixin, tuple(top_level_ids))
    captured: list[torch.Tensor] = []
    maybe_add(mixin, captured, 0, streams["embeddings"], None)  # start_layer, before the first layer
    for index in range(LAYERS):
        maybe_add(mixin, captured, index + 1, streams["leaving"][index], None)
    return captured


def test_sglang_llama_loop_captures_the_stream_entering_each_named_layer():
    """The loop sglang_capture emulates, pinned in SGLang's own LlamaModel.forward."""
    forward = re.sub(r"\s+", " ", function_source(sglang_file("srt/models/llama.py"), "LlamaModel.forward"))
    assert "for i in range(self.start_layer, self.end_layer):" in forward
    assert "capture_output=aux_hidden_states.capture if i in self.layers_to_capture else None" in forward


def test_vllm_llama_loop_captures_after_each_layer_with_id_plus_one():
    """The calls vllm_capture makes, pinned in vLLM's own LlamaModel.forward: id 0 before the layers, idx + 1 after layer idx."""
    forward = re.sub(r"\s+", " ", function_source(vllm_file("model_executor/models/llama.py"), "LlamaModel.forward"))
    assert "self._maybe_add_hidden_state(aux_hidden_states, self.start_layer, hidden_states, residual)" in forward
    assert "self._maybe_add_hidden_state(aux_hidden_states, idx + 1, hidden_states, residual)" in forward


@pytest.mark.parametrize("aux_layer_ids", [[1, 3, 5], [1, LAYERS // 2 - 1, LAYERS - 4], [0, 2, 6], [2, 4, 6]])
def test_both_engines_capture_what_eyrie_trained_on(streams, aux_layer_ids):
    config = drafter_config(aux_layer_ids)
    expected = trained_on(streams, aux_layer_ids)
    nested, top_level = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"], config["eagle_aux_hidden_state_layer_ids"]
    assert nested == aux_layer_ids and top_level == [i + 1 for i in aux_layer_ids]

    sglang = sglang_capture(streams, sglang_file("srt/models/llama.py"), "LlamaForCausalLM", nested)
    assert len(sglang) == 3 and all(torch.equal(a, b) for a, b in zip(sglang, expected))

    vllm = vllm_capture(streams, top_level)
    assert len(vllm) == 3 and all(torch.equal(a, b) for a, b in zip(vllm, expected))
    # Reading the nested (SGLang) ids as vLLM ids, as vLLM's V1 runner did for eyrie's old config.json, is one layer early.
    early = vllm_capture(streams, nested)
    assert not all(torch.equal(a, b) for a, b in zip(early, expected))


def test_sglang_targets_that_add_one_only_after_a_first_id_of_1(streams):
    """Why ids not starting at 1 warn: SGLang 0.5.23's DeepSeek-V2 loader reads [2, 4, 6] without the +1, one layer early."""
    source = sglang_file("srt/models/deepseek_v2.py")
    assert [torch.equal(a, b) for a, b in zip(sglang_capture(streams, source, "DeepseekV2ForCausalLM", [1, 3, 5]), trained_on(streams, [1, 3, 5]))] == [True] * 3
    shifted = sglang_capture(streams, source, "DeepseekV2ForCausalLM", [2, 4, 6])
    assert not any(torch.equal(a, b) for a, b in zip(shifted, trained_on(streams, [2, 4, 6])))
    assert sglang_version_caveat([2, 4, 6]) is not None and sglang_version_caveat([1, 3, 5]) is None


def test_engine_defaults_are_eyries_default(streams):
    """With no ids at all both engines capture [2, N//2, N-3]: the capture of eyrie's default [1, N//2-1, N-4]."""
    default_capture = capture_indices(default_aux_layer_ids(LAYERS), LAYERS)
    fake = types.SimpleNamespace(pp_group=types.SimpleNamespace(is_last_rank=True), config=types.SimpleNamespace(num_hidden_layers=LAYERS),
                                 model=types.SimpleNamespace())
    function_from(sglang_file("srt/models/llama.py"), "LlamaForCausalLM.set_eagle3_layers_to_capture")(fake, None)
    assert list(fake.model.layers_to_capture) == default_capture
    holder = types.SimpleNamespace(layers=[None] * LAYERS)
    vllm_default = function_from(vllm_file("model_executor/models/interfaces.py"), "SupportsEagle3.get_eagle3_default_aux_hidden_state_layers")
    assert list(vllm_default(types.SimpleNamespace(model=holder))) == default_capture


def test_vllm_runners_read_the_top_level_ids(tmp_path):
    """vLLM's V1 and V2 model runners resolve the aux layers from the draft's config: both take the top-level ids.

    Without them (eyrie's config.json before this key), V2 ignores the nested key and falls back to its defaults,
    and V1 uses the nested SGLang ids unchanged: one layer early.
    """
    v2 = function_from(vllm_file("v1/worker/gpu/spec_decode/eagle/eagle3_utils.py"), "get_eagle3_aux_layers_from_config")
    v1 = function_from(vllm_file("v1/worker/gpu_model_runner.py"), "GPUModelRunner._get_eagle3_aux_layers_from_config")

    def resolve(config: dict):
        spec = types.SimpleNamespace(draft_model_config=types.SimpleNamespace(hf_config=types.SimpleNamespace(**config)))
        return v1(types.SimpleNamespace(speculative_config=spec)), v2(spec)

    config = drafter_config([1, 3, 5])
    assert resolve(config) == ((2, 4, 6), (2, 4, 6))
    old = {k: v for k, v in config.items() if k != "eagle_aux_hidden_state_layer_ids"}
    assert resolve(old) == ((1, 3, 5), None)
