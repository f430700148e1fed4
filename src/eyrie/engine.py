"""The in-process regeneration engine: the target model under transformers, batched by tokens."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from eyrie.batching import batches_by_tokens
from eyrie.chat import render


@dataclass
class TurnResult:
    reply: str
    finish_reason: str  # "stop" (end-of-turn token), "length" (hit max_new_tokens)
    prompt_tokens: int
    completion_tokens: int


def plan_batches(lengths: list[int], max_new_tokens: int, max_batch_tokens: int, max_batch_size: int) -> list[list[int]]:
    """Request indices in batches of at most max_batch_tokens padded (prompt + new) tokens."""
    return batches_by_tokens(lengths, max_batch_tokens, extra=max_new_tokens, max_size=max_batch_size)


def stable_seed(*parts) -> int:
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:4], "little")


class TransformersEngine:
    """Generates one assistant turn for many conversations at once, left-padded."""

    def __init__(self, model_dir: str, dtype: str = "auto", device: str = "auto", trust_remote_code: bool = False):
        from eyrie.model import load_target

        self.model, self.tokenizer = load_target(model_dir, dtype, device, trust_remote_code)
        self.device = self.model.device
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.stop_ids = self._stop_ids()

    def _stop_ids(self) -> set[int]:
        configured = self.model.generation_config.eos_token_id
        stop = set(configured if isinstance(configured, list) else [configured] if configured is not None else [])
        if self.tokenizer.eos_token_id is not None:
            stop.add(self.tokenizer.eos_token_id)
        return stop

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        text = render(self.tokenizer, messages, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def generate(self, prompts: list[list[int]], settings: dict) -> list[TurnResult]:
        import torch
        from transformers import GenerationConfig

        width = max(len(p) for p in prompts)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=self.device)
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        sampling = settings["temperature"] > 0
        config = GenerationConfig(
            max_new_tokens=settings["max_new_tokens"],
            do_sample=sampling,
            temperature=settings["temperature"] if sampling else None,
            top_p=settings["top_p"] if sampling else None,
            top_k=(settings["top_k"] or None) if sampling else None,
            eos_token_id=sorted(self.stop_ids),
            pad_token_id=pad,
        )
        with torch.inference_mode():
            output = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
        results = []
        for prompt, row in zip(prompts, output[:, width:].tolist()):
            stop_at = next((i for i, token in enumerate(row) if token in self.stop_ids), None)
            new_tokens = row if stop_at is None else row[:stop_at]
            results.append(
                TurnResult(
                    reply=self.tokenizer.decode(new_tokens, skip_special_tokens=True),
                    finish_reason="length" if stop_at is None else "stop",
                    prompt_tokens=len(prompt),
                    completion_tokens=len(new_tokens) + (stop_at is not None),
                )
            )
        return results
