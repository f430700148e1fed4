"""What many tests build: workspaces and the readers that compare them (tiny targets, drafters and tokenizers join here).

Test modules import from here, never from each other.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
from conftest import REPO

from eyrie import config as cfg
from eyrie.plan import planned_outputs

TIMING_WORDS = ("second", "time", "elapsed", "per_s", "date", "digest")  # what may differ between two runs of the same job


def without_timings(value):
    if isinstance(value, dict):
        return {k: without_timings(v) for k, v in value.items() if not any(word in k.lower() for word in TIMING_WORDS)}
    if isinstance(value, list):
        return [without_timings(v) for v in value]
    return value


def content(path: Path):
    """What a file holds, timings aside: rows and eyrie metadata of a Parquet shard, tensors and manifest of a safetensors file."""
    if path.suffix == ".parquet":
        table = pq.read_table(path)
        meta = json.loads((table.schema.metadata or {}).get(b"eyrie", b"{}"))
        return table.replace_schema_metadata(None).to_pylist(), without_timings(meta)
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
        manifest = json.loads((handle.metadata() or {}).get("manifest", "{}"))
    return {name: (t.dtype, t.shape, t.float().sum().item(), t.view(-1)[:64].tolist()) for name, t in tensors.items()}, without_timings(manifest)


def eyrie_verify(workdir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eyrie.cli", "verify", "-d", str(workdir)], capture_output=True, text=True, timeout=600)


def plans_of(workdir) -> tuple[set, set, set]:
    """(path, rule) of every result, as Snakemake's own DAG has them (`--summary`) and as eyrie.plan lists them, and
    those of eyrie.plan's that no job declares while nothing is lost (a dataset's prompt shards: Planned.declared_through)."""
    done = subprocess.run(  # noqa: PLW1510 -- the return code is asserted below
        [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(workdir), "--cores", "1", "--summary"],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split("\t") for line in done.stdout.splitlines()[1:] if "\t" in line]
    snakemake_plans = {(row[0], row[2]) for row in rows if not row[0].startswith("resources/")}
    planned = planned_outputs(cfg.load(workdir / "config.yaml"))
    return snakemake_plans, {(p.path, p.rule) for p in planned}, {(p.path, p.rule) for p in planned if p.declared_through}


FAMILIES = ("qwen3", "qwen3_moe", "deepseek_v3", "gpt_oss", "gemma3_text", "gemma3", "mistral")  # tiny_family_config's names


def tiny_family_config(family: str, *, vocab: int, hidden: int = 64, layers: int = 8, window: int = 16):
    """A random-weight target of a family at hidden 64: the family's own features kept (qk-norm, experts, MLA, sliding
    windows of `window` tokens, attention sinks, Gemma's (1 + w) norms and per-layer-type rope, a nested text config)."""
    import transformers as t

    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4, max_position_embeddings=1024,
                  bos_token_id=1, eos_token_id=2, pad_token_id=2)
    attention = dict(num_key_value_heads=2, head_dim=hidden // 4)
    alternating = ["sliding_attention", "full_attention"] * (layers // 2)
    if family == "qwen3":
        return t.Qwen3Config(**common, **attention, intermediate_size=128, tie_word_embeddings=True)
    if family == "qwen3_moe":
        return t.Qwen3MoeConfig(**common, **attention, intermediate_size=128, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                decoder_sparse_step=1, tie_word_embeddings=False)
    if family == "deepseek_v3":
        return t.DeepseekV3Config(**common, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                  v_head_dim=16, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                                  n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1, tie_word_embeddings=False)
    if family == "gpt_oss":
        return t.GptOssConfig(**common, **attention, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=window,
                              layer_types=alternating, tie_word_embeddings=False)
    text = dict(**common, **attention, intermediate_size=128, sliding_window=window, layer_types=alternating,
                rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    if family == "gemma3_text":
        return t.Gemma3TextConfig(**text)
    if family == "gemma3":
        vision = t.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14)
        return t.Gemma3Config(text_config=t.Gemma3TextConfig(**text), vision_config=vision, mm_tokens_per_image=4,
                              image_token_index=vocab - 1, boi_token_index=vocab - 2, eoi_token_index=vocab - 3)
    if family == "mistral":
        return t.MistralConfig(**common, **attention, intermediate_size=128, sliding_window=window, tie_word_embeddings=False)
    raise KeyError(f"no tiny {family!r} target; the families are {FAMILIES}")


def tiny_family_target(family: str, directory: Path, tokenizer_dir: Path | None = None, *, vocab: int | None = None, seed: int = 0,
                       norm_noise: float = 0.1) -> Path:
    """tiny_family_config's target saved as an HF directory (safetensors), with the tokenizer of tokenizer_dir when given.

    Norm weights get noise: a random-init norm is all ones (or all zeros for Gemma's (1 + w)), which hides a norm copied
    wrongly."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir) if tokenizer_dir is not None else None
    config = tiny_family_config(family, vocab=vocab or len(tokenizer))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.add_(norm_noise * torch.randn_like(parameter))
    model.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    return directory


# --------------------------------------------------------------------------- reasoning and tool-calling chat templates

# Qwen3's shape, shortened: tools in the system turn, a think block only on assistant turns after the last user message
# (earlier turns' thinking dropped, as Qwen3's, DeepSeek-R1's and Kimi-K2-Thinking's templates do), calls in
# <tool_call> tags, tool results in a user turn.
THINKING_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{%- endif %}"
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_query = loop.index0 %}{% endif %}{% endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}\n<|im_start|>user\n{{ m.content }}<|im_end|>"
    "{%- elif m.role == 'assistant' %}\n<|im_start|>assistant\n"
    "{%- if loop.index0 > ns.last_query and m.reasoning_content is defined %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ m.content }}{% if m.tool_calls is defined %}{% for c in m.tool_calls %}\n<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}{% endif %}<|im_end|>'
    "{%- elif m.role == 'tool' %}\n<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}\n<|im_start|>assistant\n{% endif %}"
)

# Hermes' shape: tools in the system turn, calls in <tool_call> tags, results in a `tool` turn; thinking is kept in every
# turn, so history renders stably.
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call functions. <tools>{{ tools | tojson }}</tools>"
    "{% if messages[0].role == 'system' %}\n{{ messages[0].content }}{% endif %}<|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}<|im_start|>user\n{{ m.content }}<|im_end|>\n"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n"
    "{%- if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}"
    "{%- if m.tool_calls is defined %}{% for c in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}{% endif %}<|im_end|>\n'
    "{%- elif m.role == 'tool' %}<|im_start|>tool\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer(template: str, specials=("<|im_start|>", "<|im_end|>")):
    """A byte-level tokenizer (one token per byte, no merges) with `specials` and a chat template: exact offsets and
    round trips, so a test can compare tokens with text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet))}
    backend = Tokenizer(models.BPE(vocab, [], unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=specials[-1], pad_token=specials[-1],
                                        additional_special_tokens=list(specials))
    tokenizer.chat_template = template
    return tokenizer


# --------------------------------------------------------------------------- reasoning and tool-calling chat templates

# Qwen3's shape, shortened: tools in the system turn, a think block only on assistant turns after the last user message
# (earlier turns' thinking dropped, as Qwen3's, DeepSeek-R1's and Kimi-K2-Thinking's templates do), calls in
# <tool_call> tags, tool results in a user turn.
THINKING_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{%- endif %}"
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_query = loop.index0 %}{% endif %}{% endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}\n<|im_start|>user\n{{ m.content }}<|im_end|>"
    "{%- elif m.role == 'assistant' %}\n<|im_start|>assistant\n"
    "{% if loop.index0 > ns.last_query and m.reasoning_content is defined %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ m.content }}{% if m.tool_calls is defined %}{% for c in m.tool_calls %}\n<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}{% endif %}<|im_end|>'
    "{%- elif m.role == 'tool' %}\n<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}\n<|im_start|>assistant\n{% endif %}"
)

# Hermes' shape: tools in the system turn, calls in <tool_call> tags, results in a `tool` turn; thinking is kept in every
# turn, so history renders stably.
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call functions. <tools>{{ tools | tojson }}</tools>"
    "{% if messages[0].role == 'system' %}\n{{ messages[0].content }}{% endif %}<|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}<|im_start|>user\n{{ m.content }}<|im_end|>\n"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}"
    "{%- if m.tool_calls is defined %}{% for c in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}{% endif %}<|im_end|>\n'
    "{%- elif m.role == 'tool' %}<|im_start|>tool\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer(template: str, specials=("<|im_start|>", "<|im_end|>")):
    """A byte-level tokenizer (one token per byte, no merges) with `specials` and a chat template: exact offsets and
    round trips, so a test can compare tokens with text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet))}
    backend = Tokenizer(models.BPE(vocab, [], unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=specials[-1], pad_token=specials[-1],
                                        additional_special_tokens=list(specials))
    tokenizer.chat_template = template
    return tokenizer
