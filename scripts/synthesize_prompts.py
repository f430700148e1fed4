# Snakemake entry point: the target writes one synthetic dataset's user prompts (see eyrie.data.synthetic).
import torch

from eyrie.core.joblog import job_log
from eyrie.data.synthetic import synthesize_prompts
from eyrie.target.model import load_target, model_fingerprint, template_fingerprint

with job_log(snakemake.log[0]):
    torch.set_num_threads(snakemake.threads)
    model, tokenizer = load_target(snakemake.input.model, **snakemake.params.model)
    synthesize_prompts(
        dataset=snakemake.wildcards.dataset,
        settings=snakemake.params.settings,
        model=model,
        tokenizer=tokenizer,
        out_path=snakemake.output[0],
        partial_dir=snakemake.params.partial_dir,
        model_fingerprint=model_fingerprint(snakemake.input.model),
        template_sha256=template_fingerprint(tokenizer),
    )
