# eyrie: prompts -> completions -> tokens + hidden states (one job) -> draft vocab -> drafter -> benchmark -> report.html
# Run from a project directory holding config.yaml: `snakemake --cores all report.html`.

configfile: "config.yaml"


include: "rules/common.smk"
include: "rules/resources.smk"
include: "rules/synthetic.smk"
include: "rules/data.smk"
include: "rules/generate.smk"
include: "rules/tokenize.smk"
include: "rules/vocab.smk"
include: "rules/hidden.smk"
include: "rules/train.smk"
include: "rules/speculators.smk"
include: "rules/bench.smk"
include: "rules/report.smk"


# The default target asks for every planned file, not only report.html: Snakemake rebuilds a missing intermediate
# only for a job that must run, and an up-to-date report.html needs none. So after a kill or a deleted file,
# `snakemake --cores all --rerun-incomplete` (no target) rebuilds what is gone and what is made from it;
# `eyrie verify` also finds corrupt files and prints the command that forces them. (Prompt shards: only lost ones,
# which their prompts job then declares; see rules/common.smk.)
rule all:
    default_target: True
    input:
        buildable_planned_files(),
