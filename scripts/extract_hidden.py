# Snakemake entry point: token shard -> hidden-state cache (see eyrie.hidden.extract; the format is eyrie.hidden.cache).
import torch

from eyrie.core.joblog import job_log
from eyrie.hidden.extract import extract_shard
from eyrie.hidden.size import ensure_shard_fits, target_hidden_size
from eyrie.target.aux_layers import default_aux_layer_ids
from eyrie.target.model import load_target, model_fingerprint, template_fingerprint

with job_log(snakemake.log[0]):
    torch.set_num_threads(snakemake.threads)
    # Before the target loads (minutes for a large one): refuse a shard the disk cannot hold.
    ensure_shard_fits(snakemake.input.tokens, snakemake.output[0], target_hidden_size(snakemake.input.model), snakemake.params.hidden["dtype"])
    model, tokenizer = load_target(snakemake.input.model, **snakemake.params.model)
    aux_layer_ids = snakemake.params.aux_layer_ids or default_aux_layer_ids(model.config.num_hidden_layers)
    extract_shard(
        tokens_path=snakemake.input.tokens,
        out_path=snakemake.output[0],
        model=model,
        model_fingerprint=model_fingerprint(snakemake.input.model),
        template_sha256=template_fingerprint(tokenizer),
        aux_layer_ids=aux_layer_ids,
        batch_tokens=snakemake.params.hidden["batch_tokens"],
        dtype=snakemake.params.hidden["dtype"],
    )
