"""The floor a decode engine is measured against: a minimal static-cache Llama greedy step, fused and graphed.

One step is embed, 30 x (norm, q/k/v, rotary, cache write, SDPA over the whole cache, o, norm, MLP), norm, head,
argmax, written out with nothing else (no aux capture, no spans, no drafter buffers) and, with compile, fused by
inductor (in `mode`: the benchmark's floor is autotuned on CUDA) and captured as one CUDA graph. The benchmark times it beside the static decoder's greedy on the same
weights and prompt (bench.floor); benchmarks/decode_floor.py compares every decoder with it.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from eyrie.decoding.graphs import Replay
from eyrie.decoding.static_common import fused


class FloorDecoder:
    """Greedy decoding of a Llama (HF weights, used in place) on a static cache: the lean engine to compare with."""

    def __init__(self, model, capacity: int, compile: bool, graphs: bool, mode: str = "default"):
        inner, config = model.model, model.config
        self.model, self.layers = model, list(inner.layers)
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.hidden_size // self.heads
        device, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
        shape = (len(self.layers), 1, self.kv_heads, capacity, self.head_dim)
        self.keys, self.values = torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype)
        self.slots = torch.arange(capacity, device=device)
        cos, sin = inner.rotary_emb(torch.zeros(1, device=device, dtype=dtype), self.slots[None])
        self.cos, self.sin = cos[0], sin[0]
        self.token = torch.zeros(1, 1, dtype=torch.long, device=device)
        self.position = torch.zeros(1, dtype=torch.long, device=device)
        step = fused(self._step, mode) if compile else self._step
        self.failures: list[str] = []
        with torch.inference_mode():  # capture and compile without autograd, as the decode runs
            self.replay = Replay(step, graphs, self.failures)

    @staticmethod
    def _rotate(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def _step(self) -> None:
        x = self.model.model.embed_tokens(self.token)  # (1, 1, H)
        cos, sin = self.cos[self.position][None, None], self.sin[self.position][None, None]
        visible = (self.slots <= self.position)[None, None, None]  # (1, 1, 1, capacity)
        for i, layer in enumerate(self.layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = a.q_proj(h).view(1, 1, self.heads, self.head_dim).transpose(1, 2)
            k = a.k_proj(h).view(1, 1, self.kv_heads, self.head_dim).transpose(1, 2)
            v = a.v_proj(h).view(1, 1, self.kv_heads, self.head_dim).transpose(1, 2)
            q, k = q * cos + self._rotate(q) * sin, k * cos + self._rotate(k) * sin
            self.keys[i].index_copy_(2, self.position, k)
            self.values[i].index_copy_(2, self.position, v)
            out = F.scaled_dot_product_attention(q, self.keys[i], self.values[i], attn_mask=visible, enable_gqa=True)
            x = x + a.o_proj(out.transpose(1, 2).reshape(1, 1, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        self.token.copy_(self.model.lm_head(self.model.model.norm(x)).argmax(-1))
        self.position.add_(1)

    @torch.inference_mode()
    def decode(self, prompt_ids: list[int], new_tokens: int) -> tuple[list[int], float]:
        """(tokens, seconds of the decode steps): the prompt is fed token by token through the same step (untimed)."""
        self.position.zero_()
        for token in prompt_ids:
            self.token.fill_(token)
            self.replay()
        tokens = [int(self.token)]
        sync = torch.cuda.synchronize if self.token.is_cuda else (lambda: None)
        sync()
        start = time.perf_counter()
        for _ in range(new_tokens - 1):
            self.replay()
            tokens.append(self.token)  # tensors: no host sync inside the timed loop
        sync()
        seconds = time.perf_counter() - start
        return [int(t) for t in tokens], seconds
