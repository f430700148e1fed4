"""Runs inside the speculators venv (tests/drafter/test_speculators_export.py builds it): no eyrie here.

python speculators_check.py JOB.json: for each case, load the export with speculators' own Eagle3DraftModel,
report what loaded (every exported tensor bit for bit, anything missing, NaN left over), run two training-time
steps on the given token ids and aux states and save the draft logits of each step (captured at lm_head);
then read the export and the SGLang-layout drafter with vLLM's own config classes (when the job names a
directory holding them) and report the fields vLLM ends up with. Prints one JSON object.
"""

from __future__ import annotations

import json
import logging
import sys
from importlib.metadata import version

import torch
from safetensors.torch import load_file, save_file

# Everything transformers and speculators log while loading: a missing or unexpected weight shows up here.
messages: list[str] = []


class _Keep(logging.Handler):
    def emit(self, record):
        messages.append(f"{record.name}: {record.getMessage()}")


logging.getLogger("transformers").addHandler(_Keep())
logging.getLogger("transformers").setLevel(logging.WARNING)


def speculators_case(case: dict) -> dict:
    from speculators.models.eagle3 import Eagle3DraftModel

    del messages[:]
    model = Eagle3DraftModel.from_pretrained(case["export"], dtype=torch.float32).eval()
    exported = load_file(f"{case['export']}/model.safetensors")
    state = model.state_dict()
    report = {
        "class": type(model).__name__,
        "config_class": type(model.config).__name__,
        "norm_before_residual": model.config.norm_before_residual,
        "target_layer_ids": list(model.target_layer_ids),
        "missing_from_model": sorted(set(exported) - set(state)),
        "not_in_export": sorted(set(state) - set(exported)),
        "differ_from_export": sorted(k for k in exported if k in state and not torch.equal(state[k].to(exported[k].dtype), exported[k])),
        "nan": sorted(k for k, v in state.items() if v.is_floating_point() and bool(v.isnan().any())),
        "log": [m for m in messages if any(w in m.lower() for w in ("missing", "unexpected", "not initialized", "newly initialized", "mismatch"))],
    }
    inputs = load_file(case["inputs"])
    captured: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: captured.append(out.detach().clone()))
    with torch.no_grad():
        model(hidden_states=inputs["aux"], input_ids=inputs["input_ids"], document_ids=torch.zeros_like(inputs["input_ids"]),
              position_ids=inputs["positions"], ttt_steps=2)
    hook.remove()
    save_file({f"step{i}": logits.contiguous() for i, logits in enumerate(captured)}, case["out"])
    return report


def vllm_case(case: dict) -> dict:
    from transformers import AutoConfig
    from vllm.transformers_utils.configs.eagle import EAGLEConfig
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    fields = ("architectures", "eagle_aux_hidden_state_layer_ids", "norm_before_residual", "norm_before_fc", "fc_norm", "norm_output",
              "draft_vocab_size", "target_hidden_size", "hidden_size", "num_hidden_layers", "head_dim", "hidden_act", "vocab_size")
    with open(f"{case['export']}/config.json", encoding="utf-8") as f:
        config_dict = json.load(f)
    speculators = SpeculatorsConfig.from_pretrained(case["export"])  # what vLLM builds the draft model from
    # As vLLM's SpeculativeConfig does for `"method": "eagle3"` and the SGLang-layout directory.
    eagle = EAGLEConfig(AutoConfig.from_pretrained(case["drafter"]), method="eagle3", model_type="eagle")
    return {
        "speculative_config": SpeculatorsConfig.extract_vllm_speculative_config(config_dict),
        "verifier": config_dict["speculators_config"]["verifier"]["name_or_path"],
        "speculators_format": {k: getattr(speculators, k, None) for k in fields},
        "sglang_layout": {k: getattr(eagle, k, None) for k in fields},
    }


def main() -> int:
    with open(sys.argv[1], encoding="utf-8") as f:
        job = json.load(f)
    if job.get("vllm_root"):
        sys.path.insert(0, job["vllm_root"])
    torch.manual_seed(0)
    results = {"versions": {name: version(name) for name in ("speculators", "transformers", "torch")}, "cases": {}}
    for case in job["cases"]:
        results["cases"][case["name"]] = {"speculators": speculators_case(case), "vllm": vllm_case(case) if job.get("vllm_root") else None}
    print(json.dumps(results, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
