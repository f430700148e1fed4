# Hidden-state caches (or, with hidden.mode online, token shards and the target run in the job) + draft vocab
# -> the EAGLE-3 drafter checkpoint that SGLang loads.


rule train_drafter:
    input:
        unpack(training_states),
        vocab="results/vocab/draft_vocab.safetensors",
        model=model_dir(),
    output:
        directory("results/drafter"),
    params:
        drafter=canonical(config["drafter"]),
        train=canonical(config["train"]),
        # Every train.* key (attention, recompute_mlp, compile, ...) is in params: a change reruns training.
        # Resume state lives outside the declared output, which is written once at the end.
        state_dir="results/partial/train",
        **online_params(),
    threads: workflow.cores
    resources:
        gpu=config["train"]["processes"] if config["train"]["device"] != "cpu" else 0,
    log:
        "logs/train/drafter.log",
    benchmark:
        "logs/benchmarks/train/drafter.tsv"
    conda: "../envs/cuda.yaml"
    script:
        "../scripts/train_drafter.py"
