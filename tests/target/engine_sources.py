"""The serving engines' own source, for tests that check eyrie's files against the code that reads them.

SGLang 0.5.23 is installed in the test environment without its dependencies (the README's test command): its
files are read from site-packages. vLLM 0.33.0 does not install on a CPU machine within CI's budget (it pins
torch 2.14.0 and its CUDA kernels), but its wheel downloads in seconds: `vllm_file` reads members of it, and
`function_from` runs one function or method of theirs, cut out of its module with `ast`, so a test exercises
vLLM's own logic without importing vLLM. When a cut-out function disappears from a later version the test
fails loudly (KeyError naming it) rather than testing a copy.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

SGLANG_VERSION = "0.5.23"
VLLM_VERSION = "0.33.0"
WHEEL_CACHE = Path(os.environ.get("EYRIE_WHEEL_CACHE", "/tmp/eyrie-wheels"))


def sglang_file(relative: str) -> str:
    """The text of sglang/<relative> from the installed sglang; skips when sglang is not installed."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"sglang is not installed: pip install --no-deps sglang=={SGLANG_VERSION}")
    return (Path(next(iter(spec.submodule_search_locations))) / relative).read_text(encoding="utf-8")


def vllm_wheel() -> Path:
    """vLLM's wheel, downloaded once (no dependencies, nothing installed) into the wheel cache."""
    found = sorted(WHEEL_CACHE.glob(f"vllm-{VLLM_VERSION}-*.whl"))
    if found:
        return found[0]
    WHEEL_CACHE.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(WHEEL_CACHE), f"vllm=={VLLM_VERSION}"],
        check=False, capture_output=True, text=True, timeout=600,
    )
    found = sorted(WHEEL_CACHE.glob(f"vllm-{VLLM_VERSION}-*.whl"))
    if done.returncode != 0 or not found:
        pytest.skip(f"cannot download vllm=={VLLM_VERSION}'s wheel to read its loaders: {done.stderr.strip()[-500:]}")
    return found[0]


def vllm_file(relative: str) -> str:
    """The text of vllm/<relative> inside vLLM's wheel."""
    with zipfile.ZipFile(vllm_wheel()) as wheel:
        return wheel.read(f"vllm/{relative}").decode("utf-8")


def function_source(source: str, name: str) -> str:
    """The source of function `name` (or `Class.method`) in a module's text, dedented, decorators dropped."""
    tree = ast.parse(source)
    scope: list[ast.stmt] = tree.body
    *owners, last = name.split(".")
    for owner in owners:
        node = next((n for n in scope if isinstance(n, ast.ClassDef) and n.name == owner), None)
        if node is None:
            raise KeyError(f"no class {owner} in the engine's source: has it moved?")
        scope = node.body
    node = next((n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == last), None)
    if node is None:
        raise KeyError(f"no function {name} in the engine's source: has it moved?")
    node.decorator_list = []
    return textwrap.dedent(ast.unparse(node))


def function_from(source: str, name: str, **namespace):
    """Function `name` of an engine's module text, defined in a namespace holding `namespace` (what it refers to)."""
    scope = dict(namespace)
    exec(compile(function_source(source, name), f"<engine:{name}>", "exec"), scope)  # noqa: S102 - the engine's own code
    return scope[name.rsplit(".", 1)[-1]]


def class_fields(source: str, class_name: str) -> dict[str, str]:
    """The annotated fields of a (data)class in a module's text: name -> annotation source."""
    node = next((n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == class_name), None)
    if node is None:
        raise KeyError(f"no class {class_name} in the engine's source")
    return {n.target.id: ast.unparse(n.annotation) for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def literal_values(source: str, name: str) -> set[str]:
    """Every string in a module-level `Name = Literal[...]` alias, following the aliases it names."""
    assigns = {n.targets[0].id: n.value for n in ast.parse(source).body if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name)}
    values: set[str] = set()

    def walk(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            values.add(node.value)
        elif isinstance(node, ast.Name) and node.id in assigns:
            walk(assigns[node.id])
        else:
            for child in ast.iter_child_nodes(node):
                walk(child)

    walk(assigns[name])
    return values


def vllm_config_package(root: Path) -> Path:
    """A directory holding vLLM's own config readers for draft models, importable as `vllm.*` without vLLM installed.

    transformers_utils/configs/speculators/{algos,base}.py and configs/eagle.py are vLLM's files as they are; the
    package __init__ files are empty, and transformers_utils/utils.py holds only the one function they import from
    it (without_trust_remote_code, cut out of vLLM's utils.py). Put `root` first on PYTHONPATH.
    """
    package = root / "vllm"
    members = ["transformers_utils/configs/speculators/algos.py", "transformers_utils/configs/speculators/base.py",
               "transformers_utils/configs/speculators/__init__.py", "transformers_utils/configs/eagle.py"]
    for member in members:
        path = package / member
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(vllm_file(member), encoding="utf-8")
    for init in ("__init__.py", "transformers_utils/__init__.py", "transformers_utils/configs/__init__.py"):
        (package / init).write_text("", encoding="utf-8")
    utils = function_source(vllm_file("transformers_utils/utils.py"), "without_trust_remote_code")
    (package / "transformers_utils" / "utils.py").write_text("from typing import Any\n\n\n" + utils + "\n", encoding="utf-8")
    return root
