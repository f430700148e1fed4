"""train.compile: the elementwise work of each TTT step fused by torch.compile (inductor).

Eager mode runs every cast, rotary multiply, RMSNorm, residual add and the MLP's SiLU * up as
separate kernels (about a fifth of the kernel time of a training step at the Llama-8B shape).
With train.compile these small pure functions run compiled instead:

    layer_inputs   embedding gather, both input RMSNorms, the concat, the rotary tables and the
                   cast of x to the autocast dtype (Eagle3Drafter.layer_inputs + ttt_hidden's cast)
    rotary_heads   the head split and rotary of q and k after their projections; for flex
                   attention also the cast of q and k to v's dtype that flex_ttt_attention does
    mlp_input      residual = hidden + attended and post_attention_layernorm(residual), cast
    swiglu         silu(gate) * up

The matrix products (q/k/v/o, gate/up/down) stay outside the graphs, as in eager mode: cuBLAS,
with autocast's cached weight casts; so does the last residual add, one kernel after down_proj.
Attention is not here either (flex attention is compiled on its own in eyrie.training.ttt_attention).
dynamic=True: batch rows and sequence length are symbolic, so a new batch shape reuses the graphs
(torch still specialises a size of 1, so one-row batches compile once more). The backward graphs are compiled with the forward (not lazily at the first backward;
torch 2.13 has the setting), so every compile failure surfaces inside a call here.

If compiling fails (no C++ compiler for inductor's CPU code, an op dynamo cannot trace, ...), a
warning is issued, the reason is kept in CompiledLayers.error and every piece runs eagerly from
then on: the training job goes on at eager speed instead of stopping.

Opt-in: 1.07x the CUDA defaults' speed at the Llama-8B drafter shape on an H100, but 0.86x at the pipeline's
shape on an H200 (docs/RESULTS.md, the train.compile key in schemas/config.schema.yaml).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from eyrie.core.fused_pieces import FusedPieces


def _layer_inputs(model, hidden, input_ids, positions, dtype):
    x, cos, sin = model.layer_inputs(hidden, input_ids, positions)
    return (x if dtype is None else x.to(dtype)), cos, sin


def _rotary_heads(attn, q, k, v, cos, sin, repeat_kv, qk_as_v):
    q, k, v = attn.rotary_heads(q, k, v, cos, sin, repeat_kv)
    if qk_as_v:
        q, k = q.to(v.dtype), k.to(v.dtype)
    return q, k, v


def _mlp_input(model, hidden, attended, dtype):
    """Eagle3Drafter.layer_output up to the MLP's matrix products; normed is cast as autocast would cast it."""
    residual = hidden + attended
    normed = model.midlayer.post_attention_layernorm(residual)
    return residual, (normed if dtype is None else normed.to(dtype))


def _swiglu(gate, up):
    return F.silu(gate) * up


PIECES = {"layer_inputs": _layer_inputs, "rotary_heads": _rotary_heads, "mlp_input": _mlp_input, "swiglu": _swiglu}


@functools.cache
def _compiled(name: str):
    return torch.compile(PIECES[name], dynamic=True, fullgraph=True)


@functools.cache
def _compile_settings() -> list[tuple]:
    """(config module, key, value) set around each compiled call, those this torch has: compile the
    backward with the forward, so that its failure surfaces in the call, and make hitting the recompile
    limit an error there instead of a silent switch to eager (unless suppress_errors, which excludes it)."""
    import torch._dynamo
    import torch._functorch.config

    wanted = [
        (torch._functorch.config, "force_non_lazy_backward_lowering", True),
        (torch._dynamo.config, "fail_on_recompile_limit_hit", not torch._dynamo.config.suppress_errors),
    ]
    return [(config, key, value) for config, key, value in wanted if hasattr(config, key)]


def _autocast_dtype(device: torch.device):
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None


class CompiledLayers(FusedPieces):
    """One TTT step's layer pieces, compiled; every method computes what the eager code computes.

    error: None while compiled, else why compiling failed (everything then runs eagerly).
    """

    def __init__(self):
        super().__init__(True, PIECES, lambda name: _compiled(name), "train.compile", "training goes on eagerly", _compile_settings)

    def layer_inputs(self, model, hidden, input_ids, positions, dtype=None):
        """model.layer_inputs, x cast to dtype (None: not cast)."""
        return self.run("layer_inputs", model, hidden, input_ids, positions, dtype)

    def project(self, attn, x, cos, sin, repeat_kv: bool = True, qk_as_v: bool = False):
        """attn.project: the projections eagerly, the rest compiled; qk_as_v casts q and k to v's dtype."""
        q, k, v = attn.shared_input_linears((attn.q_proj, attn.k_proj, attn.v_proj), x)  # one stacked product under fused weight grads
        return self.run("rotary_heads", attn, q, k, v.contiguous(), cos, sin, repeat_kv, qk_as_v)

    def layer_output(self, model):
        """model.layer_output (carried(residual + mlp(post_attention_layernorm(residual))), residual = hidden + attended)
        for one TTT step: a function of (hidden, attended). carried (drafter.norm_output's norm) runs eagerly.

        Called again by torch.utils.checkpoint's recompute (train.recompute_mlp), it takes the path,
        compiled or eager, that each piece took the first time: the recomputed tensors must be the
        ones the forward saved, even if compiling failed in between.
        """
        paths: list[bool] = []

        def run(name, replay, *args):
            if replay is not None:
                return (self.compiled(name) if next(replay) else self.pieces[name])(*args)
            result, compiled = self.run_reporting(name, *args)
            paths.append(compiled)
            return result

        def layer_output(hidden, attended):
            replay = iter(list(paths)) if paths else None
            mlp = model.midlayer.mlp
            residual, normed = run("mlp_input", replay, model, hidden, attended, _autocast_dtype(hidden.device))
            return model.carried(residual + mlp.down_proj(run("swiglu", replay, mlp.gate_proj(normed), mlp.up_proj(normed))))

        return layer_output
