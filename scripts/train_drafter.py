# Snakemake entry point: hidden-state caches (hidden.mode online: token shards) -> EAGLE-3 drafter checkpoint
# (see eyrie.training.train).
# train.processes > 1: the same training as several data-parallel ranks under torchrun.
import torch

from eyrie.core.joblog import job_log
from eyrie.target.model import load_tokenizer, model_fingerprint, template_fingerprint
from eyrie.training.distributed import launch_data_parallel
from eyrie.training.train import train_drafter

with job_log(snakemake.log[0]):
    torch.set_num_threads(snakemake.threads)
    tokenizer = load_tokenizer(snakemake.input.model, snakemake.config["model"]["trust_remote_code"])
    online = snakemake.params.get("online")  # hidden.mode online (rules/common.smk online_params)
    states = (
        dict(token_paths=list(snakemake.input.tokens), hidden_cfg=online["hidden"], model_cfg=online["model"])
        if online
        else dict(hidden_paths=list(snakemake.input.hidden))
    )
    arguments = dict(
        **states,
        vocab_path=snakemake.input.vocab,
        target_dir=snakemake.input.model,
        out_dir=snakemake.output[0],
        state_dir=snakemake.params.state_dir,
        drafter_cfg=snakemake.params.drafter,
        train_cfg=snakemake.params.train,
        template_sha256=template_fingerprint(tokenizer),
        target_fingerprint=model_fingerprint(snakemake.input.model),
    )
    processes = int(snakemake.params.train["processes"])
    if processes > 1:
        launch_data_parallel(arguments, processes, f"{snakemake.params.state_dir}/launch.json", snakemake.log[0])
    else:
        train_drafter(**arguments)
