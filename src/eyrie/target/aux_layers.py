"""The aux-layer convention, owned here and nowhere else (docs/DESIGN.md "Aux layers").

``aux_layer_ids`` are SGLang's ``eagle_aux_hidden_state_layer_ids``: the 0-based index i of the
decoder layer whose OUTPUT is fused. SGLang captures the residual stream entering layer i + 1,
which is transformers' ``output_hidden_states[i + 1]`` (index 0 being the embeddings). An
off-by-one here loads without complaint and costs acceptance silently, so every stage derives
its capture from `capture_indices`.
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


def capture_indices(aux_layer_ids, num_layers: int) -> list[int]:
    """transformers' output_hidden_states indices for SGLang-convention aux layer ids: [i + 1 for i in ids]."""
    ids = list(aux_layer_ids)
    if len(ids) != 3 or any(isinstance(i, bool) or not isinstance(i, (int, np.integer)) for i in ids):
        raise AuxLayerError(f"aux_layer_ids must be three integer layer ids (EAGLE-3 fuses exactly three), got {ids!r}")
    ids = [int(i) for i in ids]
    if len(set(ids)) != 3:
        raise AuxLayerError(f"aux_layer_ids must be three distinct layers, got {ids}")
    bad = [i for i in ids if not 0 <= i <= num_layers - 2]
    if bad:
        raise AuxLayerError(
            f"aux_layer_ids {ids}: {bad} outside 0..{num_layers - 2} for a target with {num_layers} decoder layers "
            "(SGLang convention: the index of the decoder layer whose output is taken; the last layer's output "
            f"is the final state, not an aux one; default [1, {num_layers // 2 - 1}, {num_layers - 4}])"
        )
    return [i + 1 for i in ids]
