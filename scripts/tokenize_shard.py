# Snakemake entry point: completions shard -> tokens and loss mask (see eyrie.tokens.tokenize; the format is eyrie.tokens.shards).
from eyrie.core.joblog import job_log
from eyrie.tokens.tokenize import tokenize_shard
from eyrie.target.model import load_tokenizer, template_fingerprint

with job_log(snakemake.log[0]):
    tokenizer = load_tokenizer(snakemake.input.model, snakemake.params.trust_remote_code)
    tokenize_shard(
        completions_path=snakemake.input.completions,
        out_path=snakemake.output[0],
        tokenizer=tokenizer,
        template_sha256=template_fingerprint(tokenizer),
        max_seq_len=snakemake.params.max_seq_len,
    )
