"""The aux-layer convention, owned here and nowhere else (docs/DESIGN.md "Aux layers").

``aux_layer_ids`` are SGLang's ``eagle_aux_hidden_state_layer_ids``: the 0-based index i of the
decoder layer whose OUTPUT is fused. SGLang captures the residual stream entering layer i + 1,
which is transformers' ``output_hidden_states[i + 1]`` (index 0 being the embeddings). An
off-by-one here loads without complaint and costs acceptance silently, so every stage derives
its capture from `capture_indices`.

vLLM names the same layers differently: its id L takes the stream after L decoder layers, i.e.
``output_hidden_states[L]``, so vLLM's ids (config.json's top-level ``eagle_aux_hidden_state_layer_ids``,
and the speculators format's) are the capture indices themselves (`vllm_layer_ids`). Both engines
capture in layer order, whatever order the ids are written in: ids must be strictly ascending, or
the fc input would be fused in another order than the one trained.
"""

from __future__ import annotations

import numpy as np

from eyrie.core.errors import ContractError


class AuxLayerError(ContractError):
    pass


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default, in SGLang's convention: outputs of layers [1, N//2 - 1, N - 4]."""
    ids = [1, num_layers // 2 - 1, num_layers - 4]
    capture_indices(ids, num_layers)  # a target too shallow for the default fails here, clearly
    return ids


def capture_indices(aux_layer_ids, num_layers: int | None) -> list[int]:
    """transformers' output_hidden_states indices for SGLang-convention aux layer ids: [i + 1 for i in ids].

    num_layers None (the target's depth unknown, e.g. when only a drafter's config.json is at hand)
    skips the range check; everything else is checked.
    """
    ids = list(aux_layer_ids)
    if len(ids) != 3 or any(isinstance(i, bool) or not isinstance(i, (int, np.integer)) for i in ids):
        raise AuxLayerError(f"aux_layer_ids must be three integer layer ids (EAGLE-3 fuses exactly three), got {ids!r}")
    ids = [int(i) for i in ids]
    if len(set(ids)) != 3:
        raise AuxLayerError(f"aux_layer_ids must be three distinct layers, got {ids}")
    if ids != sorted(ids):
        raise AuxLayerError(
            f"aux_layer_ids {ids} must be strictly ascending, e.g. {sorted(ids)}: SGLang and vLLM capture the aux states in "
            "layer order whatever order the ids are written in, so the drafter's fc would be trained on one order and served another"
        )
    if num_layers is None:
        if ids[0] < 0:
            raise AuxLayerError(f"aux_layer_ids {ids}: layer ids are 0-based, {ids[0]} is not a layer")
        return [i + 1 for i in ids]
    bad = [i for i in ids if not 0 <= i <= num_layers - 2]
    if bad:
        raise AuxLayerError(
            f"aux_layer_ids {ids}: {bad} outside 0..{num_layers - 2} for a target with {num_layers} decoder layers "
            "(SGLang convention: the index of the decoder layer whose output is taken; the last layer's output "
            f"is the final state, not an aux one; default [1, {num_layers // 2 - 1}, {num_layers - 4}])"
        )
    return [i + 1 for i in ids]


def vllm_layer_ids(aux_layer_ids, num_layers: int | None = None) -> list[int]:
    """vLLM's eagle_aux_hidden_state_layer_ids for SGLang-convention ids: vLLM's id L takes output_hidden_states[L]
    (the stream after L layers), so they are the capture indices themselves."""
    return capture_indices(aux_layer_ids, num_layers)


def sglang_version_caveat(aux_layer_ids) -> str | None:
    """Why these ids may be served one layer early by some SGLang, or None when every SGLang reads them alike.

    SGLang 0.5.23 adds 1 to every id for Llama-family targets (models/llama.py set_eagle3_layers_to_capture), but
    its DeepSeek-V2/V3 and GLM-4-MoE-Lite targets add 1 only when the first id is 1, and SGLang made that rule
    general in 2026-05. Ids starting at 1 (the default's) mean the same everywhere; others depend on the version.
    """
    ids = [int(i) for i in aux_layer_ids]
    if ids and ids[0] == 1:
        return None
    return (
        f"aux_layer_ids {ids} do not start at 1: SGLang versions disagree on such ids. SGLang 0.5.23 adds 1 to each for "
        "Llama-family targets (capture = output_hidden_states[i + 1], what eyrie trains on), but its DeepSeek-V2/V3 and "
        "GLM-4-MoE-Lite loaders, and SGLang versions since its 2026-05 change, add 1 only when the first id is 1 and would "
        "feed this drafter the layers one below. vLLM (top-level ids, capture indices) is unaffected. Start the ids at 1 "
        "to be safe everywhere, or check your SGLang's set_eagle3_layers_to_capture."
    )
