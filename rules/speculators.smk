# Drafter + target -> the same drafter in the speculators format, vLLM's native one (`vllm serve results/drafter-speculators`).
# The export names the target as served: model.served_name (a hub id or an absolute path), else input.model made absolute.


rule export_speculators:
    localrule: True  # seconds of work: a rename of the drafter's tensors plus the target's embeddings
    input:
        drafter="results/drafter",
        model=model_dir(),
    output:
        directory("results/drafter-speculators"),
    params:
        # k, vLLM's num_speculative_tokens: the chain length the benchmarks measure.
        speculative_tokens=config["bench"]["draft_tokens"],
        served_name=config["model"].get("served_name"),
    log:
        "logs/drafter/speculators.log",
    conda: "../envs/cpu.yaml"
    script:
        "../scripts/export_speculators.py"
