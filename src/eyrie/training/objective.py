"""The training-time-test (TTT) forward and loss of the EAGLE-3 drafter, and one optimizer step.

Alignment (EAGLE-3). For a sample of tokens x_0..x_{n-1} with cached aux states a_t and final
normed states f_t (target logits at t = lm_head(f_t), predicting x_{t+1}):

    step 0, position t:  hidden g = fc(a_t) (project_aux), input token x_{t+1}, rotary position t,
                         target softmax(lm_head(f_{t+1})) -> predicts x_{t+2}
    step j, position t:  hidden = the drafter's own output of step j-1 at t (pre-norm; normed with drafter.norm_output),
                         input token x_{t+1+j}, rotary position t+j,
                         target softmax(lm_head(f_{t+1+j})) -> predicts x_{t+2+j}

Attention at step j: the query sees the step-0 keys at positions <= t (causal) and the keys of
steps 1..j at position t only (diagonal blocks). That is exactly what inference sees when it
chains j drafts after position t, so the training forward at every step equals ``decode``
(tested). A position is trained at step j when x_{t+2+j} exists, is an assistant token
(loss_mask) and the target's full-vocabulary argmax at t+1+j lies in the draft vocabulary.

Loss per step: soft cross-entropy against the target distribution restricted (renormalised) to
the draft vocabulary, optionally mixed with a one-hot on its argmax (train.hard_label_weight), and
optionally weighted inside stretches prompt lookup would have copied (train.copy_weight);
total = sum_j decay^j * loss_j.
"""

from __future__ import annotations

import contextlib

import torch

