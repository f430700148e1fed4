# Snakemake entry point: assistant-token counts -> draft vocabulary (see eyrie.tokens.build_vocab; the format is eyrie.tokens.vocab).
from eyrie.core.joblog import job_log
from eyrie.target.family import target_text_config
from eyrie.tokens.build_vocab import build_draft_vocab

with job_log(snakemake.log[0]):
    build_draft_vocab(
        token_shards=list(snakemake.input.tokens),
        target_vocab_size=target_text_config(snakemake.input.model, bool(snakemake.config["model"]["trust_remote_code"])).vocab_size,  # a multimodal target's text part
        draft_vocab_size=snakemake.params.draft_vocab_size,
        out_path=snakemake.output[0],
        from_prompts=snakemake.params.from_prompts,
    )
