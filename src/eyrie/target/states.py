"""The target's states a drafter trains on, for a batch of token sequences: one implementation, shared by the
extract job (eyrie.hidden.extract, which caches them) and online training (eyrie.training.online, which does not).

Per real token: the aux states, the outputs of the decoder layers behind the capture indices
(eyrie.target.aux_layers) concatenated [3H]; and the final state, the decoder stack's output after its
final norm, which is what the LM head reads [H]. Batches come right-padded with no attention mask: under
the causal mask a real token never sees the padding after it, and leaving the mask out lets SDPA take its
causal (flash) kernels. Forward hooks keep only the capture layers' outputs, so a forward holds three
states instead of all num_layers + 1. The caller picks the grad mode (inference_mode to cache, no_grad
when the states feed a backward).
"""

from __future__ import annotations

from eyrie.core.errors import EyrieError
from eyrie.target import family


def text_config(model):
    """The model's transformers config (its text part, for multimodal targets)."""
    return family.text_config(model.config)


def _base_model(model):
    """The decoder stack without the LM head (no full-vocabulary logits are ever computed)."""
    base = getattr(model, "model", None)
    if base is None:
        base = model.base_model
    return base


def _decoder_layers(base, num_layers: int):
    """The decoder layers to hook, or None when the model does not expose them as base.layers."""
    layers = getattr(base, "layers", None)
    if layers is None or len(layers) != num_layers:
        return None
    return layers


class _CaptureLayers:
    """Forward hooks that keep the outputs of the layers behind the capture indices (output_hidden_states[c] is
    the output of decoder layer c - 1), so the forward holds three states instead of all num_layers + 1."""

    def __init__(self, layers, capture: list[int], error: type[Exception]):
        self.layers, self.capture, self.error, self.outputs, self.handles = layers, capture, error, {}, []

    def __enter__(self):
        for c in self.capture:
            self.handles.append(self.layers[c - 1].register_forward_hook(self._keep(c)))
        return self

    def _keep(self, c: int):
        def hook(module, args, output):
            self.outputs[c] = output[0] if isinstance(output, tuple) else output

        return hook

    def take(self) -> list:
        states = [self.outputs.pop(c, None) for c in self.capture]
        if any(s is None for s in states):
            raise self.error(f"the capture hooks saw no output for capture indices {self.capture}; the target's decoder layers were not called")
        return states

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.outputs.clear()


class TargetStates:
    """The aux and final states of right-padded batches; hooks on the capture layers while open (a `with` block).

    error: the caller's stage error, raised when the model's layers cannot be mapped to the capture indices.
    """

    def __init__(self, model, capture: list[int], error: type[Exception] = EyrieError):
        config = text_config(model)
        self.num_layers, self.hidden = int(config.num_hidden_layers), int(config.hidden_size)
        self.capture, self.error = list(capture), error
        self.base = _base_model(model)
        self.layers = _decoder_layers(self.base, self.num_layers)
        self.hooks = _CaptureLayers(self.layers or [], self.capture if self.layers else [], error)

    def __enter__(self):
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.hooks.__exit__(*exc)

    def states(self, input_ids, keep):
        """(aux [n, 3H], final [n, H]) of the real tokens, in the model's dtype on its device.

        input_ids: (B, L) right-padded token ids on the model's device; keep: the flat (B*L) positions of the
        n real tokens, on the same device (only they are gathered: padding rows never leave the forward).
        """
        import torch

        out = self.base(input_ids=input_ids, output_hidden_states=self.layers is None, use_cache=False, return_dict=True)
        if self.layers is None:
            if len(out.hidden_states) != self.num_layers + 1:
                raise self.error(
                    f"the target returned {len(out.hidden_states)} hidden states, expected {self.num_layers + 1} "
                    "(embeddings + one per decoder layer); cannot map aux layer ids"
                )
            states = [out.hidden_states[c] for c in self.capture]
        else:
            states = self.hooks.take()
        # Gathered by index (no host sync); last_hidden_state is the stack's output after its final norm.
        aux = torch.cat([s.reshape(-1, self.hidden).index_select(0, keep) for s in states], dim=-1)  # (n, 3H)
        final = out.last_hidden_state.reshape(-1, self.hidden).index_select(0, keep)  # (n, H)
        return aux, final
