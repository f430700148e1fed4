"""configs/: one recipe per target family, each valid against the schema and saying what it is for, on what hardware,
in how long (an estimate, labelled so) and how to launch it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from conftest import REPO

from eyrie import config as cfg

RECIPES = ("llama-3.1-8b", "qwen3-8b", "qwen3-30b-a3b", "gpt-oss-20b", "deepseek-v3", "gemma-3-27b", "mistral-small-24b")


def header(path: Path) -> str:
    lines = path.read_text().splitlines()
    return "\n".join(line for line in lines[: next(k for k, line in enumerate(lines) if not line.startswith("#"))])


@pytest.mark.parametrize("name", RECIPES)
def test_each_family_recipe_is_valid_and_says_how_to_run_it(name):
    path = REPO / "configs" / f"{name}.yaml"
    config = cfg.load(str(path))  # the schema's validation, with its defaults
    text = header(path)
    assert "Hardware:" in text and "Launch:" in text and f"--configfile configs/{name}.yaml" in text
    assert "Time: an estimate, not a measurement" in text  # no figure passes for a measured one
    model = config["model"]
    assert Path(model["path"]).is_absolute() and model["served_name"] and model["device"] == "cuda"
    assert "gguf" not in yaml.safe_load(path.read_text())["model"]  # the user's own target, not the default's wheel
    assert config["hidden"]["tensor_parallel"] == 1  # MoE targets are refused under it; dense ones fit one GPU


def test_every_config_in_configs_is_valid():
    for path in sorted((REPO / "configs").glob("*.yaml")):
        cfg.load(str(path))


def test_every_family_recipe_is_checked_above_and_listed_in_the_readme():
    """A recipe added to configs/ is validated by the test above, and README.md's recipe list names it."""
    on_disk = {path.stem for path in (REPO / "configs").glob("*.yaml")} - {"h200"}  # h200.yaml: the default target's run, not a family's
    assert on_disk == set(RECIPES)
    listed = re.search(r"`configs/\{([^}]*)\}\.yaml`", (REPO / "README.md").read_text()).group(1).split(",")
    assert listed == list(RECIPES)
