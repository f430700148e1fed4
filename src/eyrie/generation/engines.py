"""Pick and open the regeneration engine the config names; every engine yields the same shard files.

A dataset that keeps its source's replies (`replies: source`) is answered by eyrie.generation.source_replies whatever
engine.kind says: it loads no model and starts no server."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Iterator


@contextmanager
def open_engine(engine_config: dict, model_dir: str, model_settings: dict, threads: int, server_log: Path,
                replies: str = "target") -> Iterator[tuple[object, object]]:
    """(engine, tokenizer) for engine.kind, or for the dataset's `replies: source`; a managed SGLang server lives
    exactly as long as the block."""
    kind = engine_config["kind"]
    if replies == "source":
        from eyrie.generation.source_replies import SourceReplies
        from eyrie.target.model import load_tokenizer

        tokenizer = load_tokenizer(model_dir, model_settings["trust_remote_code"])
        yield SourceReplies(tokenizer), tokenizer
        return
    if kind == "transformers":
        import torch

        from eyrie.generation.transformers_engine import TransformersEngine

        torch.set_num_threads(threads)
        engine = TransformersEngine(
            model_dir, **model_settings, batching=engine_config["batching"], kv_memory_fraction=engine_config["kv_memory_fraction"]
        )
        yield engine, engine.tokenizer
        return

    from eyrie.generation.openai_engine import OpenAIEngine
    from eyrie.target.model import load_tokenizer

    tokenizer = load_tokenizer(model_dir, model_settings["trust_remote_code"])
    server = nullcontext(None)
    if kind == "sglang":
        from eyrie.generation import sglang_server
        from eyrie.target.serving import command_from_config

        sglang = engine_config["sglang"]
        timeouts = {"startup_timeout_s": sglang["startup_timeout_s"], "shutdown_timeout_s": sglang["shutdown_timeout_s"]}

        def command(port: int) -> list[str]:
            return command_from_config(sglang, model_dir, port, bool(model_settings["trust_remote_code"]))

        if sglang["one_server_per_job"]:
            server = sglang_server.managed_server(command, server_log, **timeouts)
        else:
            server = sglang_server.shared_server(command, Path("logs/sglang/shared.log"), ".eyrie/sglang", **timeouts)
    with server as url:
        openai = engine_config["openai"]
        engine = OpenAIEngine.from_config(
            openai,
            tokenizer=tokenizer if openai["local_prompt_check"] else None,
            base_urls=[url] if url else None,
            model_dir=model_dir,  # what the servers must serve: checked before the first request
        )
        yield engine, tokenizer
