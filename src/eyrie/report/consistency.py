"""Agreement across stages: every stage must have been built with the chat template (and target) the tokens use.

A drafter trained on one chat template, or on another target's hidden states, loses acceptance
silently; nothing crashes. So the page checks what each stage recorded: completions against
tokens, then draft vocabulary, hidden-state cache, drafter and benchmarks against the tokens'
template, and the drafter's config.json against the cache and vocabulary it was trained on.
Each disagreement becomes a warning in the section of the stage that disagrees.
"""

from __future__ import annotations

from typing import Any

from eyrie.report.formats import short, show
from eyrie.report.values import distinct, warn


def completions_against_tokens(regeneration: dict, tokens: dict, warnings: list) -> None:
    """Shards that disagree on the chat template mean the tokens do not match what was generated."""
    generated = {d["name"]: d for d in regeneration["datasets"]}
    for dataset in regeneration["datasets"]:
        _warn_shards_disagree(dataset["name"], "completion", dataset["templates_by_shard"], warnings)
    for dataset in tokens["datasets"]:
        _warn_shards_disagree(dataset["name"], "token", dataset["templates_by_shard"], warnings)
        made = generated.get(dataset["name"])
        if made and made["template_sha256"] and dataset["template_sha256"] and set(made["template_sha256"]) != set(dataset["template_sha256"]):
            warn(
                warnings, "tokens",
                f"{dataset['name']}: completions were made with template_sha256 {short(made['template_sha256'])} "
                f"but tokens use {short(dataset['template_sha256'])}",
            )


def _warn_shards_disagree(name: str, stage: str, by_shard: dict[str, Any], warnings: list) -> None:
    if len({v for v in by_shard.values() if v}) > 1:
        listing = ", ".join(f"{shard}: {short([sha])}" for shard, sha in by_shard.items())
        warn(warnings, "tokens", f"{name}: {stage} shards disagree on template_sha256 ({listing})")


def across_stages(tokens: dict, vocab: dict | None, hidden: dict, drafter: dict | None, bench: dict, warnings: list) -> dict[str, Any]:
    """The chat template (and target) each stage was built with: all must equal the tokens' template."""
    token_templates = distinct(sha for d in tokens["datasets"] for sha in d["template_sha256"])
    rows = [{"stage": "tokens", "template_sha256": token_templates}]
    if vocab is not None:
        rows.append({"stage": "draft vocab", "template_sha256": distinct([vocab["template_sha256"]])})
    if hidden["shards"]:
        rows.append({"stage": "hidden states", "template_sha256": hidden["template_sha256"]})
    if drafter is not None:
        rows.append({"stage": "drafter", "template_sha256": distinct([drafter["template_sha256"]])})
    for b in bench["rows"]:
        if b["built"]:
            rows.append({"stage": f"benchmark {b['name']}", "template_sha256": distinct([b["template_sha256"]])})
    for row in rows:
        row["agrees"] = None if not token_templates or not row["template_sha256"] else set(row["template_sha256"]) == set(token_templates)
        if row["agrees"] is False:
            section = {"draft vocab": "vocab", "hidden states": "hidden", "drafter": "drafter"}.get(row["stage"], "bench")
            warn(
                warnings, section,
                f"{row['stage']}: template_sha256 {short(row['template_sha256'])} differs from the tokens' {short(token_templates)}; "
                "a drafter trained on one chat template loses acceptance silently under another",
            )
    if drafter is not None:
        _warn_drafter_mismatch(vocab, hidden, drafter, warnings)
    return {"templates": rows}


def _warn_drafter_mismatch(vocab: dict | None, hidden: dict, drafter: dict, warnings: list) -> None:
    if hidden["shards"] and drafter["aux_layer_ids"] is not None and hidden["aux_layer_ids"] != [drafter["aux_layer_ids"]]:
        warn(warnings, "drafter", f"the drafter's eagle_aux_hidden_state_layer_ids {drafter['aux_layer_ids']} differ from the hidden-state cache's {show(hidden['aux_layer_ids'])}: SGLang would feed it other layers than it was trained on")
    if hidden["shards"] and drafter["target_fingerprint"] and hidden["target_model_fingerprint"] != [drafter["target_fingerprint"]]:
        warn(warnings, "drafter", f"the drafter was trained for target {short([drafter['target_fingerprint']])}, the hidden-state cache comes from {short(hidden['target_model_fingerprint'])}")
    if vocab is not None and drafter["draft_vocab_size"] is not None and drafter["draft_vocab_size"] != vocab["draft_vocab_size"]:
        warn(warnings, "drafter", f"the drafter's draft_vocab_size {drafter['draft_vocab_size']} differs from the draft vocabulary's {vocab['draft_vocab_size']}")
    if drafter["architectures"] and drafter["architectures"] != ["LlamaForCausalLMEagle3"]:
        warn(warnings, "drafter", f"config.json architectures is {drafter['architectures']}, not ['LlamaForCausalLMEagle3']: SGLang's EAGLE3 loader expects that one")
