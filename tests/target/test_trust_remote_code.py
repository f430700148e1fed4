"""Every transformers load of the target passes model.trust_remote_code as an explicit bool, so transformers never
asks on a terminal: a target with its own config code loads with the key on and is refused with the key off."""

from __future__ import annotations

import ast
import builtins
import json
from pathlib import Path

import pytest

from eyrie.target.family import target_text_config
from eyrie.target.head import load_target_head

ROOT = Path(__file__).resolve().parents[2]
# What loads the target (or its config or tokenizer): each call must say whether the target's own code may run.
LOADERS = {"from_pretrained": 1, "target_config": 1, "target_text_config": 1, "load_tokenizer": 1, "load_model": 3, "load_target": 3}

CUSTOM_CONFIG = '''
from transformers import PretrainedConfig


class CustomTextConfig(PretrainedConfig):
    model_type = "eyrie_custom_text"

    def __init__(self, vocab_size=32, hidden_size=8, num_hidden_layers=2, **kwargs):
        self.vocab_size, self.hidden_size, self.num_hidden_layers = vocab_size, hidden_size, num_hidden_layers
        super().__init__(**kwargs)
'''


def _calls_without_the_key(path: Path) -> list[str]:
    found = []
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        if name == "load_target_head":  # loads a config only when it is given none
            if len(node.args) < 2 and not any(k.arg in ("config", "trust_remote_code") for k in node.keywords):
                found.append(f"{where}:{node.lineno}: {name}")
            continue
        if name not in LOADERS or (isinstance(node.func, ast.Attribute) and name != "from_pretrained"):
            continue  # a method of the same name (OnlineStates.load_target) is not one of eyrie.target's loaders
        keywords = {k.arg for k in node.keywords}
        if "gguf_file" in keywords or None in keywords:  # a GGUF file holds no code of its own; **model_cfg carries the key
            continue
        if "trust_remote_code" not in keywords and len(node.args) <= LOADERS[name]:
            found.append(f"{where}:{node.lineno}: {name}")
    return found


def test_every_load_of_the_target_passes_trust_remote_code():
    files = sorted((ROOT / "src/eyrie").rglob("*.py")) + sorted((ROOT / "scripts").glob("*.py")) + sorted((ROOT / "benchmarks").rglob("*.py"))
    assert any(path.name == "regeneration.py" for path in files)  # the benchmarks are read too, not silently missing
    missing = [call for path in files for call in _calls_without_the_key(path)]
    assert not missing, "loads that leave trust_remote_code to transformers (it prompts, or fails without a terminal):\n" + "\n".join(missing)


def test_the_static_check_sees_a_call_without_the_key(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("target_text_config(d)\nload_tokenizer(d, True)\nAutoConfig.from_pretrained(d, trust_remote_code=x)\nload_target_head(d)\n")
    assert [c.split(": ")[1] for c in _calls_without_the_key(probe)] == ["target_text_config", "load_target_head"]


@pytest.fixture
def custom_code_target(tmp_path, monkeypatch) -> Path:
    """A target directory whose config class is its own code (auto_map), as a Kimi-K2 checkpoint's is."""
    target = tmp_path / "custom"
    target.mkdir()
    (target / "configuration_custom.py").write_text(CUSTOM_CONFIG)
    (target / "config.json").write_text(json.dumps({
        "model_type": "eyrie_custom_text", "vocab_size": 32, "hidden_size": 8, "num_hidden_layers": 2,
        "auto_map": {"AutoConfig": "configuration_custom.CustomTextConfig"},
    }))

    def no_prompt(*args, **kwargs):
        raise AssertionError("transformers asked on the terminal whether to run the target's code")

    monkeypatch.setattr(builtins, "input", no_prompt)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return target


def test_a_target_with_its_own_config_code_loads_with_the_key_on(custom_code_target):
    config = target_text_config(custom_code_target, True)
    assert type(config).__name__ == "CustomTextConfig" and config.vocab_size == 32


def test_with_the_key_off_it_is_refused_without_asking(custom_code_target):
    with pytest.raises(ValueError, match="trust_remote_code"):
        target_text_config(custom_code_target, False)


def test_the_lm_head_reader_passes_the_key_on(custom_code_target):
    import torch
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.ones(32, 8), "lm_head.weight": torch.ones(32, 8), "model.norm.weight": torch.ones(8)},
              str(custom_code_target / "model.safetensors"))
    head = load_target_head(custom_code_target, trust_remote_code=True)
    assert tuple(head["lm_head"].shape) == (32, 8)
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_target_head(custom_code_target, trust_remote_code=False)
