# Snakemake entry point: completions shard -> token shard (eyrie.tokens.tokenize; the format is eyrie.tokens.shards), then
# hidden-state cache (eyrie.hidden.extract; the format is eyrie.hidden.cache). Tokenizing here, not in a job of its own,
# halves the jobs per shard after regeneration (rules/hidden.smk).
# hidden.tensor_parallel > 1: the same extraction as that many tensor-parallel ranks under torchrun (eyrie.hidden.parallel).
from pathlib import Path

import torch

from eyrie.core.joblog import job_log
from eyrie.tokens.tokenize import tokenize_shard
from eyrie.hidden.extract import extract_target_shard, remove_stale_temporaries
from eyrie.hidden.parallel import launch_tensor_parallel
from eyrie.hidden.size import ensure_shard_fits, target_hidden_size
from eyrie.target.model import load_tokenizer, model_fingerprint, template_fingerprint

with job_log(snakemake.log[0]):
    torch.set_num_threads(snakemake.threads)
    model_cfg = snakemake.params.model
    tokenizer = load_tokenizer(snakemake.input.model, model_cfg["trust_remote_code"])
    template_sha256 = template_fingerprint(tokenizer)
    tokenize_shard(
        completions_path=snakemake.input.completions,
        out_path=snakemake.output.tokens,
        tokenizer=tokenizer,
        template_sha256=template_sha256,
        max_seq_len=snakemake.params.max_seq_len,
    )
    # Before the target loads (minutes for a large one): refuse a shard the disk cannot hold. A killed run's temporary
    # of this shard goes first, or its bytes would count against the room and refuse the rerun that replaces it.
    remove_stale_temporaries(snakemake.output.hidden)
    ensure_shard_fits(snakemake.output.tokens, snakemake.output.hidden, target_hidden_size(snakemake.input.model), snakemake.params.hidden["dtype"])
    arguments = dict(
        tokens_path=snakemake.output.tokens,
        out_path=snakemake.output.hidden,
        model_dir=snakemake.input.model,
        model_cfg=model_cfg,
        aux_layer_ids=snakemake.params.aux_layer_ids,
        model_fingerprint=model_fingerprint(snakemake.input.model),
        template_sha256=template_sha256,
        batch_tokens=snakemake.params.hidden["batch_tokens"],
        dtype=snakemake.params.hidden["dtype"],
        # Like tensor_parallel, read from the config: compiled or eager, the states are the same up to rounding.
        compile=snakemake.config["hidden"].get("compile", "auto"),
    )
    # How many ranks run it, not what they compute: read from the config, so changing it re-extracts nothing.
    processes = int(snakemake.config["hidden"]["tensor_parallel"])
    if processes > 1:
        threads = max(1, snakemake.threads // processes)
        launch_tensor_parallel({**arguments, "threads": threads}, processes, Path(snakemake.log[0]).with_suffix(".launch.json"))
    else:
        extract_target_shard(**arguments)
