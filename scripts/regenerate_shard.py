# Snakemake entry point: regenerate one prompt shard with the engine the config names (see eyrie.generate).
from contextlib import nullcontext
from pathlib import Path

from eyrie.generate import regenerate_shard
from eyrie.joblog import job_log
from eyrie.model import load_tokenizer, model_fingerprint, template_fingerprint

engine_config = snakemake.config["engine"]
kind = engine_config["kind"]

with job_log(snakemake.log[0]):
    if kind == "transformers":
        import torch

        from eyrie.engine import TransformersEngine

        torch.set_num_threads(snakemake.threads)
        engine = TransformersEngine(snakemake.input.model, **snakemake.params.model)
        tokenizer = engine.tokenizer
        server = nullcontext(None)
    else:
        from eyrie.openai_engine import OpenAIEngine

        tokenizer = load_tokenizer(snakemake.input.model, snakemake.params.model["trust_remote_code"])
        server = nullcontext(None)
        if kind == "sglang":
            from eyrie import sglang_server

            sglang = engine_config["sglang"]
            command = lambda port: sglang_server.command_from_config(sglang, snakemake.input.model, port)  # noqa: E731
            # Not a param: params are rerun triggers, and where a log goes must not rerun finished shards.
            log = Path("logs/sglang") / snakemake.wildcards.dataset / f"{snakemake.wildcards.shard}.log"
            if sglang["one_server_per_job"]:
                server = sglang_server.managed_server(command, log, startup_timeout_s=sglang["startup_timeout_s"], shutdown_timeout_s=sglang["shutdown_timeout_s"])
            else:
                server = sglang_server.shared_server(
                    command, Path("logs/sglang/shared.log"), ".eyrie/sglang", startup_timeout_s=sglang["startup_timeout_s"], shutdown_timeout_s=sglang["shutdown_timeout_s"]
                )
    with server as url:
        if kind != "transformers":
            openai = engine_config["openai"]
            engine = OpenAIEngine.from_config(
                openai,
                tokenizer=tokenizer if openai["local_prompt_check"] else None,
                base_urls=[url] if url else None,
            )
        regenerate_shard(
            prompts_path=snakemake.input.prompts,
            out_path=snakemake.output[0],
            partial_dir=snakemake.params.partial_dir,
            dataset=snakemake.wildcards.dataset,
            shard=snakemake.wildcards.shard,
            settings=snakemake.params.settings,
            engine_settings=engine_config,
            engine=engine,
            model_fingerprint=model_fingerprint(snakemake.input.model),
            template_sha256=template_fingerprint(tokenizer),
        )
