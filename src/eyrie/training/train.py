"""Train the EAGLE-3 drafter on the hidden-state cache, with training-time test (TTT).

Alignment (EAGLE-3). For a sample of tokens x_0..x_{n-1} with cached aux states a_t and final
normed states f_t (target logits at t = lm_head(f_t), predicting x_{t+1}):

    step 0, position t:  hidden g = fc(a_t), input token x_{t+1}, rotary position t,
                         target softmax(lm_head(f_{t+1})) -> predicts x_{t+2}
    step j, position t:  hidden = the drafter's own pre-norm output of step j-1 at t,
                         input token x_{t+1+j}, rotary position t+j,
                         target softmax(lm_head(f_{t+1+j})) -> predicts x_{t+2+j}

Attention at step j: the query sees the step-0 keys at positions <= t (causal) and the keys of
steps 1..j at position t only (diagonal blocks). That is exactly what inference sees when it
chains j drafts after position t, so the training forward at every step equals ``decode``
(tested). A position is trained at step j when x_{t+2+j} exists, is an assistant token
(loss_mask) and the target's full-vocabulary argmax at t+1+j lies in the draft vocabulary.

Loss per step: soft cross-entropy against the target distribution restricted (renormalised) to
the draft vocabulary; total = sum_j decay^j * loss_j.

State for resuming lives in ``state_dir`` (safetensors for tensors, JSON for the rest, each
written then renamed); the declared output directory is written once, at the end, atomically.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

from eyrie.core.batching import batches_by_tokens
from eyrie.drafter.model import CheckpointError, DrafterShape, Eagle3Drafter, check_checkpoint
from eyrie.core.errors import EyrieError
from eyrie.hidden.fp8 import FP8_NAME
from eyrie.training.ttt_attention import resolve_attention

# Mirrors schemas/config.schema.yaml (the pipeline passes validated, complete sections; tests and
# callers of the library may pass partial ones).
DRAFTER_DEFAULTS = {"draft_vocab_size": 32000, "aux_layer_ids": None, "ttt_steps": 7, "step_weight_decay": 0.8}
TRAIN_DEFAULTS = {
    "epochs": 4,
    "learning_rate": 3e-4,
    "warmup_ratio": 0.05,
    "weight_decay": 0.0,
    "max_grad_norm": 0.5,
    "batch_tokens": 4096,
    "seed": 0,
    "dtype": "auto",
    "device": "auto",
    "log_every": 10,
    "attention": "auto",
    "recompute_mlp": False,
    "compile": False,
    "processes": 1,
}
STATE_JSON = "state.json"
STATE_FORMAT = "eyrie-train-state/1"
ARCHITECTURE = "LlamaForCausalLMEagle3"


class TrainingError(EyrieError):
    """Drafter training cannot start or go on."""


class TrainingInputError(TrainingError):
    """The inputs (cache, vocabulary, target, settings) do not fit together; nothing was trained."""


# --------------------------------------------------------------------------- target


def target_text_config(target_dir: str | Path):
    from transformers import AutoConfig

    from eyrie.target.model import check_model_dir

    config = AutoConfig.from_pretrained(check_model_dir(target_dir))
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _target_weight_files(target_dir: Path) -> dict[str, Path]:
    """tensor name -> safetensors file holding it (sharded or not)."""
    from safetensors import safe_open

    index = target_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: target_dir / file for name, file in weight_map.items()}
    files = sorted(target_dir.glob("*.safetensors"))
    if not files:
        raise TrainingInputError(f"{target_dir}: no *.safetensors weights; the drafter needs the target's embeddings and LM head")
    where = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                where[name] = file
    return where


def load_target_head(target_dir: str | Path, config=None) -> dict[str, torch.Tensor]:
    """The target's embed_tokens, lm_head (= embed_tokens when tied) and final norm, float32; nothing else is read."""
    from safetensors import safe_open

    target_dir = Path(target_dir)
    config = config if config is not None else target_text_config(target_dir)
    where = _target_weight_files(target_dir)
    embed_keys = sorted((k for k in where if k.endswith("embed_tokens.weight")), key=len)
    if not embed_keys:
        raise TrainingInputError(f"{target_dir}: no *embed_tokens.weight tensor in the target's safetensors")
    embed_key = embed_keys[0]
    prefix = embed_key[: -len("embed_tokens.weight")]  # "model." for Llama-like targets

    def read(name: str) -> torch.Tensor:
        with safe_open(str(where[name]), framework="pt") as f:
            return f.get_tensor(name).float()

    embed = read(embed_key)
    V, H = int(config.vocab_size), int(config.hidden_size)
    if tuple(embed.shape) != (V, H):
        raise TrainingInputError(f"{target_dir}: {embed_key} has shape {tuple(embed.shape)}, the config says ({V}, {H})")
    tied = bool(getattr(config, "tie_word_embeddings", False))
    head_keys = sorted((k for k in where if k.endswith("lm_head.weight")), key=len)
    if tied:
        lm_head = embed
    elif head_keys:
        lm_head = read(head_keys[0])
    else:
        raise TrainingInputError(f"{target_dir}: the target does not tie its embeddings but has no lm_head.weight")
    if tuple(lm_head.shape) != (V, H):
        raise TrainingInputError(f"{target_dir}: lm_head has shape {tuple(lm_head.shape)}, expected ({V}, {H})")
    norm = read(prefix + "norm.weight") if prefix + "norm.weight" in where else None
    if norm is not None and tuple(norm.shape) != (H,):
        norm = None
    return {"embed": embed, "lm_head": lm_head, "norm": norm}


# --------------------------------------------------------------------------- hidden-state cache


