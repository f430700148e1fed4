# Completions shard -> its token shard (eyrie.tokens.tokenize), then the target's aux and final hidden states for every
# token (the drafter's training input). None with hidden.mode online: the training job runs the target itself.
# hidden.tensor_parallel N: each job runs the target as N torchrun ranks, one GPU each (eyrie.hidden.parallel).
from eyrie.hidden.parallel import extraction_gpus


if config["hidden"]["mode"] != "online":

    rule extract_hidden:
        input:
            completions="results/completions/{dataset}/{shard}.parquet",
            model=model_dir(),
        output:
            # The job tokenizes its shard first: the token shard is its output too (the draft vocabulary reads it).
            tokens="results/tokens/{dataset}/{shard}.parquet",
            # hidden.keep: false makes it temp(): deleted once the drafter is trained (rules/common.smk hidden_cache).
            hidden=hidden_cache("results/hidden/{dataset}/{shard}.safetensors"),
        params:
            max_seq_len=config["tokenize"]["max_seq_len"],
            aux_layer_ids=config["drafter"]["aux_layer_ids"],
            # keep says whether the cache stays, tensor_parallel how many processes compute it and compile whether the
            # target's layers run compiled, not what is in it (compiled or not, the same states up to rounding):
            # switching any of them must not re-extract (the script reads tensor_parallel and compile from the config).
            hidden=canonical({k: v for k, v in config["hidden"].items() if k not in ("keep", "tensor_parallel", "compile")}),
            model=canonical({k: config["model"][k] for k in ("dtype", "device", "trust_remote_code")}),
        # On a GPU the forward is a small share of a job (model load, writing the cache): a few cores per GPU let
        # shards overlap on one card (`--resources gpu=N` caps how many); on the CPU a shard takes every core.
        threads: workflow.cores if config["model"]["device"] != "cuda" else min(4 * config["hidden"]["tensor_parallel"], workflow.cores)
        resources:
            # One GPU per tensor-parallel rank (model.device auto counts as a GPU, as for regeneration and training).
            gpu=extraction_gpus(config),
        log:
            "logs/hidden/{dataset}/{shard}.log",
        benchmark:
            "logs/benchmarks/hidden/{dataset}/{shard}.tsv"
        conda: "../envs/cuda.yaml"
        script:
            "../scripts/extract_hidden.py"
