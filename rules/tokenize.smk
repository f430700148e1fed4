# Completions -> input_ids and assistant-only loss masks, with the target's own chat template.
# Offline, extract_hidden tokenizes its shard itself (rules/hidden.smk: one job per shard instead of two, a third fewer
# jobs for Snakemake to plan and a cluster to queue); this rule runs only with hidden.mode online, where nothing is extracted.

if config["hidden"]["mode"] == "online":

    rule tokenize_shard:
        input:
            completions="results/completions/{dataset}/{shard}.parquet",
            model=model_dir(),
        output:
            "results/tokens/{dataset}/{shard}.parquet",
        params:
            max_seq_len=config["tokenize"]["max_seq_len"],
            trust_remote_code=config["model"]["trust_remote_code"],
        log:
            "logs/tokens/{dataset}/{shard}.log",
        conda: "../envs/cpu.yaml"
        script:
            "../scripts/tokenize_shard.py"