from eyrie.drafter.model import Eagle3Drafter
from eyrie.drafter.rms_norm import NormKernels, use_norm_kernels
from eyrie.drafter.pointwise import PointwiseKernels
from eyrie.training.copyable import COPY_MIN_RUN, copyable_positions
from eyrie.training.draft_loss import EAGER, LossChunks, chunked_soft_cross_entropy
from eyrie.training.optimizer import clipped_step
from eyrie.training.weight_grads import StepWeights, step_weights


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
    """The drafter's output of each TTT step (Eagle3Drafter.carried: pre-norm unless drafter.norm_output), aligned to the query position t.

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
    hidden = model.project_aux(aux)
    if compiled is None:  # step j rotates position t by t + j: one table for every step, sliced, not 7 computed
        # float32, as layer_inputs' own call makes them from its float32 x; it casts them to x's dtype
        cos_table, sin_table = model.rotary(aux.new_empty(0, dtype=torch.float32), torch.arange(Lp + steps - 1, device=aux.device)[None])
    blocks, keys, values, outs = [], [], [], []
    for j in range(steps):
        tokens = shift_left(input_ids, 1 + j)
        positions = (pos + j).unsqueeze(0).expand(B, Lp)
        if compiled is None:
            rotary = (cos_table[:, :, j : j + Lp], sin_table[:, :, j : j + Lp])  # (1, 1, Lp, hd): broadcast over rows and heads
            x, cos, sin = model.layer_inputs(hidden, tokens, positions, rotary)
            if compute_dtype is not None:  # one cast shared by q, k, v (autocast would keep three copies)
                x = x.to(compute_dtype)
        else:
            x, cos, sin = compiled.layer_inputs(model, hidden, tokens, positions, compute_dtype)
        if flex:
            from eyrie.training.ttt_attention import flex_ttt_attention

            if compiled is None:  # q, k rotated into v's dtype, the cast flex_ttt_attention makes
                q, k, v = attn.project(x, cos, sin, repeat_kv=False, qk_dtype=compute_dtype)
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


def positions_of(masks: list[torch.Tensor], device=None) -> list[torch.Tensor]:
    """Flat indices (b * L + t) of each bool mask's True positions, on device (default: the masks'), found on the host.

    Indexing with a bool mask syncs with the GPU each time (its result's size is data-dependent): with 7 TTT steps and
    three uses per step that was about 40 stalls per training step. Here the masks (S x B x L bools) are read on the
    host (host masks: no wait at all; device masks: one sync), the indices found there and sent without a wait.
    """
    stacked = torch.stack(masks).flatten(1)  # (S, B*L)
    host = stacked.cpu()
    counts = host.sum(1).tolist()
    flat = host.flatten().nonzero().squeeze(1) % host.shape[1]  # step-major, so split by counts
    return list(to_device(flat, stacked.device if device is None else device).split(counts))


def to_device(host: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on device; to CUDA from pinned memory, so the copy does not wait for the GPU."""
    if torch.device(device).type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


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
def target_distribution(final: torch.Tensor, needed: torch.Tensor, lm_head: torch.Tensor, draft_ids: torch.Tensor, t2d: torch.Tensor, chunk_rows: int | None = None,
                        hard_label_weight: float = 0.0, zero_outside: bool = False):
    """The target's view at the needed positions s of final [B, L, H] (needed: bool [B, L], or its flat indices, ascending).

    lm_head [V, H] is used in its own dtype (bf16 on CUDA: no float32 copy of a 128256 x 4096 head).

    Returns (probs [N, Vd] float32: softmax of the target logits gathered at draft_ids, i.e. the
    distribution renormalised over the draft vocab, one row per needed position; row [B, L]: the
    row of position s, -1 where not needed; arg [B, L]: draft id of the FULL-vocabulary argmax at
    s, -1 where it lies outside the draft vocab or s is not needed). The full-vocabulary logits
    exist one chunk of positions at a time, never [B*L, V] at once. hard_label_weight: the probs rows
    are the training labels mixed with a one-hot on that argmax (mix_hard_labels). zero_outside: the rows whose
    argmax lies outside the draft vocab are zeros (no loss or gradient where a step selects them anyway).
    """
    B, L, H = final.shape
    Vd = draft_ids.numel()
    # needed: a bool mask (one host sync here), or its flat indices (b * L + t) on final's device (none)
    needed_index = needed.flatten().nonzero().squeeze(1) if needed.dtype == torch.bool else needed
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
    mix_hard_labels(probs, draft_arg, hard_label_weight)
    if zero_outside:
        probs.mul_((draft_arg >= 0).to(probs.dtype)[:, None])
    row = torch.full((B * L,), -1, dtype=torch.long, device=final.device)
    row.index_copy_(0, needed_index, torch.arange(N, device=final.device))
    arg = torch.full((B * L,), -1, dtype=torch.long, device=final.device)
    arg.index_copy_(0, needed_index, draft_arg)
    return probs, row.view(B, L), arg.view(B, L)


def mix_hard_labels(probs: torch.Tensor, draft_arg: torch.Tensor, weight: float) -> torch.Tensor:
    """probs [N, Vd] -> (1 - weight) * probs + weight * one_hot(draft_arg), in place, on rows with draft_arg >= 0.

    Rows whose argmax lies outside the draft vocabulary are never trained (step_targets) and stay as they are.
    No host sync: the one-hot is a scatter of weight (0 on the skipped rows).
    """
    if weight <= 0:
        return probs
    has_arg = draft_arg >= 0
    probs.mul_(torch.where(has_arg, 1.0 - weight, 1.0).to(probs.dtype)[:, None])
    probs.scatter_add_(1, draft_arg.clamp(min=0)[:, None], (has_arg.to(probs.dtype) * weight)[:, None])
    return probs


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


def host_selected(j: int, needed: torch.Tensor, trained: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """bool [B, L]: the positions step j trains by every test of step_targets that the host can make, all but the
    target's argmax lying in the draft vocabulary (needed = needed_targets(trained, lengths), on the host)."""
    L = trained.shape[1]
    return ((torch.arange(L)[None, :] + 2 + j < lengths[:, None]) & shift_left(trained, 2 + j, False)
            & shift_left(needed, 1 + j, False))


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


def step_loss_sum(model: Eagle3Drafter, out: torch.Tensor, valid, row, arg, target_probs, chunked: bool = True, chunks=None,
                  weights: StepWeights | None = None):
    """(soft cross-entropy summed over step j's trained positions, #argmax hits); out = ttt_hidden's [n_j, H].

    chunked: eyrie.training.draft_loss (never keeps [n_j, Vd] logits for backward), its per-chunk work as
    chunks (a draft_loss.LossChunks; None: eager); otherwise the plain formula of ttt_loss (the reference).
    weights: the step's StepWeights (train.fused_weight_grads): the chunked loss reads the head's step copy in forward and
    sums its gradient in float32 there.
    """
    rows, args = pick_positions(row, valid), pick_positions(arg, valid)  # valid: bool [B, L] or flat indices
    if chunked:
        head, grad_sum = model.lm_head.weight, None
        if weights is not None:  # the head's copy serves forward only; its sum is float32 (eyrie.training.weight_grads)
            head, grad_sum = weights.weight(head, forward_only=True, float32_sum=True)
        return chunked_soft_cross_entropy(model.head_input(out), head, target_probs, rows, args, chunks=chunks or EAGER, grad_sum=grad_sum)
    logits = model.head(out)
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(target_probs[rows] * logp).sum(), (logits.argmax(-1) == args).sum()


class TTTObjective(torch.nn.Module):
    """The drafter's training loss as one module forward, so DistributedDataParallel can wrap it.

    compile (train.compile): the layer's elementwise work runs through torch.compile
    (eyrie.training.compiled_layers); self.compiled.error says why it fell back to eager, if it did.
    fused_loss (train.fused_loss): the chunked loss's elementwise work runs through torch.compile
    (eyrie.training.draft_loss.LossChunks); self.loss_chunks.error says why it fell back, if it did.
    fused_norms (train.fused_norms): the drafter's RMSNorms run their forward and backward math through torch.compile
    (eyrie.drafter.rms_norm.NormKernels); self.norm_kernels.error says why they fell back, if they did.
    fused_pointwise (train.fused_pointwise): the rotary on q and k and the MLP's SiLU * up likewise
    (eyrie.drafter.pointwise.PointwiseKernels).
    fused_weight_grads (train.fused_weight_grads settled, eyrie.training.weight_grads.settle): None, or "compute" or
    "float32": train_step runs each step through eyrie.training.weight_grads (the trained matrices cast once a step,
    their uses' gradients summed by the products; the layer's sums in the compute dtype or in float32).
    """

    def __init__(self, drafter: Eagle3Drafter, steps: int, decay: float, *, attention: str = "eager", chunked_loss: bool = True,
                 recompute_mlp: bool = False, compile: bool = False, hard_label_weight: float = 0.0, fused_loss: bool = False,
                 copy_weight: float = 1.0, prompt_label_weight: float = 0.0, fused_weight_grads: str | None = None,
                 fused_norms: bool = False, fused_pointwise: bool = False, stacked_products: bool = True):
        super().__init__()
        self.loss_chunks = LossChunks(fused=fused_loss and chunked_loss)
        self.norm_kernels = NormKernels(fused=fused_norms)
        if fused_norms:
            use_norm_kernels(drafter, self.norm_kernels)
        self.pointwise_kernels = PointwiseKernels(fused=fused_pointwise)
        drafter.midlayer.self_attn.pointwise_kernels = drafter.midlayer.mlp.pointwise_kernels = self.pointwise_kernels
        if fused_weight_grads not in (None, "compute", "float32"):
            raise ValueError(f"fused_weight_grads is {fused_weight_grads!r}; expected None, 'compute' or 'float32' (weight_grads.settle)")
        self.fused_weight_grads = fused_weight_grads
        self.stacked_products = stacked_products  # with fused_weight_grads: q, k, v as one product (weight_grads.step_weights)
        self.step_weights: StepWeights | None = None  # set while train_step runs a step with fused_weight_grads
        self.drafter = drafter
        self.steps, self.decay = steps, decay
        self.hard_label_weight = hard_label_weight  # train_step's labels: eyrie.training.objective.mix_hard_labels
        self.copy_weight = copy_weight  # train_step's labels: eyrie.training.objective.weight_copyable_labels
        self.prompt_label_weight = prompt_label_weight  # train_step's tokens: trained_tokens, weight_prompt_labels
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
        weight = world size makes the update that of the whole batch on one rank. targets[j]: step j's (selected
        positions as flat indices, row [B, L], arg [B, L], count: its trained positions of these rows), train_step's.
        """
        model = self.drafter
        outs = ttt_hidden(model, aux, input_ids, lengths, self.steps, select=[t[0] for t in targets],
                          attention=self.attention, recompute_mlp=self.recompute_mlp, compiled=self.compiled)
        loss, stats = 0.0, []
        for j, (out, (selected, row, arg, count)) in enumerate(zip(outs, targets)):
            loss_sum, correct = step_loss_sum(model, out, selected, row, arg, target_probs, self.chunked_loss, self.loss_chunks, self.step_weights)
            loss = loss + (self.decay**j) * loss_sum / counts[j].clamp(min=1).to(loss_sum.dtype)
            stats.append(torch.stack([loss_sum.detach().double(), correct.double(), count.double()]))
        if self.step_weights is not None:
            self.step_weights.end_forward()
        return loss * weight, torch.stack(stats)

    @contextlib.contextmanager
    def weights_for_step(self, compute_dtype: torch.dtype):
        """One step's forward and backward: with fused_weight_grads through a StepWeights in compute_dtype, else as they are."""
        if self.fused_weight_grads is None:
            yield
            return
        with step_weights(self.drafter, compute_dtype, float32_sums=self.fused_weight_grads == "float32", stacked=self.stacked_products) as weights:
            self.step_weights = weights
            try:
                yield
            finally:
                self.step_weights = None


def weight_copyable_labels(probs: torch.Tensor, row: torch.Tensor, input_ids: torch.Tensor, lengths: torch.Tensor, vocab_size: int,
                           weight: float) -> torch.Tensor:
    """probs [N, Vd] with the rows of copied labels times weight, in place; no host sync. A label is copied where prompt
    lookup would have COPY_MIN_RUN drafts accepted from its position on (eyrie.training.copyable): the stretches
    training's copy slice measures.

    The soft cross-entropy of a row is sum(p) * logsumexp(z) - sum(p * z), so a row scaled by w adds w times its
    loss and its gradient: the label weighs w in every TTT step that predicts it, and the argmax (accuracy) is unchanged.
    """
    if weight == 1.0:
        return probs
    return scale_label_rows(probs, row, copyable_positions(input_ids, lengths, vocab_size, COPY_MIN_RUN), weight)


def scale_label_rows(probs: torch.Tensor, row: torch.Tensor, chosen: torch.Tensor, weight: float) -> torch.Tensor:
    """probs [N, Vd] with the rows of the chosen positions ([B, L] bool; row: each position's row, -1 for none) times
    weight, in place, without a host sync."""
    N = probs.shape[0]
    scale = torch.ones(N + 1, dtype=probs.dtype, device=probs.device)  # the last entry takes every position not chosen
    scale.scatter_(0, torch.where(chosen & (row >= 0), row, N).flatten(), weight)
    return probs.mul_(scale[:N, None])


def trained_tokens(loss_mask: torch.Tensor, lengths: torch.Tensor, prompt_label_weight: float) -> torch.Tensor:
    """bool [B, L]: the tokens training predicts. The replies' (loss_mask); with prompt_label_weight > 0 every token
    of the sample, the prompts' too, whose labels are the target's own distributions there as well. The held-out
    simulation keeps loss_mask: acceptance is what drafting replies gives."""
    if prompt_label_weight <= 0:
        return loss_mask
    return torch.arange(loss_mask.shape[1], device=loss_mask.device)[None, :] < lengths[:, None]


def weight_prompt_labels(probs: torch.Tensor, row: torch.Tensor, loss_mask: torch.Tensor, weight: float) -> torch.Tensor:
    """probs [N, Vd] with the rows whose label is a prompt token's times weight, in place; no host sync. Row s holds the
    target's distribution for token s + 1, a prompt token where loss_mask[s + 1] is False. As in weight_copyable_labels,
    a row scaled by w weighs w in the loss of every TTT step that predicts it."""
    if weight <= 0 or weight == 1.0:
        return probs
    return scale_label_rows(probs, row, ~shift_left(loss_mask, 1, True), weight)


def train_step(objective, optimizer, batch: dict, *, target_lm_head, draft_ids, t2d, max_grad_norm: float, use_bf16: bool) -> dict:
    """One optimizer step on this rank's rows of the step's batch; the same code on one rank or many.

    objective: a TTTObjective, or DistributedDataParallel around one (then batch["weight"] is the
    world size, 0 for a rank without rows that runs a stand-in row to keep the collectives going).
    Returns the step's figures over all ranks: loss (sum_j decay^j * mean loss of step j), stats
    [(loss_j, correct_j, count_j)], tokens, and grad_norm (the gradients' total norm before clipping, the
    same on every rank). The caller stops on a non-finite loss or grad_norm (eyrie.training.train); both
    arrive in the step's one host read, so checking them costs no extra sync.
    """
    inner = objective.module if isinstance(objective, torch.nn.parallel.DistributedDataParallel) else objective
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    steps, decay = inner.steps, inner.decay
    weight = float(batch.get("weight", 1.0))
    lengths, loss_mask = batch["lengths"], batch["loss_mask"]
    device = loss_mask.device
    # Which positions are needed and which each step trains, worked out on the host copies (the loader keeps them; else
    # one sync here): the indices go to the GPU without a wait. Whether the target's argmax at a position lies in the
    # draft vocabulary is known on the GPU only, so each step selects the positions that pass every other test, and
    # the label rows of positions whose argmax lies outside are zeroed: they add nothing to a loss, a gradient or a count.
    host_mask, host_lengths = batch.get("loss_mask_host"), batch.get("lengths_host")
    if host_mask is None or host_lengths is None:
        host_mask, host_lengths = loss_mask.cpu(), lengths.cpu()
    host_trained = trained_tokens(host_mask, host_lengths, inner.prompt_label_weight)
    host_needed = needed_targets(host_trained, host_lengths)
    needed_index = to_device(host_needed.flatten().nonzero().squeeze(1), device)
    trained = trained_tokens(loss_mask, lengths, inner.prompt_label_weight)
    target_probs, target_row, target_arg = target_distribution(batch["final"], needed_index, target_lm_head, draft_ids, t2d,
                                                               hard_label_weight=inner.hard_label_weight, zero_outside=True)
    weight_copyable_labels(target_probs, target_row, batch["input_ids"], lengths, target_lm_head.shape[0], inner.copy_weight)
    weight_prompt_labels(target_probs, target_row, loss_mask, inner.prompt_label_weight)
    targets = [step_targets(j, target_row, target_arg, trained, lengths) for j in range(steps)]
    trained_counts = torch.stack([t[0].sum() for t in targets]).double()  # this rank's, argmax test included
    counts = trained_counts * (weight != 0)
    if distributed:
        torch.distributed.all_reduce(counts)
    selected = positions_of([host_selected(j, host_needed, host_trained, host_lengths) for j in range(steps)], device)
    targets = [(index, row, arg, count) for index, (_, row, arg), count in zip(selected, targets, trained_counts)]
    device_type = batch["aux"].device.type
    with inner.weights_for_step(torch.bfloat16 if use_bf16 else torch.float32):  # train.fused_weight_grads, through backward
        with torch.autocast(device_type=device_type, dtype=torch.bfloat16, enabled=use_bf16):
            loss, stats = objective(batch["aux"], batch["input_ids"], lengths, targets, target_probs, counts, weight)
        optimizer.zero_grad(set_to_none=True)  # every .grad None: backward's sums become the gradients without a copy
        loss.backward()
    params = [p for p in inner.parameters() if p.requires_grad]
    grad_norm = clipped_step(optimizer, params, max_grad_norm)  # a device tensor: no sync
    totals = torch.cat([stats.flatten() * (weight != 0), stats.new_full((1,), float(batch["tokens"]) * (weight != 0))])
    if distributed:
        torch.distributed.all_reduce(totals)
    totals = torch.cat([totals, grad_norm.detach().reshape(1).to(totals)])  # after the all-reduce: DDP made it equal on every rank
    totals = totals.tolist()  # the step's one host sync
    per_step = [(totals[3 * j], int(totals[3 * j + 1]), int(totals[3 * j + 2])) for j in range(steps)]
    means = [(loss_sum / count if count else 0.0, correct, count) for loss_sum, correct, count in per_step]
    return {"loss": sum(decay**j * m[0] for j, m in enumerate(means) if m[2]), "stats": means, "tokens": int(totals[-2]),
            "grad_norm": totals[-1]}
