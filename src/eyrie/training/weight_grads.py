"""train.fused_weight_grads: each trained matrix cast once a step, its uses' gradients summed by the products themselves.

A trained matrix W (float32: AdamW's master weight) is used once per TTT step: q/k/v/o and gate/up/down 7 times a
step at 7 TTT steps, the draft head lm_head through the chunked loss 7 times, fc once. Under bf16 autocast plain
autograd does, each step:

    the layer's matrices   autocast's cached bf16 copy of W; each use's weight gradient a bf16 product; the uses'
                           gradients summed in bf16 in autograd's input buffer (6 adds), then cast to float32 into W.grad
    the draft head         cast to bf16 twice per TTT step (the loss's forward and backward); per TTT step a zeroed
                           float32 gradient, a bf16 product and an add per chunk of rows, then added into W.grad (6 adds)

At the Llama-3.1-8B drafter shape on an H200 those adds were the step's in-place adds (11% of its kernel time) and
the casts part of its dtype copies (9%; docs/RESULTS.md, the step's profile). Here, Megatron's gradient-accumulation
fusion in plain torch:

    W16 = W.to(bf16)                  once a step, at its first use (StepWeights.weight)
    y   = x16 @ W16.T                 each use; an input used by two products (gate and up) is cast once
    dW += dy.T @ x16                  each use's backward: one product that reads and writes the sum, accumulating
                                      in float32 inside the product (cuBLAS's beta = 1); no separate add
    W.grad = dW                       once every use's backward has run, through autograd (W's AccumulateGrad, which
                                      takes a float32 sum as it is), so DistributedDataParallel all-reduces it as any gradient

The sums (GradSum): the draft head's in float32 (one product per chunk of rows writes float32:
torch.addmm(..., out_dtype=torch.float32) on CUDA), replacing plain autograd's float32 gradient per TTT step and its
adds; the layer's and fc's in the compute dtype, one rounding per use where plain autograd rounds twice (the product,
then the bf16 add), cast to float32 at the end as plain autograd casts its sum. Each sum is the size of what plain
autograd holds at the same time (its bf16 input buffer, its float32 head gradient), so backward holds no more.
float32_sums (train.fused_weight_grads: float32) sums the layer's in float32 too, Megatron's main_grad: no bf16
rounding of the sum, at 4 bytes a weight from the first use's backward on where plain autograd's bf16 sum holds 2
(243M weights at the Llama-3.1-8B drafter shape: 0.49 GB more). The draft head's copy serves the forward's 7 uses
and is dropped when the forward ends. Its uses' backwards run one after another at the start of backward (the losses
come after every TTT step's layer): the first casts the head again (GradSum.weight_for_backward), the others reuse that
cast, and the last drops it, so that no copy is held through the layer's backward and the head is cast once in backward,
not once per TTT step as plain autograd does (7 casts of 131M weights at the Llama-3.1-8B drafter shape).

The attention's q, k and v read one input x (DraftAttention.shared_input_linears): they run as one product over a stacked
step copy [q_out + k_out + v_out, in] of their matrices, its output split into q, k and v (StepWeights.stacked_linear).
At the Llama-3.1-8B drafter shape k's and v's products (1024 wide) tile the GPU poorly and their backwards add three
gradients of x; stacked (6144 wide), x is read once, x's gradient is one product, and each use's weight gradient one
product into one sum, which the stacked copy's backward splits by rows among the three matrices (_StackedStepCopy).
Checkpoints are unchanged: q_proj, k_proj and v_proj stay separate parameters, stacked only in the step copy.

The products are plain autograd's; W, AdamW and its float32 state are unchanged. Plain autograd and this path agree to
bf16 rounding under autocast and to float32 rounding in float32 (tests/training/test_weight_grads.py).
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch
import torch.nn.functional as F
from torch import nn

SETTINGS = ("auto", True, False, "float32")  # train.fused_weight_grads

# Whether torch.mm and torch.addmm(out=) take out_dtype=torch.float32 for bf16 inputs here (CUDA, torch >= 2.8), and give
# their float32 products: None until probed at the first such product (_probe).
_FLOAT32_PRODUCTS: dict[str, bool | None] = {"work": None}
fallback_reason: str | None = None  # why float32 sums of bf16 products go through float32 copies on CUDA, once they do


def settle(setting, device) -> str | None:
    """train.fused_weight_grads for a device: None (plain autograd), "compute" (the layer's sums in the compute dtype)
    or "float32". auto: "compute" on CUDA, plain autograd elsewhere (a CPU trains in float32 by default)."""
    if setting not in SETTINGS:
        raise ValueError(f"train.fused_weight_grads is {setting!r}, expected one of auto, true, false, float32")
    if setting == "float32":
        return "float32"
    return "compute" if setting is True or (setting == "auto" and torch.device(device).type == "cuda") else None


def _probe(device: torch.device) -> str | None:
    """None if out_dtype=float32 products of bf16 inputs run here and equal float64's (the first product writing the sum,
    the next one adding into it in place, the first input transposed as a use's output gradient is), else why not."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(24, 8, generator=g, device=device).bfloat16().T
    b = torch.randn(24, 16, generator=g, device=device).bfloat16()
    try:
        total = torch.mm(a, b, out_dtype=torch.float32)
        torch.addmm(total, a, b, out_dtype=torch.float32, out=total)
    except (TypeError, RuntimeError, NotImplementedError) as exc:  # older torch, or no kernel
        return f"torch.mm / torch.addmm(..., out_dtype=torch.float32): {type(exc).__name__}: {exc}".strip()[:500]
    if total.dtype != torch.float32 or not torch.allclose(total.double(), 2 * (a.double() @ b.double()), rtol=1e-5, atol=1e-4):
        return "torch.mm / torch.addmm(..., out_dtype=torch.float32) gave other values than float64's products"
    return None


def _float32_products_work(device: torch.device) -> bool:
    global fallback_reason
    if _FLOAT32_PRODUCTS["work"] is None:
        fallback_reason = _probe(device)
        _FLOAT32_PRODUCTS["work"] = fallback_reason is None
        if fallback_reason is not None:
            warnings.warn(f"train.fused_weight_grads: {fallback_reason}; float32 gradient sums go through float32 copies "
                          "(the same sums, slower)", RuntimeWarning, stacklevel=4)
    return bool(_FLOAT32_PRODUCTS["work"])


def add_float32_product(total: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """total + a @ b in float32 (a @ b where total is None), a and b in any one dtype; total is updated in place.

    bf16 inputs on CUDA: one product writes float32 (out_dtype; probed once). Elsewhere, or where this torch lacks it,
    the same sum (the inputs' exact products accumulated in float32) from float32 copies of a and b.
    """
    if a.dtype != torch.float32 and a.is_cuda and _float32_products_work(a.device):
        if total is None:
            return torch.mm(a, b, out_dtype=torch.float32)
        return torch.addmm(total, a, b, out_dtype=torch.float32, out=total)
    a, b = a.float(), b.float()
    return torch.mm(a, b) if total is None else total.addmm_(a, b)


class GradSum:
    """One trained matrix's weight gradient, summed over a step's uses in dtype, and the matrix it goes to (None for a
    stacked copy's sum: _StackedStepCopy splits it among its matrices; weight_for_backward is for single matrices).

    For uses that recast the matrix in their backward (the chunked loss: its forward-only step copy is not kept), a
    cast shared by those backwards: made by the first, dropped after the last (each use registers in its forward).
    """

    __slots__ = ("dtype", "weight", "total", "backward_copy", "pending_backwards")

    def __init__(self, dtype: torch.dtype, weight: torch.Tensor | None):
        self.dtype, self.weight = dtype, weight
        self.total: torch.Tensor | None = None
        self.backward_copy: torch.Tensor | None = None
        self.pending_backwards = 0

    def expect_backward(self) -> None:
        """A use (in its forward) that will call weight_for_backward and backward_done in its backward."""
        self.pending_backwards += 1

    def weight_for_backward(self, dtype: torch.dtype) -> torch.Tensor:
        """The matrix in dtype for a use's backward: cast by the first such backward, the same tensor for the others."""
        if self.backward_copy is None or self.backward_copy.dtype != dtype:
            self.backward_copy = self.weight.detach().to(dtype)
        return self.backward_copy

    def backward_done(self) -> None:
        """A use's backward has finished with weight_for_backward; after the last, the cast is dropped."""
        self.pending_backwards -= 1
        if self.pending_backwards <= 0:
            self.pending_backwards, self.backward_copy = 0, None

    def add(self, grad_out: torch.Tensor, inputs: torch.Tensor) -> None:
        """total += grad_out.T @ inputs: grad_out [n, out], inputs [n, in] (a use's output gradient and input rows)."""
        a = grad_out.T
        if self.dtype == torch.float32:
            self.total = add_float32_product(self.total, a, inputs)
        else:  # the inputs' dtype: one product accumulating in float32, rounded once into the sum (cuBLAS beta = 1)
            self.total = torch.mm(a, inputs) if self.total is None else self.total.addmm_(a, inputs)

    def take(self) -> torch.Tensor | None:
        """The sum, no longer held here: AccumulateGrad keeps a tensor nothing else holds as .grad without copying it."""
        total, self.total = self.total, None
        return total


class _StepCopy(torch.autograd.Function):
    """The step's copy of a trained matrix in the compute dtype. Its backward runs after every use's (they all feed it)
    and gives the matrix the sum they wrote; the uses return no gradient for the copy itself."""

    @staticmethod
    def forward(ctx, weight, dtype, grad_sum):
        ctx.set_materialize_grads(False)  # the uses' gradients arrive as None, not as zero-filled matrices
        ctx.grad_sum = grad_sum
        return weight.to(dtype) if weight.dtype != dtype else weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad_copy):
        total = ctx.grad_sum.take()
        if grad_copy is not None:  # a use through plain autograd (outside StepWeights.linear and the chunked loss)
            total = grad_copy if total is None else total.add_(grad_copy.to(total.dtype))
        weight = ctx.grad_sum.weight
        if total is None:  # no rows this step: zeros, as plain autograd gives, so that every rank's gradient arrives
            return torch.zeros_like(weight), None, None
        return total.to(weight.dtype), None, None  # a float32 sum is taken as it is


class _StackedStepCopy(torch.autograd.Function):
    """The step's copy of matrices with one input width, stacked by rows in the compute dtype (one product serves them
    all: StepWeights.stacked_linear). Its backward splits the sum its uses wrote by rows, as _StepCopy gives one."""

    @staticmethod
    def forward(ctx, dtype, grad_sum, *weights):
        ctx.set_materialize_grads(False)
        ctx.grad_sum, ctx.weights = grad_sum, weights
        ctx.rows = [weight.shape[0] for weight in weights]
        stacked = weights[0].new_empty(sum(ctx.rows), weights[0].shape[1], dtype=dtype)
        for rows, weight in zip(stacked.split(ctx.rows), weights):
            rows.copy_(weight)  # cast as it is copied in: no stacked copy in the weights' dtype
        return stacked

    @staticmethod
    def backward(ctx, grad_copy):
        total = ctx.grad_sum.take()
        if grad_copy is not None:  # a use through plain autograd
            total = grad_copy if total is None else total.add_(grad_copy.to(total.dtype))
        if total is None:  # zeros, as _StepCopy gives
            return None, None, *(torch.zeros_like(weight) for weight in ctx.weights)
        # row slices of the sum: a float32 sum's become the gradients as they are (contiguous views of one tensor)
        return None, None, *(rows.to(weight.dtype) for rows, weight in zip(total.split(ctx.rows), ctx.weights))


class _Linear(torch.autograd.Function):
    """x @ weight.T for one use of a step copy; backward returns x's gradient and adds the weight's to its sum."""

    @staticmethod
    def forward(ctx, x, weight, grad_sum):
        ctx.save_for_backward(x, weight)
        ctx.grad_sum = grad_sum
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        ctx.grad_sum.add(grad_out.reshape(-1, grad_out.shape[-1]), x.reshape(-1, x.shape[-1]))
        grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None
        return grad_x, None, None


class StepWeights:
    """One training step's copies of the trained matrices in the compute dtype, and their gradient sums.

    Lives for one step's forward and backward (step_weights); MLP recompute (train.recompute_mlp) runs its forward
    again inside backward and finds the same copies here. float32_sums: every sum in float32 (module docstring).
    """

    def __init__(self, dtype: torch.dtype, float32_sums: bool = False):
        self.dtype = dtype
        self.sum_dtype = torch.float32 if float32_sums else dtype
        # id(weight), or the ids of a stacked copy's weights -> [weight(s), copy (None once dropped), GradSum, kept through backward]
        self._copies: dict[int | tuple[int, ...], list] = {}
        self._last_input: tuple[torch.Tensor, int, torch.Tensor] | None = None  # (x, x's version, x in dtype)

    def weight(self, weight: torch.Tensor, *, forward_only: bool = False, float32_sum: bool = False) -> tuple[torch.Tensor, GradSum]:
        """(this step's copy of weight, the sum its uses' gradients go to), the copy made at the first call.

        forward_only: the copy is dropped when the forward ends (end_forward); the uses recast GradSum.weight in their
        backward. float32_sum: this weight's sum in float32 whatever the others' dtype.
        """
        entry = self._copies.get(id(weight))
        if entry is None:
            grad_sum = GradSum(torch.float32 if float32_sum else self.sum_dtype, weight)
            entry = self._copies[id(weight)] = [weight, _StepCopy.apply(weight, self.dtype, grad_sum), grad_sum, not forward_only]
        if entry[1] is None:
            raise RuntimeError("a forward-only step copy was asked for after the forward ended (StepWeights.end_forward)")
        return entry[1], entry[2]

    def stacked_weight(self, weights: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, GradSum]:
        """(this step's copy of weights stacked by rows, the sum its uses' gradients go to), made at the first call."""
        key = tuple(id(weight) for weight in weights)
        entry = self._copies.get(key)
        if entry is None:
            grad_sum = GradSum(self.sum_dtype, None)
            entry = self._copies[key] = [weights, _StackedStepCopy.apply(self.dtype, grad_sum, *weights), grad_sum, True]
        return entry[1], entry[2]

    def input(self, x: torch.Tensor) -> torch.Tensor:
        """x in the compute dtype; the previous product's cast again when it had the same input (gate, then up)."""
        last = self._last_input
        if last is not None and last[0] is x and last[1] == x._version:
            return last[2]
        cast = x.to(self.dtype)
        self._last_input = (x, x._version, cast)
        return cast

    def linear(self, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """module(x) through the step copy of module.weight."""
        weight, grad_sum = self.weight(module.weight)
        return _Linear.apply(self.input(x), weight, grad_sum)

    def stacked_linear(self, modules, x: torch.Tensor) -> list[torch.Tensor]:
        """[m(x) for m in modules] as one product over the step's stacked copy of their weights, split by the modules'
        widths (views of the product). Modules that are not all trained bias-free linears run as they are."""
        if not all(is_trained_linear(m) for m in modules):
            return [m(x) for m in modules]
        weights = tuple(m.weight for m in modules)
        stacked, grad_sum = self.stacked_weight(weights)
        product = _Linear.apply(self.input(x), stacked, grad_sum)
        return list(product.split([weight.shape[0] for weight in weights], dim=-1))

    def end_forward(self) -> None:
        """Drop the forward-only copies and the last input kept for a next product (autograd keeps what backward needs)."""
        self._last_input = None
        for entry in self._copies.values():
            if not entry[3]:
                entry[1] = None


def is_trained_linear(module: nn.Module) -> bool:
    """A linear whose weight is trained, bias-free (the drafter has no biases): what a step copy stands in for."""
    return isinstance(module, nn.Linear) and module.weight.requires_grad and module.bias is None


def trained_linears(model: nn.Module) -> list[nn.Linear]:
    """The model's trained linears (is_trained_linear)."""
    return [m for m in model.modules() if is_trained_linear(m)]


@contextlib.contextmanager
def step_weights(model: nn.Module, dtype: torch.dtype, float32_sums: bool = False, stacked: bool = True):
    """For one step's forward and backward: every trained linear of model runs through a StepWeights (yielded; the
    chunked loss takes the draft head's copy from it). stacked: the modules with shared_input_linears (the attention's
    q, k, v) run them as one product over a stacked copy (StepWeights.stacked_linear). All are their own again on leaving."""
    step = StepWeights(dtype, float32_sums)
    linears = trained_linears(model)
    sharing = [m for m in model.modules() if hasattr(m, "shared_input_linears")] if stacked else []
    for module in linears:
        module.forward = functools.partial(step.linear, module)  # the instance attribute shadows nn.Linear.forward
    for module in sharing:
        module.shared_input_linears = step.stacked_linear  # shadows the class's one product per linear
    try:
        yield step
    finally:
        for module in linears:
            del module.forward
        for module in sharing:
            del module.shared_input_linears