class HiddenCache:
    """The shards of the hidden-state cache, read lazily: only each batch's rows leave the files."""

    def __init__(self, paths: list[str]):
        from safetensors import safe_open

        from eyrie.hidden.cache import read_manifest, stored_names

        if not paths:
            raise TrainingInputError("no hidden-state cache shards given")
        self.paths = [str(p) for p in paths]
        self.manifests = [read_manifest(p) for p in self.paths]
        self._handles = [safe_open(p, framework="pt") for p in self.paths]
        # float8 shards carry per-token scales; batch() dequantizes, so training sees float32 either way.
        self.fp8 = [m.get("dtype") == FP8_NAME for m in self.manifests]
        self.input_ids, self.loss_mask, self.offsets, self.widths = [], [], [], []
        for path, f, manifest in zip(self.paths, self._handles, self.manifests):
            names = set(f.keys())
            missing = [n for n in stored_names(manifest) if n not in names]
            if missing:
                raise TrainingInputError(f"{path}: hidden-state cache lacks tensors {missing}")
            ids = f.get_tensor("input_ids").long()
            mask = f.get_tensor("loss_mask").bool()
            offsets = f.get_tensor("offsets").long()
            aux_shape = f.get_slice("aux_hidden").get_shape()
            final_shape = f.get_slice("final_hidden").get_shape()
            T = ids.numel()
            if mask.numel() != T or aux_shape[0] != T or final_shape[0] != T or len(aux_shape) != 2 or len(final_shape) != 2:
                raise TrainingInputError(
                    f"{path}: tensors disagree in token count (input_ids {T}, loss_mask {mask.numel()}, "
                    f"aux_hidden {aux_shape}, final_hidden {final_shape}); rebuild the cache"
                )
            if offsets.numel() < 1 or int(offsets[0]) != 0 or int(offsets[-1]) != T or bool((offsets[1:] < offsets[:-1]).any()):
                raise TrainingInputError(f"{path}: offsets do not partition the {T} cached tokens; rebuild the cache")
            self.input_ids.append(ids)
            self.loss_mask.append(mask)
            self.offsets.append(offsets)
            self.widths.append((int(aux_shape[1]), int(final_shape[1])))

    def samples(self, max_len: int) -> tuple[list[tuple[int, int, int]], int, int]:
        """(shard, start, length) of every sample with something to train on; also (#truncated, #skipped)."""
        out, truncated, skipped = [], 0, 0
        for s, (offsets, mask) in enumerate(zip(self.offsets, self.loss_mask)):
            for k in range(offsets.numel() - 1):
                a, b = int(offsets[k]), int(offsets[k + 1])
                n = b - a
                if n > max_len:
                    truncated += 1
                    n = max_len
                # Trainable positions predict tokens 2..n-1 (the first needs aux at 0 and token 1).
                if n < 3 or not bool(mask[a + 2 : a + n].any()):
                    skipped += 1
                    continue
                out.append((s, a, n))
        return out, truncated, skipped

    def batch(self, refs: list[tuple[int, int, int]], device, dtype=torch.float32) -> dict[str, torch.Tensor]:
        """Padded tensors for these samples: aux [B, L, 3H], final [B, L, H] (in dtype, fp8 dequantized), input_ids, loss_mask [B, L], lengths [B]."""
        from eyrie.hidden.cache import read_state_rows

        B, L = len(refs), max(n for _, _, n in refs)
        aux_w, final_w = self.widths[refs[0][0]]
        aux = torch.zeros(B, L, aux_w, dtype=dtype)
        final = torch.zeros(B, L, final_w, dtype=dtype)
        ids = torch.zeros(B, L, dtype=torch.long)
        mask = torch.zeros(B, L, dtype=torch.bool)
        for row, (s, a, n) in enumerate(refs):
            f = self._handles[s]
            aux[row, :n] = read_state_rows(f, "aux_hidden", a, a + n, self.fp8[s]).to(dtype)
            final[row, :n] = read_state_rows(f, "final_hidden", a, a + n, self.fp8[s]).to(dtype)
            ids[row, :n] = self.input_ids[s][a : a + n]
            mask[row, :n] = self.loss_mask[s][a : a + n]
        lengths = torch.tensor([n for _, _, n in refs], dtype=torch.long)
        return {
            "aux": aux.to(device),
            "final": final.to(device),
            "input_ids": ids.to(device),
            "loss_mask": mask.to(device),
            "lengths": lengths.to(device),
            "tokens": int(lengths.sum()),
        }


def plan_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Indices grouped by length (longest first) so that each batch's rows x longest <= batch_tokens."""
    return batches_by_tokens(lengths, batch_tokens)


# --------------------------------------------------------------------------- the TTT forward and loss


