"""The in-process regeneration engine: the target model under transformers, batched by tokens."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from eyrie.generation.reply_text import opens_thinking, reply_markers, split_reply
from eyrie.target.chat_template import render


@dataclass
class TurnResult:
    reply: str  # the content: the decoded text less what `extra` holds
    finish_reason: str  # "stop" (end-of-turn token), "length" (hit max_new_tokens)
    prompt_tokens: int
    completion_tokens: int
    extra: dict = field(default_factory=dict)  # reasoning_content, tool_calls, tool_calls_unparsed (reply_text.split_reply)


BATCHING = ("auto", "padded", "continuous", "static")
GENERATION_PROMPT_TOKENS = 32  # more than any template's generation prompt ("<|im_start|>assistant\n<think>\n": 4)


def check_batching(batching: str) -> str:
    if batching not in BATCHING:
        raise ValueError(f"engine.batching must be one of {', '.join(BATCHING)}, got {batching!r}")
    return batching


class TransformersEngine:
    """Generates one assistant turn for many conversations at once.

    padded: one `generate` call per batch, left-padded; every row runs until the longest is done.
    continuous: transformers' `generate_batch`, which schedules requests over a paged KV cache,
    admits new ones as others finish and replays CUDA graphs; same tokens, far fewer wasted steps.
    static: padded rows on eyrie's own static KV cache, one CUDA graph per step (static_generate);
    greedy settings on Llama-structured targets only, anything else runs padded (`fallback` says why).
    auto: static on a CUDA target (9.7x padded on an H200), padded elsewhere (the CPU gains nothing).
    """

    def __init__(
        self,
        model_dir: str,
        dtype: str = "auto",
        device: str = "auto",
        trust_remote_code: bool = False,
        batching: str = "auto",
        kv_memory_fraction: float = 0.8,
    ):
        from eyrie.target.model import load_target

        self.model, self.tokenizer = load_target(model_dir, dtype, device, trust_remote_code)
        self.device = self.model.device
        self.batching = check_batching(batching)
        if self.batching == "auto":
            self.batching = "static" if self.device.type == "cuda" else "padded"
        self.kv_memory_fraction = kv_memory_fraction
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.stop_ids = self._stop_ids()
        self.markers = reply_markers(self.tokenizer)
        self.static = None  # the BatchedGreedy loop, built on first use
        self.fallback: str | None = None  # why batching: static ran padded instead
        self.static_refused: str | None = None  # the static engine's self-check refused this model (probed once)

    def _stop_ids(self) -> set[int]:
        configured = self.model.generation_config.eos_token_id
        stop = set(configured if isinstance(configured, list) else [configured] if configured is not None else [])
        if self.tokenizer.eos_token_id is not None:
            stop.add(self.tokenizer.eos_token_id)
        return stop

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The prompt as serving renders it: the conversation so far (with its tool results) and the record's tools."""
        text = render(self.tokenizer, messages, add_generation_prompt=True, tools=tools)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _generation_config(self, settings: dict):
        from transformers import GenerationConfig

        sampling = settings["temperature"] > 0
        return GenerationConfig(
            max_new_tokens=settings["max_new_tokens"],
            do_sample=sampling,
            temperature=settings["temperature"] if sampling else None,
            top_p=settings["top_p"] if sampling else None,
            top_k=(settings["top_k"] or None) if sampling else None,
            eos_token_id=sorted(self.stop_ids),
            pad_token_id=self.tokenizer.pad_token_id,
        )

    def generate(self, prompts: list[list[int]], settings: dict) -> list[TurnResult]:
        if self.batching == "continuous":
            rows = self._continuous(prompts, settings)
        elif self.batching == "static" and self._static_usable(settings):
            rows = self.static.generate(prompts, settings["max_new_tokens"])
        else:
            rows = self._padded(prompts, settings)
        return [self._turn(prompt, row) for prompt, row in zip(prompts, rows)]

    def _padded(self, prompts: list[list[int]], settings: dict) -> list[list[int]]:
        import torch

        width = max(len(p) for p in prompts)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=self.device)
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        with torch.inference_mode():
            output = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=self._generation_config(settings))
        return output[:, width:].tolist()

    def _static_usable(self, settings: dict) -> bool:
        """Whether batching: static can run these settings; says once (stderr, so the job log) why not."""
        from eyrie.decoding.static import unsupported_reason

        if settings["temperature"] > 0:
            reason = "sampling (temperature > 0); the static loop is greedy"
        else:  # a refusal of the engine's self-check is the model's, so it stands for every later batch
            reason = self.static_refused or unsupported_reason(self.model)
        if reason is None and self.static is None:
            from eyrie.decoding.batched_greedy import open_batched_greedy
            from eyrie.decoding.static_common import UnsupportedTargetError

            try:
                self.static = open_batched_greedy(self.model, self.tokenizer.pad_token_id, self.stop_ids)
            except UnsupportedTargetError as error:  # the engine's self-check against the model's own forward refused it
                reason = self.static_refused = str(error)
        if reason is None:
            return True
        if self.fallback != reason:
            self.fallback = reason
            warnings.warn(f"engine.batching: static runs these turns padded instead: {reason}")
        return False

    def _continuous(self, prompts: list[list[int]], settings: dict) -> list[list[int]]:
        import torch
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        if self.device.type == "cuda":
            # Sized from free GPU memory; the fraction leaves room for other jobs sharing the card.
            cb_config = ContinuousBatchingConfig(max_memory_percent=self.kv_memory_fraction)
        else:
            # Off CUDA the auto-sizing probes for a GPU-sized cache (tens of seconds): size it for this batch.
            longest = max(len(p) for p in prompts) + settings["max_new_tokens"]
            blocks_per_request = -(-longest // 256) + 1
            cb_config = ContinuousBatchingConfig(num_blocks=blocks_per_request * len(prompts), max_batch_tokens=max(256, longest))
        if settings["temperature"] > 0:
            # The manager samples with its own generator: seed it from ours, which the caller seeded per batch.
            cb_config.seed = int(torch.randint(0, 2**31 - 1, ()))
        # No inference_mode here: the manager's own thread updates tensors made in this one, which inference
        # tensors forbid (seen on CUDA with transformers 5.17); generate_batch disables gradients itself.
        outputs = self.model.generate_batch(
            [list(p) for p in prompts], generation_config=self._generation_config(settings), continuous_batching_config=cb_config
        )
        results = list(outputs.values())
        failed = [r for r in results if r.error is not None]
        if len(results) != len(prompts) or failed:
            reason = failed[0].error if failed else f"{len(prompts) - len(results)} of {len(prompts)} requests returned nothing"
            raise RuntimeError(
                f"continuous batching failed ({reason}); finished turns are kept. Rerun, or set engine.batching: padded"
            )
        return [list(r.generated_tokens) for r in results]

    def _turn(self, prompt: list[int], row: list[int]) -> TurnResult:
        stop_at = next((i for i, token in enumerate(row) if token in self.stop_ids), None)
        new_tokens = row if stop_at is None else row[:stop_at]
        # Split as a server's reasoning and tool parsers would, so the row matches the OpenAI engine's.
        # The prompt's last tokens hold its generation prompt: decoding them alone tells whether it opened thinking.
        in_thinking = opens_thinking(self.tokenizer.decode(prompt[-GENERATION_PROMPT_TOKENS:], skip_special_tokens=False), self.markers)
        reply, extra = split_reply(self.tokenizer.decode(new_tokens, skip_special_tokens=True), self.markers, in_thinking)
        return TurnResult(
            reply=reply,
            finish_reason="length" if stop_at is None else "stop",
            prompt_tokens=len(prompt),
            completion_tokens=len(new_tokens) + (stop_at is not None),
            extra=extra,
        )
