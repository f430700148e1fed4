# eyrie: prompts -> completions -> tokens -> (draft vocab -> hidden states -> drafter -> benchmark) -> report.html
# Run from a project directory holding config.yaml: `snakemake --cores all report.html`.

configfile: "config.yaml"


include: "rules/common.smk"
include: "rules/resources.smk"
include: "rules/data.smk"
include: "rules/generate.smk"
include: "rules/tokenize.smk"
include: "rules/vocab.smk"
include: "rules/hidden.smk"
include: "rules/train.smk"
include: "rules/speculators.smk"
include: "rules/bench.smk"
include: "rules/report.smk"


rule all:
    default_target: True
    input:
        "report.html",