def shift_left(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """y[:, t] = x[:, t + n], filled past the end."""
    if n == 0:
        return x
    pad = x.new_full((x.shape[0], min(n, x.shape[1]), *x.shape[2:]), fill)
    return torch.cat([x[:, n:], pad], dim=1)


def ttt_hidden(
    model: Eagle3Drafter,
    aux: torch.Tensor,
    input_ids: torch.Tensor,
    lengths: torch.Tensor,
    steps: int,
    select=None,
    *,
    attention: str = "eager",
    recompute_mlp: bool = False,
    compiled=None,
) -> list[torch.Tensor]:
    """The drafter's pre-norm output of each TTT step, aligned to the query position t.

    aux [B, L, 3H] and input_ids [B, L] are the sample's own (index t = token t); step j at
    position t reads token t+1+j at rotary position t+j (see the module docstring). Without
    select, step j's output is [B, L, H]; with select (one bool [B, L] mask per step) it is
    [n_j, H] for the selected positions only (the draft head, the costliest matrix product, is then
    applied only where a loss is taken). attention: "eager" (DraftAttention.attend, the reference)
    or "flex" (eyrie.training.ttt_attention). recompute_mlp: keep only the MLP's input for backward and
    recompute the rest (about 230 MB less per step at the Llama-8B shape, one more MLP forward).
    compiled: an eyrie.training.compiled_layers.CompiledLayers (train.compile) runs the layer's elementwise
    work through torch.compile; None runs it eagerly.
    """
    B, L = input_ids.shape
    flex = attention == "flex"
    if flex:  # pad to whole flex tiles; padded positions are past every length, never selected
        from eyrie.training.ttt_attention import padded_length, ttt_block_mask

        Lp = padded_length(L, input_ids.device)
        aux, input_ids = _pad_time(aux, Lp), _pad_time(input_ids, Lp)
        if select is not None:  # bool masks gain padded columns; flat indices b * L + t move to b * Lp + t
            select = [_pad_time(m, Lp) if m.dtype == torch.bool else m + (m // L) * (Lp - L) for m in select]
        # Built once per padded length (cached), while little memory is in use.
        block_masks = [ttt_block_mask(Lp, j + 1, str(input_ids.device)) for j in range(steps)]
    else:
        Lp = L
    attn = model.midlayer.self_attn
    pos = torch.arange(Lp, device=input_ids.device)
    if not flex:
        key_real = pos[None, :] < lengths[:, None]  # (B, Tk)
        causal = pos[:, None] >= pos[None, :]  # (Tq, Tk)
        mask0 = (causal[None] & key_real[:, None, :]).unsqueeze(1)  # (B, 1, Tq, Tk)
    compute_dtype = _autocast_dtype(aux.device)
    hidden = model.fc(aux)
    blocks, keys, values, outs = [], [], [], []
    for j in range(steps):
        tokens = shift_left(input_ids, 1 + j)
        positions = (pos + j).unsqueeze(0).expand(B, Lp)
        if compiled is None:
            x, cos, sin = model.layer_inputs(hidden, tokens, positions)
            if compute_dtype is not None:  # one cast shared by q, k, v (autocast would keep three copies)
                x = x.to(compute_dtype)
        else:
            x, cos, sin = compiled.layer_inputs(model, hidden, tokens, positions, compute_dtype)
        if flex:
            from eyrie.training.ttt_attention import flex_ttt_attention

            if compiled is None:
                q, k, v = attn.project(x, cos, sin, repeat_kv=False)
            else:  # q, k come out in v's dtype: the cast flex_ttt_attention makes, fused into the rotary
                q, k, v = compiled.project(attn, x, cos, sin, repeat_kv=False, qk_as_v=True)
            keys.append(k)
            values.append(v)
            attended = attn.output(flex_ttt_attention(q, keys, values, block_masks[j]))
        else:
            q, k, v = attn.project(x, cos, sin) if compiled is None else compiled.project(attn, x, cos, sin)
            blocks.append((k, v, mask0 if j == 0 else None))
            attended = attn.attend(q, blocks)
        layer_output = model.layer_output if compiled is None else compiled.layer_output(model)
        if recompute_mlp:
            from torch.utils.checkpoint import checkpoint

            out = checkpoint(layer_output, hidden, attended, use_reentrant=False)
        else:
            out = layer_output(hidden, attended)
        outs.append(out[:, :L] if select is None else pick_positions(out, select[j]))
        hidden = out
    return outs


def pick_positions(x: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """x[where] for a bool mask over x's first two dims, or the same rows by flat index (b * L + t) without a host sync."""
    if where.dtype == torch.bool:
        return x[where]
    return x.reshape(-1, *x.shape[2:]).index_select(0, where)


def positions_of(masks: list[torch.Tensor]) -> list[torch.Tensor]:
    """Flat indices (b * L + t) of each bool mask's True positions, all found with two host syncs.

    Indexing with a bool mask syncs with the GPU each time (its result's size is data-dependent):
    with 7 TTT steps and three uses per step that was about 40 stalls per training step.
    """
    stacked = torch.stack(masks).flatten(1)  # (S, B*L)
    counts = stacked.sum(1).tolist()
    flat = stacked.flatten().nonzero().squeeze(1) % stacked.shape[1]  # step-major, so split by counts
    return list(flat.split(counts))


def ttt_forward(model: Eagle3Drafter, aux: torch.Tensor, input_ids: torch.Tensor, lengths: torch.Tensor, steps: int, select=None, **options) -> list[torch.Tensor]:
    """Draft-vocabulary logits of each TTT step: [B, L, Vd], or [n_j, Vd] with select (see ttt_hidden)."""
    # test_training_forward_equals_chained_inference_decode ties this to decode.
    return [model.head(out) for out in ttt_hidden(model, aux, input_ids, lengths, steps, select, **options)]


def _pad_time(x: torch.Tensor, length: int) -> torch.Tensor:
    """x [B, L, ...] zero-padded (False for bool) along dim 1 to length."""
    if x.shape[1] == length:
        return x
    pad = x.new_zeros((x.shape[0], length - x.shape[1], *x.shape[2:]))
    return torch.cat([x, pad], dim=1)


def _autocast_dtype(device: torch.device):
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None


def _chunk_rows(vocab_size: int, device) -> int:
    budget = (1 << 27) if torch.device(device).type == "cuda" else (1 << 24)  # elements of one [rows, V] chunk
    return max(1, budget // vocab_size)


_MM_FLOAT32_OUT = {"works": None}  # whether torch.mm(..., out_dtype=float32) runs on this torch/GPU


def _logits_float32(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """rows @ weight.T as float32, in weight's dtype: a bf16 head is multiplied in bf16 (fp32 accumulate)
    and, where torch supports it on CUDA, written out in fp32 without rounding the logits to bf16."""
    rows = rows.to(weight.dtype)
    if weight.dtype != torch.float32 and weight.is_cuda and _MM_FLOAT32_OUT["works"] is not False:
        try:
            logits = torch.mm(rows, weight.T, out_dtype=torch.float32)
            _MM_FLOAT32_OUT["works"] = True
            return logits
        except (TypeError, RuntimeError, NotImplementedError):  # older torch or no kernel: bf16 output instead
            _MM_FLOAT32_OUT["works"] = False
    return (rows @ weight.T).float()


@torch.no_grad()
def target_distribution(final: torch.Tensor, needed: torch.Tensor, lm_head: torch.Tensor, draft_ids: torch.Tensor, t2d: torch.Tensor, chunk_rows: int | None = None):
    """The target's view at the needed positions s of final [B, L, H].

    lm_head [V, H] is used in its own dtype (bf16 on CUDA: no float32 copy of a 128256 x 4096 head).

    Returns (probs [N, Vd] float32: softmax of the target logits gathered at draft_ids, i.e. the
    distribution renormalised over the draft vocab, one row per needed position; row [B, L]: the
    row of position s, -1 where not needed; arg [B, L]: draft id of the FULL-vocabulary argmax at
    s, -1 where it lies outside the draft vocab or s is not needed). The full-vocabulary logits
    exist one chunk of positions at a time, never [B*L, V] at once.
    """
    B, L, H = final.shape
    Vd = draft_ids.numel()
    needed_index = needed.flatten().nonzero().squeeze(1)  # one host sync; index_select/index_copy_ below need none
    rows = final.reshape(B * L, H).index_select(0, needed_index)
    N = rows.shape[0]
    chunk_rows = chunk_rows or _chunk_rows(lm_head.shape[0], final.device)
    probs = torch.empty(N, Vd, dtype=torch.float32, device=final.device)
    argmax = torch.empty(N, dtype=torch.long, device=final.device)
    for a in range(0, N, chunk_rows):
        logits = _logits_float32(rows[a : a + chunk_rows], lm_head)  # [c, V]
        argmax[a : a + chunk_rows] = logits.argmax(-1)
        probs[a : a + chunk_rows] = torch.softmax(logits[:, draft_ids], dim=-1)
        del logits
    draft_arg = torch.where(t2d[argmax], torch.searchsorted(draft_ids, argmax).clamp(max=Vd - 1), torch.full_like(argmax, -1))
    row = torch.full((B * L,), -1, dtype=torch.long, device=final.device)
    row.index_copy_(0, needed_index, torch.arange(N, device=final.device))
    arg = torch.full((B * L,), -1, dtype=torch.long, device=final.device)
    arg.index_copy_(0, needed_index, draft_arg)
    return probs, row.view(B, L), arg.view(B, L)


def needed_targets(loss_mask: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Positions s whose target is used by some step: token s+1 exists and is an assistant token."""
    L = loss_mask.shape[1]
    return shift_left(loss_mask, 1, False) & (torch.arange(L, device=loss_mask.device)[None, :] + 1 < lengths[:, None])


def step_targets(j: int, target_row, target_arg, loss_mask, lengths):
    """Step j at query position t uses the target at position t+1+j (it predicts token t+2+j).

    Returns (valid [B, L]: trained positions -- token t+2+j exists, is an assistant token, and the
    target's argmax at t+1+j is in the draft vocab; row [B, L] and arg [B, L]: the target's
    probability row and argmax draft id at t+1+j).
    """
    L = loss_mask.shape[1]
    pos = torch.arange(L, device=loss_mask.device)
    row = shift_left(target_row, 1 + j, -1)
    arg = shift_left(target_arg, 1 + j, -1)
    valid = (pos[None, :] + 2 + j < lengths[:, None]) & shift_left(loss_mask, 2 + j, False) & (arg >= 0) & (row >= 0)
    return valid, row, arg


def ttt_loss(logits_per_step, targets, target_probs, decay: float):
    """(sum_j decay^j * soft cross-entropy of step j, per-step (loss, correct, count)).

    logits_per_step[j] holds the logits of step j's trained positions only ([n_j, Vd], from
    ttt_forward with select = the valid masks); targets[j] = step_targets(j, ...).
    """
    total = 0.0
    stats = []
    for j, (logits, (valid, row, arg)) in enumerate(zip(logits_per_step, targets)):
        count = logits.shape[0]
        if count == 0:
            stats.append((0.0, 0, 0))
            continue
        logp = torch.log_softmax(logits.float(), dim=-1)
        loss_j = -(target_probs[row[valid]] * logp).sum(-1).mean()
        correct = int((logits.argmax(-1) == arg[valid]).sum())
        total = total + (decay**j) * loss_j
        stats.append((float(loss_j.detach()), correct, count))
    if not torch.is_tensor(total):
        total = sum(logits.sum() for logits in logits_per_step) * 0.0  # keeps backward() valid for an all-masked batch
    return total, stats


def step_loss_sum(model: Eagle3Drafter, out: torch.Tensor, valid, row, arg, target_probs, chunked: bool = True):
    """(soft cross-entropy summed over step j's trained positions, #argmax hits); out = ttt_hidden's [n_j, H].

    chunked: eyrie.training.draft_loss (never keeps [n_j, Vd] logits for backward); otherwise the plain
    formula of ttt_loss (the reference).
    """
    rows, args = pick_positions(row, valid), pick_positions(arg, valid)  # valid: bool [B, L] or flat indices
    if chunked:
        from eyrie.training.draft_loss import chunked_soft_cross_entropy

        return chunked_soft_cross_entropy(model.norm(out), model.lm_head.weight, target_probs, rows, args)
    logits = model.head(out)
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(target_probs[rows] * logp).sum(), (logits.argmax(-1) == args).sum()


class TTTObjective(torch.nn.Module):
    """The drafter's training loss as one module forward, so DistributedDataParallel can wrap it.

    compile (train.compile): the layer's elementwise work runs through torch.compile
    (eyrie.training.compiled_layers); self.compiled.error says why it fell back to eager, if it did.
    """

    def __init__(self, drafter: Eagle3Drafter, steps: int, decay: float, *, attention: str = "eager", chunked_loss: bool = True,
                 recompute_mlp: bool = False, compile: bool = False):
        super().__init__()
        self.drafter = drafter
        self.steps, self.decay = steps, decay
        self.attention, self.chunked_loss, self.recompute_mlp = attention, chunked_loss, recompute_mlp
        if compile:
            from eyrie.training.compiled_layers import CompiledLayers

            self.compiled = CompiledLayers()
        else:
            self.compiled = None

    def forward(self, aux, input_ids, lengths, targets, target_probs, counts, weight: float = 1.0):
        """(loss, stats [steps, 3] float64: per step loss sum, correct, count -- of these rows).

        loss = weight * sum_j decay^j * (this rank's loss sum of step j) / counts[j], counts being
        the trained positions of step j over all ranks: DDP averages gradients over ranks, so
        weight = world size makes the update that of the whole batch on one rank.
        """
        model = self.drafter
        outs = ttt_hidden(model, aux, input_ids, lengths, self.steps, select=[t[0] for t in targets],
                          attention=self.attention, recompute_mlp=self.recompute_mlp, compiled=self.compiled)
        loss, stats = 0.0, []
        for j, (out, (valid, row, arg)) in enumerate(zip(outs, targets)):
            loss_sum, correct = step_loss_sum(model, out, valid, row, arg, target_probs, self.chunked_loss)
            loss = loss + (self.decay**j) * loss_sum / counts[j].clamp(min=1).to(loss_sum.dtype)
            count = torch.full((), float(out.shape[0]), dtype=torch.float64, device=out.device)  # a fill, not a host copy
            stats.append(torch.stack([loss_sum.detach().double(), correct.double(), count]))
        return loss * weight, torch.stack(stats)


def train_step(objective, optimizer, batch: dict, *, target_lm_head, draft_ids, t2d, max_grad_norm: float, use_bf16: bool) -> dict:
    """One optimizer step on this rank's rows of the step's batch; the same code on one rank or many.

    objective: a TTTObjective, or DistributedDataParallel around one (then batch["weight"] is the
    world size, 0 for a rank without rows that runs a stand-in row to keep the collectives going).
    Returns the step's figures over all ranks: loss (sum_j decay^j * mean loss of step j), stats
    [(loss_j, correct_j, count_j)] and tokens.
    """
    inner = objective.module if isinstance(objective, torch.nn.parallel.DistributedDataParallel) else objective
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    steps, decay = inner.steps, inner.decay
    weight = float(batch.get("weight", 1.0))
    lengths, loss_mask = batch["lengths"], batch["loss_mask"]
    target_probs, target_row, target_arg = target_distribution(batch["final"], needed_targets(loss_mask, lengths), target_lm_head, draft_ids, t2d)
    targets = [step_targets(j, target_row, target_arg, loss_mask, lengths) for j in range(steps)]
    counts = torch.stack([t[0].sum() for t in targets]).double() * (weight != 0)
    if distributed:
        torch.distributed.all_reduce(counts)
    # Each step's trained positions as flat indices, found once: bool-mask indexing would stall on every use.
    targets = [(index, row, arg) for index, (_, row, arg) in zip(positions_of([t[0] for t in targets]), targets)]
    device_type = batch["aux"].device.type
    with torch.autocast(device_type=device_type, dtype=torch.bfloat16, enabled=use_bf16):
        loss, stats = objective(batch["aux"], batch["input_ids"], lengths, targets, target_probs, counts, weight)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    params = [p for p in inner.parameters() if p.requires_grad]
    torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    optimizer.step()
    totals = torch.cat([stats.flatten() * (weight != 0), stats.new_full((1,), float(batch["tokens"]) * (weight != 0))])
    if distributed:
        torch.distributed.all_reduce(totals)
    totals = totals.tolist()  # the step's one host sync
    per_step = [(totals[3 * j], int(totals[3 * j + 1]), int(totals[3 * j + 2])) for j in range(steps)]
    means = [(loss_sum / count if count else 0.0, correct, count) for loss_sum, correct, count in per_step]
    return {"loss": sum(decay**j * m[0] for j, m in enumerate(means) if m[2]), "stats": means, "tokens": int(totals[-1])}


# --------------------------------------------------------------------------- schedule and state


def learning_rate(step: int, total_steps: int, base: float, warmup_ratio: float) -> float:
    """Linear warmup, then cosine decay towards 0; step is 0-based."""
    warmup = int(warmup_ratio * total_steps)
    if step < warmup:
        return base * (step + 1) / warmup
    progress = (step - warmup) / max(1, total_steps - warmup)
    return base * 0.5 * (1.0 + math.cos(math.pi * progress))


def _epoch_order(seed: int, epoch: int, n: int) -> list[int]:
    return np.random.default_rng([int(seed), int(epoch)]).permutation(n).tolist()


def _save_state(state_dir: Path, model, optimizer, meta: dict) -> None:
    from safetensors.torch import save_file

    state_dir.mkdir(parents=True, exist_ok=True)
    tensors = {f"model.{name}": p.detach().cpu().contiguous() for name, p in model.named_parameters() if p.requires_grad}
    opt = optimizer.state_dict()
    opt_scalars = {}
    for idx, entry in opt["state"].items():
        for key, value in entry.items():
            if torch.is_tensor(value):
                tensors[f"optimizer.{idx}.{key}"] = value.detach().cpu().contiguous()
            else:
                opt_scalars[f"{idx}.{key}"] = value
    tensors["rng.cpu"] = torch.get_rng_state()
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = s
    step = meta["step"]
    name = f"state-{step:08d}.safetensors"
    tmp = state_dir / f".{name}.{os.getpid()}.tmp"
    save_file(tensors, str(tmp))
    os.replace(tmp, state_dir / name)
    meta = {**meta, "format": STATE_FORMAT, "tensors": name, "optimizer_param_groups": opt["param_groups"], "optimizer_scalars": opt_scalars}
    tmp = state_dir / f".{STATE_JSON}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(meta))
    os.replace(tmp, state_dir / STATE_JSON)
    for old in state_dir.glob("state-*.safetensors"):  # only after state.json names the new file
        if old.name != name:
            old.unlink(missing_ok=True)


def _load_state(state_dir: Path, run_id: str, model, optimizer, progress: bool) -> dict | None:
    from safetensors.torch import load_file

    path = state_dir / STATE_JSON
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text())
        tensors = load_file(str(state_dir / meta["tensors"]))
    except Exception as exc:  # a half-written or foreign state is not fatal: train from the start
        _say(progress, f"train: ignoring unreadable resume state in {state_dir} ({exc}); starting over")
        return None
    if meta.get("format") != STATE_FORMAT or meta.get("run_id") != run_id:
        _say(progress, f"train: resume state in {state_dir} is from other inputs or settings; starting over")
        return None
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(tensors[f"model.{name}"])
    opt_state: dict = {}
    for key, value in tensors.items():
        if key.startswith("optimizer."):
            _, idx, field = key.split(".", 2)
            opt_state.setdefault(int(idx), {})[field] = value
    for key, value in meta["optimizer_scalars"].items():
        idx, field = key.split(".", 1)
        opt_state.setdefault(int(idx), {})[field] = value
    optimizer.load_state_dict({"state": opt_state, "param_groups": meta["optimizer_param_groups"]})
    torch.set_rng_state(tensors["rng.cpu"])
    if torch.cuda.is_available():
        states = [tensors[k] for k in sorted(k for k in tensors if k.startswith("rng.cuda."))]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
    return meta


# --------------------------------------------------------------------------- checkpoint


def checkpoint_tensors(model: Eagle3Drafter, weight_dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Exactly SGLang's tensors (no embeddings), checked before anything is written."""
    expected = model.shape.expected_tensors()
    state = model.state_dict()
    stray = [n for n, p in model.named_parameters() if p.requires_grad and n not in expected]
    if stray:
        raise CheckpointError(f"the drafter has trainable tensors SGLang would not load: {stray}")
    tensors = {name: state[name].detach().cpu().to(dtype or weight_dtype).contiguous() for name, (_, dtype) in expected.items()}
    check_checkpoint(tensors, model.shape)
    return tensors


def _write_output(out_dir: Path, config: dict, tensors: dict, log: list[dict]) -> None:
    from safetensors.torch import save_file

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "training_log.json").write_text(json.dumps(log, indent=1) + "\n")
        old = None
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.{os.getpid()}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_drafter(drafter_dir: str | Path, target_embeddings: torch.Tensor) -> Eagle3Drafter:
    """A trained drafter (config.json + model.safetensors, safetensors only), checked, in eval mode."""
    from safetensors.torch import load_file

    drafter_dir = Path(drafter_dir)
    config_path, weights_path = drafter_dir / "config.json", drafter_dir / "model.safetensors"
    if not config_path.is_file() or not weights_path.is_file():
        raise CheckpointError(f"{drafter_dir}: not a drafter directory (needs config.json and model.safetensors)")
    config = json.loads(config_path.read_text())
    if config.get("architectures") != [ARCHITECTURE]:
        raise CheckpointError(f"{config_path}: architectures is {config.get('architectures')!r}, expected [{ARCHITECTURE!r}]")
    shape = DrafterShape.from_sglang_config(config)
    tensors = load_file(str(weights_path))
    try:
        check_checkpoint(tensors, shape)
    except CheckpointError as exc:
        raise CheckpointError(f"{weights_path}: {exc}") from None
    if tuple(target_embeddings.shape) != (shape.vocab_size, shape.hidden_size):
        raise CheckpointError(
            f"{drafter_dir}: target embeddings have shape {tuple(target_embeddings.shape)}, "
            f"the drafter was trained for ({shape.vocab_size}, {shape.hidden_size}); use the drafter's own target"
        )
    model = Eagle3Drafter(shape, target_embeddings.float(), tensors["d2t"], tensors["t2d"])
    model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}, strict=True)
    return model.eval()


# --------------------------------------------------------------------------- checks before training


def _check_inputs(*, cache: HiddenCache, target_config, d2t, t2d, vocab_manifest: dict, vocab_path: str, drafter_cfg: dict, template_sha256: str, target_fingerprint: str) -> list[int]:
    """Every guard that must pass before a single step; returns the aux layer ids to train with."""
    from eyrie.target.aux_layers import capture_indices, default_aux_layer_ids
    from eyrie.hidden.cache import check_manifest
    from eyrie.data.vocab import VocabError, check_vocab

    V, H, N = int(target_config.vocab_size), int(target_config.hidden_size), int(target_config.num_hidden_layers)

    # Draft vocabulary: fits the target, d2t and t2d agree.
    Vd = int(d2t.numel())
    if Vd > V:
        raise TrainingInputError(
            f"{vocab_path}: draft vocabulary has {Vd} ids, more than the target's vocabulary ({V}); "
            "it was built for another target: rebuild it (draft_vocab_size <= target vocab)"
        )
    if t2d.numel() != V:
        raise TrainingInputError(f"{vocab_path}: t2d covers {t2d.numel()} target ids, the target has {V}; rebuild the draft vocabulary for this target")
    try:
        check_vocab(d2t, t2d)
    except VocabError as exc:
        raise TrainingInputError(f"{vocab_path}: {exc}") from None
    vocab_template = vocab_manifest.get("template_sha256")
    if vocab_template is not None and vocab_template != template_sha256:
        raise TrainingInputError(
            f"{vocab_path}: built from tokens of chat template {vocab_template[:12]}, but the target's template is "
            f"{template_sha256[:12]}; rebuild the draft vocabulary"
        )

    # Cache: one target, template, layer set and width for all shards, and the ones in use.
    first = cache.manifests[0]
    aux_ids = first.get("aux_layer_ids")
    configured = drafter_cfg.get("aux_layer_ids")
    wanted = list(configured) if configured is not None else default_aux_layer_ids(N)
    try:
        capture_indices(wanted, N)
    except EyrieError as exc:
        raise TrainingInputError(f"drafter.aux_layer_ids: {exc}") from None
    for path, manifest in zip(cache.paths, cache.manifests):
        for key in ("aux_layer_ids", "target_model_fingerprint", "template_sha256", "hidden_size"):
            if manifest.get(key) != first.get(key):
                raise TrainingInputError(
                    f"hidden-state caches disagree on {key}: {cache.paths[0]} has {first.get(key)!r}, {path} has {manifest.get(key)!r}; "
                    "delete results/hidden/ so all shards are rebuilt with one target and settings"
                )
        check_manifest(
            manifest,
            target_model_fingerprint=target_fingerprint,
            template_sha256=template_sha256,
            aux_layer_ids=wanted,
            hidden_size=H,
            path=path,
        )
    for path, (aux_w, final_w) in zip(cache.paths, cache.widths):
        if aux_w != 3 * H:
            raise TrainingInputError(
                f"{path}: aux_hidden is {aux_w} wide, but the drafter's fc takes 3 x target hidden = {3 * H} "
                "(three concatenated aux layers, not the final state); rebuild the cache"
            )
        if final_w != H:
            raise TrainingInputError(f"{path}: final_hidden is {final_w} wide, the target's hidden size is {H}; rebuild the cache")
    for path, ids in zip(cache.paths, cache.input_ids):
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= V):
            raise TrainingInputError(f"{path}: token ids outside the target vocabulary [0, {V}); the cache is from another target")
    return [int(i) for i in aux_ids]


def _say(progress: bool, line: str) -> None:
    if progress:
        print(line, file=sys.stderr, flush=True)


def _run_id(cache: HiddenCache, d2t, drafter_cfg, train_cfg, template_sha256, target_fingerprint) -> str:
    """Identity of a training run: what must match for a saved state to be resumed."""
    digest = hashlib.sha256()
    for manifest in cache.manifests:
        digest.update(json.dumps({k: v for k, v in manifest.items() if k not in ("file_bytes", "bytes_per_token")}, sort_keys=True).encode())
    digest.update(d2t.numpy().tobytes())
    settings = {k: v for k, v in train_cfg.items() if k != "log_every"}
    digest.update(json.dumps([drafter_cfg, settings, template_sha256, target_fingerprint], sort_keys=True, default=str).encode())
    return digest.hexdigest()


def _window_entry(window: dict, steps: int) -> dict:
    loss = [window["loss"][j] / max(1, window["steps_with"][j]) for j in range(steps)]
    acc = [window["correct"][j] / window["count"][j] if window["count"][j] else None for j in range(steps)]
    return {"loss_per_step": loss, "acc_per_step": acc, "positions_per_step": list(window["count"])}


def _new_window(steps: int) -> dict:
    return {"loss": [0.0] * steps, "steps_with": [0] * steps, "correct": [0] * steps, "count": [0] * steps, "total": 0.0, "n": 0, "tokens": 0, "seconds": 0.0}


def _final_metrics(log: list[dict], steps_per_epoch: int, ttt_steps: int) -> dict:
    """Per-step loss and accuracy over the logged windows of (about) the last epoch."""
    if not log:
        return {}
    last = log[-1]["step"]
    window = [e for e in log if e["step"] > last - steps_per_epoch] or [log[-1]]
    acc, loss = [], []
    for j in range(ttt_steps):
        count = sum(e["positions_per_step"][j] for e in window)
        correct = sum((e["acc_per_step"][j] or 0.0) * e["positions_per_step"][j] for e in window)
        acc.append(correct / count if count else None)
        losses = [e["loss_per_step"][j] for e in window if e["positions_per_step"][j]]
        loss.append(sum(losses) / len(losses) if losses else None)
    return {"accuracy_per_step": acc, "loss_per_step": loss, "loss": sum(e["loss"] for e in window) / len(window), "over_steps": [window[0]["step"], last]}


# --------------------------------------------------------------------------- optimizer and ranks


def make_optimizer(model: Eagle3Drafter, learning_rate: float, weight_decay: float, fused: bool | None = None) -> torch.optim.AdamW:
    """AdamW over the float32 master weights (decay on matrices only); fused kernels on CUDA unless fused=False."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    if fused is None:
        fused = all(p.is_cuda for p in params)  # one kernel per group instead of several per tensor
    return torch.optim.AdamW(groups, lr=learning_rate, betas=(0.9, 0.95), **({"fused": True} if fused else {}))


def rank_share(refs: list, rank: int, world: int) -> tuple[list, float]:
    """This rank's rows of a step's batch and its loss weight (see TTTObjective.forward).

    Rows are dealt round-robin (the batch is sorted by length, so ranks get similar lengths).
    A rank left without rows trains a stand-in row at weight 0: DDP needs every rank's backward.
    """
    if world == 1:
        return refs, 1.0
    mine = refs[rank::world]
    return (mine, float(world)) if mine else (refs[:1], 0.0)


def data_parallel(objective: TTTObjective, device) -> torch.nn.parallel.DistributedDataParallel:
    """DDP around the objective; the frozen buffers (1 GB of embeddings) are not re-broadcast every step."""
    device = torch.device(device)
    return torch.nn.parallel.DistributedDataParallel(objective, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False)


class _Distributed:
    """This process's place in a torchrun launch (see train_drafter)."""

    def __init__(self, rank: int, world: int, device: str, owns_group: bool):
        self.rank, self.world, self.device, self.owns_group = rank, world, device, owns_group

    def close(self) -> None:
        if self.owns_group and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _distributed_context(device_setting: str) -> _Distributed | None:
    """None for a single process; otherwise join the torchrun group (NCCL on CUDA, gloo on CPU)."""
    from eyrie.target.model import resolve_device

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    if "RANK" not in os.environ:
        raise TrainingInputError(f"WORLD_SIZE={world} but RANK is not set; launch with torchrun (python -m torch.distributed.run)")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_setting)
    if device == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise TrainingInputError(f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} CUDA devices; use --nproc_per_node <= the GPU count")
        torch.cuda.set_device(local_rank)
        device, backend = f"cuda:{local_rank}", "nccl"
    else:
        backend = "gloo"
    owns_group = not torch.distributed.is_initialized()
    if owns_group:
        torch.distributed.init_process_group(backend)
    return _Distributed(rank, world, device, owns_group)


# --------------------------------------------------------------------------- training


def train_drafter(
    *,
    hidden_paths: list[str],
    vocab_path: str,
    target_dir: str,
    out_dir: str,
    state_dir: str,
    drafter_cfg: dict,
    train_cfg: dict,
    template_sha256: str,
    target_fingerprint: str,
    progress: bool = True,
    save_every_steps: int = 200,
    save_every_seconds: float = 600.0,
    on_step=None,
) -> dict:
    """Train the drafter and write out_dir (config.json, model.safetensors, training_log.json) once, atomically.

    Resumes from state_dir when a state of the same inputs and settings is there; saves one every
    save_every_steps steps or save_every_seconds seconds and at the end of each epoch.
    on_step(step) is called after each completed optimizer step (tests use it to interrupt).

    Several GPUs (data parallel): launch under torchrun, which sets WORLD_SIZE, RANK, LOCAL_RANK,
    MASTER_ADDR and MASTER_PORT; train_drafter sees WORLD_SIZE > 1, joins the group (NCCL on CUDA,
    one GPU per LOCAL_RANK; gloo on CPU) and wraps the model in DistributedDataParallel. Each
    step's batch (batch_tokens padded tokens, as on one GPU) is dealt out by rows, the loss is
    normalised over all ranks' positions, so the run follows the one-rank loss curve; rank 0 alone
    writes state_dir, out_dir and the log. From a shell (or a Snakemake ``shell:`` rule), with the
    keyword arguments of this function in a JSON file:

        NCCL_NVLS_ENABLE=0 python -m torch.distributed.run --standalone --nproc_per_node 2 -m eyrie.training.train args.json
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    from eyrie.target.model import resolve_device

    drafter_cfg = {**DRAFTER_DEFAULTS, **(drafter_cfg or {})}
    train_cfg = {**TRAIN_DEFAULTS, **(train_cfg or {})}
    ttt_steps, decay = int(drafter_cfg["ttt_steps"]), float(drafter_cfg["step_weight_decay"])
    if ttt_steps < 1:
        raise TrainingInputError(f"drafter.ttt_steps must be at least 1, got {ttt_steps}")

    # ---- inputs and every guard, before any step
    target_config = target_text_config(target_dir)
    vocab_file = Path(vocab_path)
    try:
        vocab = load_file(str(vocab_file))
        with safe_open(str(vocab_file), framework="pt") as f:
            vocab_manifest = json.loads((f.metadata() or {}).get("manifest", "{}"))
    except Exception as exc:  # safetensors raises its own error type for unreadable files
        raise TrainingInputError(f"{vocab_file}: not a readable draft vocabulary ({exc})") from exc
    if "d2t" not in vocab or "t2d" not in vocab:
        raise TrainingInputError(f"{vocab_file}: needs d2t and t2d tensors")
    d2t, t2d = vocab["d2t"], vocab["t2d"]
    if d2t.dtype != torch.int64 or t2d.dtype != torch.bool:
        raise TrainingInputError(f"{vocab_file}: d2t must be int64 offsets and t2d bool, got {d2t.dtype} and {t2d.dtype}")
    cache = HiddenCache(hidden_paths)
    aux_ids = _check_inputs(
        cache=cache, target_config=target_config, d2t=d2t, t2d=t2d, vocab_manifest=vocab_manifest, vocab_path=str(vocab_file),
        drafter_cfg=drafter_cfg, template_sha256=template_sha256, target_fingerprint=target_fingerprint,
    )
    Vd = int(d2t.numel())
    shape = DrafterShape.from_target(target_config, Vd, aux_ids)

    dist = _distributed_context(train_cfg["device"])
    device = dist.device if dist else resolve_device(train_cfg["device"])
    rank, world = (dist.rank, dist.world) if dist else (0, 1)
    progress = progress and rank == 0
    dtype = train_cfg["dtype"]
    use_bf16 = dtype == "bfloat16" or (dtype == "auto" and torch.device(device).type == "cuda")
    try:
        attention = resolve_attention(str(train_cfg["attention"]), device, shape.head_dim)
    except EyrieError as exc:
        raise TrainingInputError(str(exc)) from None
    weight_dtype = torch.float32 if dtype == "float32" else torch.bfloat16

    batch_tokens = int(train_cfg["batch_tokens"])
    samples, truncated, skipped = cache.samples(batch_tokens)
    if not samples:
        raise TrainingInputError(
            f"no trainable samples in {len(cache.paths)} cache shard(s) ({skipped} too short or without assistant tokens after position 2)"
        )
    batches = [[samples[k] for k in b] for b in plan_batches([n for _, _, n in samples], batch_tokens)]
    steps_per_epoch = len(batches)
    total_steps = max(1, math.ceil(float(train_cfg["epochs"]) * steps_per_epoch))
    seed = int(train_cfg["seed"])

    # ---- model, frozen embeddings, head start from the target's LM head
    head = load_target_head(target_dir, target_config)
    draft_ids = torch.arange(Vd, dtype=torch.int64) + d2t
    torch.manual_seed(seed)
    # Under bf16 autocast the frozen tensors live in bf16 (2 GB less each at a 128K x 4096 vocab);
    # the trained weights stay float32 masters for AdamW.
    frozen_dtype = torch.bfloat16 if use_bf16 else torch.float32
    model = Eagle3Drafter(shape, head["embed"].to(frozen_dtype), d2t, t2d)
    with torch.no_grad():
        model.lm_head.weight.copy_(head["lm_head"][draft_ids])
        if head["norm"] is not None:
            model.norm.weight.copy_(head["norm"])
    target_lm_head = head["lm_head"].to(device=device, dtype=frozen_dtype)
    del head
    model.to(device)
    draft_ids_dev, t2d_dev = draft_ids.to(device), t2d.to(device)
    optimizer = make_optimizer(model, float(train_cfg["learning_rate"]), float(train_cfg["weight_decay"]))
    objective = TTTObjective(model, ttt_steps, decay, attention=attention, recompute_mlp=bool(train_cfg["recompute_mlp"]),
                             compile=bool(train_cfg["compile"]))
    compiled = objective.compiled  # kept here: DDP hides the objective's attributes

    # ---- resume
    state_path = Path(state_dir)
    run_id = _run_id(cache, d2t, drafter_cfg, train_cfg, template_sha256, target_fingerprint)
    meta = _load_state(state_path, run_id, model, optimizer, progress)
    if meta is not None:
        start_step, log, tokens_done, seconds_done = meta["step"], meta["log"], meta["tokens"], meta["seconds"]
        window = meta["window"]
        _say(progress, f"train: resuming at step {start_step} of {total_steps} from {state_path}")
    else:
        start_step, log, tokens_done, seconds_done, window = 0, [], 0, 0.0, _new_window(ttt_steps)
    resumed_from = start_step

    if dist:  # after resuming: DDP starts every rank from rank 0's weights
        objective = data_parallel(objective, device)
    _say(
        progress,
        f"train: {len(samples)} samples in {steps_per_epoch} batches of <= {batch_tokens} tokens, {total_steps} steps "
        f"({train_cfg['epochs']} epochs), {ttt_steps} TTT steps, draft vocab {Vd}, device {device}"
        f"{', bf16 autocast' if use_bf16 else ', fp32'}, {attention} attention"
        + (", layer elementwise work compiled (train.compile)" if compiled is not None else "")
        + (f", {world} ranks" if world > 1 else "")
        + (f"; {truncated} samples truncated to {batch_tokens} tokens" if truncated else "")
        + (f"; {skipped} samples skipped (nothing to train)" if skipped else ""),
    )

    def save(step: int) -> None:
        _save_state(
            state_path, model, optimizer,
            {"run_id": run_id, "step": step, "log": log, "tokens": tokens_done, "seconds": seconds_done, "window": window},
        )

    last_save = time.perf_counter()
    compile_fallback = None  # {"step", "error"} of the first step whose pieces could not be compiled
    model.train()
    for step in range(start_step, total_steps):
        t0 = time.perf_counter()
        epoch, index = divmod(step, steps_per_epoch)
        refs, weight = rank_share(batches[_epoch_order(seed, epoch, steps_per_epoch)[index]], rank, world)
        batch = cache.batch(refs, device, dtype=frozen_dtype)
        batch["weight"] = weight
        lr = learning_rate(step, total_steps, float(train_cfg["learning_rate"]), float(train_cfg["warmup_ratio"]))
        for group in optimizer.param_groups:
            group["lr"] = lr
        result = train_step(
            objective, optimizer, batch, target_lm_head=target_lm_head, draft_ids=draft_ids_dev, t2d=t2d_dev,
            max_grad_norm=float(train_cfg["max_grad_norm"]), use_bf16=use_bf16,
        )
        del batch
        elapsed = time.perf_counter() - t0
        if compiled is not None and compiled.error is not None and compile_fallback is None:
            compile_fallback = {"step": step + 1, "error": compiled.error}
            _say(progress, f"train: train.compile failed in step {step + 1}; training goes on eagerly (the same training at eager speed): {compiled.error}")
        tokens_done += result["tokens"]
        seconds_done += elapsed
        window["total"] += result["loss"]
        window["n"] += 1
        window["tokens"] += result["tokens"]
        window["seconds"] += elapsed
        for j, (loss_j, correct, count) in enumerate(result["stats"]):
            if count:
                window["loss"][j] += loss_j
                window["steps_with"][j] += 1
            window["correct"][j] += correct
            window["count"][j] += count

        done = step + 1
        if done % int(train_cfg["log_every"]) == 0 or done == total_steps:
            entry = {
                "step": done,
                "epoch": done / steps_per_epoch,
                "lr": lr,
                "loss": window["total"] / window["n"],
                **_window_entry(window, ttt_steps),
                "tokens_per_second": window["tokens"] / max(window["seconds"], 1e-9),
            }
            if compiled is not None:  # False once compiling failed and the steps run eagerly
                entry["compiled"] = compiled.active
            log.append(entry)
            acc = ["n/a" if a is None else f"{a:.3f}" for a in entry["acc_per_step"]]
            _say(
                progress,
                f"step {done}: loss {entry['loss']:.4f}, acc@0 {acc[0]}, acc@{ttt_steps - 1} {acc[-1]}, "
                f"lr {lr:.2e}, tok/s {entry['tokens_per_second']:.0f}",
            )
            window = _new_window(ttt_steps)
        epoch_end = done % steps_per_epoch == 0 or done == total_steps
        if rank == 0 and (epoch_end or done % save_every_steps == 0 or time.perf_counter() - last_save >= save_every_seconds):
            save(done)
            last_save = time.perf_counter()
        if on_step is not None:
            on_step(done)

    # ---- the declared output, once
    metrics = _final_metrics(log, steps_per_epoch, ttt_steps)
    summary = {
        "steps": total_steps,
        "resumed_from_step": resumed_from,
        "epochs": float(train_cfg["epochs"]),
        "steps_per_epoch": steps_per_epoch,
        "samples": len(samples),
        "tokens": tokens_done,
        "seconds": seconds_done,
        "tokens_per_second": tokens_done / max(seconds_done, 1e-9),
        "final_accuracy_per_step": metrics.get("accuracy_per_step"),
        "final_loss_per_step": metrics.get("loss_per_step"),
        "final_loss": metrics.get("loss"),
        "draft_vocab_size": Vd,
        "ttt_steps": ttt_steps,
    }
    if compiled is not None:
        summary["compile"] = {"compiled": compiled.active, "fallback": compile_fallback}
    tensors = checkpoint_tensors(model, weight_dtype) if rank == 0 else None
    config = shape.sglang_config(torch_dtype=str(weight_dtype).removeprefix("torch."))
    config["eyrie"] = {
        "template_sha256": template_sha256,
        "target_fingerprint": target_fingerprint,
        "drafter": drafter_cfg,
        "train": train_cfg,
        "vocab": {k: vocab_manifest.get(k) for k in ("draft_vocab_size", "requested_draft_vocab_size", "coverage", "clipped") if k in vocab_manifest},
        "metrics": {**metrics, **{k: summary[k] for k in ("steps", "samples", "tokens", "seconds", "tokens_per_second", "compile") if k in summary}},
    }
    if rank == 0:
        _write_output(Path(out_dir), config, tensors, log)
        _say(progress, f"train: wrote {out_dir} ({total_steps} steps, {tokens_done} tokens, {summary['tokens_per_second']:.0f} tok/s)")
    if dist:
        # DDP's reducer holds the gloo group: freed with it, the group's destructor joins its worker threads
        # while holding the GIL that a worker needs to free its last tensors, and the rank hangs at exit
        # (3 runs in 10 of the two-rank test). Freed first, the group goes in destroy_process_group instead.
        del objective
        dist.close()
    return summary


# Keep NVLink multicast off in every rank: on shared multi-GPU hosts a program using it can take the GPUs down.
DISTRIBUTED_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def launch_data_parallel(train_kwargs: dict, processes: int, args_path: str | Path, log_path: str | Path | None = None) -> None:
    """train_drafter(**train_kwargs) in `processes` ranks under torchrun on this machine; raises if any rank fails.

    The keyword arguments go through a JSON file (args_path, kept beside the resume state) to
    `python -m eyrie.training.train`; the ranks' output is appended to log_path.
    """
    import subprocess

    args_path = Path(args_path)
    args_path.parent.mkdir(parents=True, exist_ok=True)
    args_path.write_text(json.dumps(train_kwargs, indent=1, default=str))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes), "-m", "eyrie.training.train", str(args_path)]
    env = {**os.environ, **DISTRIBUTED_ENV}
    with open(log_path, "a", encoding="utf-8") if log_path else open(os.devnull, "w") as log:
        done = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise TrainingInputError(
            f"data-parallel training ({processes} processes, torchrun) failed with exit code {done.returncode}"
            + (f"; the ranks' output is in {log_path}" if log_path else "")
            + "; finished steps are kept in the state directory, rerun to resume"
        )


def main(argv: list[str] | None = None) -> int:
    """`python -m eyrie.training.train ARGS.json`: train_drafter(**ARGS), the entry point for torchrun launches."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m eyrie.training.train ARGS.json  (keyword arguments of eyrie.training.train.train_drafter)", file=sys.stderr)
        return 2
    train_drafter(**json.loads(Path(argv[0]).read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
