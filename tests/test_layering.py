"""The package's layering (docs/DESIGN.md), read from the source with ast: no circles, no import that points up.

core <- target <- drafter <- decoding <- stages <- faces, the stages in the pipeline's order
(data, generation, tokens, hidden, training, bench, report): a stage reads only an earlier stage, and only through that
stage's format module; nothing imports a job driver.
Every import counts, including those inside functions: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
TESTS = Path(__file__).resolve().parent

LAYERS = {"core": 0, "target": 1, "drafter": 2, "decoding": 3}
STAGES = ("data", "generation", "tokens", "hidden", "training", "bench", "report")  # the pipeline's order
STAGE_LAYER, FACE_LAYER = 4, 5
# What one stage may read of another: the modules that own a file format.
FORMAT_MODULES = {
    "eyrie.tokens.shards",
    "eyrie.tokens.vocab",
    "eyrie.generation.conversations",
    "eyrie.hidden.cache",
    "eyrie.hidden.fp8",
}
# What Snakemake's scripts (and `python -m`) run; no module of the package imports one.
JOB_DRIVERS = {
    "eyrie.data.dataset_prompts",
    "eyrie.tokens.tokenize",
    "eyrie.tokens.build_vocab",
    "eyrie.generation.regenerate",
    "eyrie.hidden.extract",
    "eyrie.training.train",
    "eyrie.bench.benchmark",
    "eyrie.report.build",
}


def module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def eyrie_imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The eyrie modules `name` imports anywhere in its file (`from eyrie.x import y` counts eyrie.x.y if that is a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            modules = {f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known}
            found |= modules or {base}
    return {m for m in found if m in known and m != name and m != "eyrie"}


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    paths = {module_name(p, src): p for p in (src / "eyrie").rglob("*.py")}
    known = set(paths)
    return {name: eyrie_imports(path, name, known) for name, path in paths.items()}


def layer(module: str) -> int:
    top = module.split(".")[1] if module.count(".") else ""
    if top in LAYERS:
        return LAYERS[top]
    return STAGE_LAYER if top in STAGES else FACE_LAYER


def stage(module: str) -> str | None:
    top = module.split(".")[1] if module.count(".") else ""
    return top if top in STAGES else None


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan)."""
    index, low, on_stack, stack, groups = {}, {}, set(), [], []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def violations(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module, imported in sorted(graph.items()):
        for target in sorted(imported):
            if layer(target) > layer(module):
                found.append(f"{module} imports {target}: a lower layer may not import a higher one")
            elif stage(module) and stage(target) and stage(module) != stage(target):
                if STAGES.index(stage(target)) > STAGES.index(stage(module)):
                    found.append(f"{module} imports {target}: a stage reads only the stages before it ({' -> '.join(STAGES)})")
                elif target not in FORMAT_MODULES:
                    found.append(f"{module} imports {target}: another stage is read only through its format modules {sorted(FORMAT_MODULES)}")
            if target in JOB_DRIVERS:
                found.append(f"{module} imports the job driver {target}")
    return found


def test_the_package_has_no_import_circles():
    assert circles(import_graph()) == []


def test_every_import_points_down_the_layers_and_between_stages_only_to_formats():
    assert violations(import_graph()) == []


def test_the_listed_format_modules_and_job_drivers_exist():
    graph = import_graph()
    assert FORMAT_MODULES <= set(graph), sorted(FORMAT_MODULES - set(graph))
    assert JOB_DRIVERS <= set(graph), sorted(JOB_DRIVERS - set(graph))


def test_package_inits_re_export_nothing():
    """Import concrete names from their owning modules: an __init__ that re-exports hides where a name lives."""
    inits = [p for p in (SRC / "eyrie").rglob("__init__.py") if p.parent != SRC / "eyrie"]
    assert inits, "no subpackages found"
    for path in inits:
        assert not [n for n in ast.parse(path.read_text()).body if not isinstance(n, ast.Expr)], f"{path} holds code"


@pytest.fixture
def fake_package(tmp_path):
    """Write a small package under tmp_path/src/eyrie; returns a function (module path, source) -> None."""

    def write(module: str, source: str) -> None:
        path = tmp_path.joinpath(*module.split(".")).with_suffix(".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in path.relative_to(tmp_path).parents:
            if str(parent) != ".":
                (tmp_path / parent / "__init__.py").touch()
        path.write_text(source)

    return write


def test_the_check_finds_a_circle_an_upward_import_a_stage_reaching_past_a_format_and_a_driver_import(fake_package, tmp_path):
    fake_package("eyrie.core.errors", "")
    fake_package("eyrie.core.atomic", "def f():\n    from eyrie.target.model import load  # upward, lazily\n")
    fake_package("eyrie.target.model", "from eyrie.core import errors\n")
    fake_package("eyrie.hidden.cache", "from eyrie.hidden.extract import x\n")
    fake_package("eyrie.hidden.extract", "from eyrie.hidden.cache import y\n")
    fake_package("eyrie.training.inputs", "from eyrie.hidden.extract import z\nfrom eyrie.hidden.cache import w\n")
    fake_package("eyrie.generation.conversations", "from eyrie.tokens.shards import s\n")  # a later stage
    fake_package("eyrie.tokens.shards", "")
    graph = import_graph(tmp_path)
    assert circles(graph) == [["eyrie.hidden.cache", "eyrie.hidden.extract"]]
    assert graph["eyrie.target.model"] == {"eyrie.core.errors"}  # `from package import module` counts the module
    found = violations(graph)
    assert "eyrie.core.atomic imports eyrie.target.model: a lower layer may not import a higher one" in found
    assert any(v.startswith("eyrie.training.inputs imports eyrie.hidden.extract: another stage") for v in found)
    assert "eyrie.training.inputs imports the job driver eyrie.hidden.extract" in found
    assert any(v.startswith("eyrie.generation.conversations imports eyrie.tokens.shards: a stage reads only the stages before it") for v in found)
    assert not any("eyrie.hidden.cache: another stage" in v for v in found)  # a format module is fine


# --------------------------------------------------------------------------- tests import factories, never each other


def imported_test_modules(path: Path) -> list[str]:
    """Where the file imports a test module (any dotted part named test_*): shared helpers belong in factories.py,
    shared fixtures in conftest.py."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] + [f"{node.module or ''}.{alias.name}" for alias in node.names]
        else:
            continue
        found += [f"{path}:{node.lineno} imports {name.strip('.')}" for name in names if any(part.startswith("test_") for part in name.split("."))]
    return sorted(set(found))


def test_no_test_module_imports_another():
    files = sorted(TESTS.rglob("*.py"))
    assert len(files) > 20, "no test files found"
    assert [hit for path in files for hit in imported_test_modules(path)] == []


def test_the_check_finds_each_way_of_importing_a_test_module(tmp_path):
    source = tmp_path / "test_user.py"
    source.write_text(
        "import os\nfrom factories import tiny_llama\nfrom generation.test_openai_engine import STUB_SERVER\n"
        "import test_plan\nfrom report import test_build\n\n\ndef f():\n    from .test_local import x  # lazily, relatively\n"
    )
    found = imported_test_modules(source)
    assert [hit.split(":", 1)[1] for hit in found] == [
        "3 imports generation.test_openai_engine", "3 imports generation.test_openai_engine.STUB_SERVER", "4 imports test_plan",
        "5 imports report.test_build", "9 imports test_local", "9 imports test_local.x",
    ]
    source.write_text("import os\nfrom factories import tiny_llama\nfrom conftest import REPO\nimport testing_tools\n")
    assert imported_test_modules(source) == []
