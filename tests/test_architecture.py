"""The shape of the code, kept true by tests that fail when it breaks.

The import graph is read from the source: every ``import`` and ``from ... import`` anywhere in a
module (function-level and ``TYPE_CHECKING`` ones included), relative imports resolved, and the
repository's folders mapped to their import names as pyproject.toml maps them. Then:

- no import cycle between modules;
- ir/ (data) imports nothing of the package above it, only ``xirang.ir.*``;
- the lower layers (ir/, passes/, codegen/) never import the API package (xirang_compile/);
- no ``from x import _name`` of a private name across modules, in tests, benchmarks and examples too;
- every ``folder/file.py`` a docstring or README of the package (or docs/architecture.md) names exists, and
  every bare ``file.py`` is the name of a file of the repository; each folder's README names its files;
  the page's table of passes is the pass lists.

A statement ``from a.b import c`` is an edge to the module ``a.b.c`` when that is a module of the
repository, else to ``a.b`` (or the deepest package above it that is one). The last tests run the
checks on a small made-up set of modules, so a checker that finds nothing cannot pass unnoticed.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
# repository folder -> import name ([tool.setuptools.package-dir] in pyproject.toml)
PACKAGE_DIRS = {"xirang_compile": "xirang", "ir": "xirang.ir", "passes": "xirang.passes", "codegen": "xirang.codegen"}
API_DIR = "xirang_compile"
LOWER_DIRS = ("ir", "passes", "codegen")
SIDE_DIRS = ("tests", "benchmarks", "examples")  # use the package; not part of it
BARE_NAME_DIRS = ("tests", "benchmarks")  # on sys.path when their files run: `from conftest import ...`
MAX_CYCLES_SHOWN = 20


@dataclass(frozen=True)
class Module:
    name: str
    folder: str  # the repository's top-level folder holding the file
    source: str
    is_package: bool
    path: str  # for messages, relative to the repository


@dataclass(frozen=True)
class Import:
    importer: str
    target: str  # the deepest module of the repository the statement names
    name: str  # the name a `from` import takes from ``target``'s module ("" for `import x`)
    base: str  # the module a `from` import reads (resolved), "" for `import x`
    where: str  # "ir/plan.py:21"


def module_name(relative: Path) -> str:
    parts = list(relative.with_suffix("").parts)
    parts[0] = PACKAGE_DIRS.get(parts[0], parts[0])
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def repository_modules(root: Path = ROOT) -> dict[str, Module]:
    """Every Python file of the package folders and of tests/, benchmarks/, examples/, by import name
    (files directly in tests/ or benchmarks/ also under their bare name, as they import each other)."""
    modules = {}
    for top in (*PACKAGE_DIRS, *SIDE_DIRS):
        for path in sorted((root / top).rglob("*.py")):
            relative = path.relative_to(root)
            if ".venv" in relative.parts or "golden" in relative.parts:  # golden: emitted programs
                continue
            module = Module(module_name(relative), top, path.read_text(), path.name == "__init__.py",
                            relative.as_posix())
            modules[module.name] = module
            if top in BARE_NAME_DIRS and len(relative.parts) == 2:
                modules.setdefault(path.stem, module)
    return modules


def _deepest_known(name: str, modules) -> str:
    while name and name not in modules:
        name = name.rsplit(".", 1)[0] if "." in name else ""
    return name


def imports_of(module: Module, modules) -> list[Import]:
    """Every import statement of ``module``, anywhere in it, that names a module of the repository."""
    found = []
    package = module.name if module.is_package else module.name.rpartition(".")[0]
    for node in ast.walk(ast.parse(module.source, module.path)):
        where = f"{module.path}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".") if package else []
                up = up[:len(up) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                target = _deepest_known(full if full in modules else base, modules)
                if target:
                    found.append(Import(module.name, target, alias.name, base, where))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                target = _deepest_known(alias.name, modules)
                if target:
                    found.append(Import(module.name, target, "", "", where))
    return found


def all_imports(modules) -> list[Import]:
    seen, found = set(), []
    for module in modules.values():
        if module.path not in seen:  # a bare-name alias is the same file
            seen.add(module.path)
            found += imports_of(module, modules)
    return found


def _in_package(name: str, modules) -> bool:
    return modules[name].folder in PACKAGE_DIRS


def import_graph(modules, imports) -> nx.DiGraph:
    """Modules of the package and their imports of each other; each edge lists where it is made."""
    graph = nx.DiGraph()
    graph.add_nodes_from(name for name in modules if _in_package(name, modules))
    for imp in imports:
        if imp.importer != imp.target and _in_package(imp.importer, modules) and _in_package(imp.target, modules):
            if not graph.has_edge(imp.importer, imp.target):
                graph.add_edge(imp.importer, imp.target, where=[])
            where = graph.edges[imp.importer, imp.target]["where"]
            if imp.where not in where:  # `from a import b, c` is one place
                where.append(imp.where)
    return graph


def import_cycles(graph: nx.DiGraph) -> list[list[str]]:
    """Each simple cycle once, starting at its smallest name."""
    return sorted(_rotated(cycle) for cycle in nx.simple_cycles(graph) if len(cycle) > 1)


def _rotated(cycle: list[str]) -> list[str]:
    start = cycle.index(min(cycle))
    return cycle[start:] + cycle[:start]


def describe_cycles(graph: nx.DiGraph, cycles: list[list[str]]) -> str:
    lines = []
    for cycle in cycles[:MAX_CYCLES_SHOWN]:
        lines.append("  " + " -> ".join(cycle + cycle[:1]))
        for a, b in zip(cycle, cycle[1:] + cycle[:1]):
            lines.append(f"      {a} -> {b}: {', '.join(graph.edges[a, b]['where'])}")
    if len(cycles) > MAX_CYCLES_SHOWN:
        lines.append(f"  ... and {len(cycles) - MAX_CYCLES_SHOWN} more")
    return "\n".join(lines)


def ir_upward_imports(modules, imports) -> list[str]:
    """Imports in ir/ of any module of the repository outside ``xirang.ir``."""
    return sorted(f"{imp.importer} -> {imp.target} ({imp.where})" for imp in imports
                  if modules[imp.importer].folder == "ir" and modules[imp.target].folder != "ir")


def lower_to_api_imports(modules, imports) -> list[str]:
    """Imports in ir/, passes/ or codegen/ of a module of the API package (xirang_compile/)."""
    return sorted(f"{imp.importer} -> {imp.target} ({imp.where})" for imp in imports
                  if modules[imp.importer].folder in LOWER_DIRS and modules[imp.target].folder == API_DIR)


def private_imports(modules, imports) -> list[str]:
    """``from x import _name`` where ``x`` is another module of the repository."""
    return sorted(f"{imp.importer} imports {imp.base}.{imp.name} ({imp.where})" for imp in imports
                  if imp.name.startswith("_") and not imp.name.startswith("__") and imp.base in modules
                  and modules[imp.base].path != modules[imp.importer].path)


# --- the repository ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def repo():
    modules = repository_modules()
    return modules, all_imports(modules)


def test_no_import_cycle_between_modules(repo):
    modules, imports = repo
    graph = import_graph(modules, imports)
    cycles = import_cycles(graph)
    assert not cycles, (f"{len(cycles)} import cycles (move what both sides need into a module below "
                        f"them both):\n{describe_cycles(graph, cycles)}")


def test_ir_imports_nothing_above_it(repo):
    found = ir_upward_imports(*repo)
    assert not found, "ir/ holds data and imports only xirang.ir.*; it imports:\n  " + "\n  ".join(found)


def test_lower_layers_never_import_the_api_package(repo):
    found = lower_to_api_imports(*repo)
    assert not found, ("ir/, passes/ and codegen/ must not import xirang_compile/ (xirang.cli, xirang.analyze, ...); "
                       "they import:\n  " + "\n  ".join(found))


def test_no_private_name_imported_across_modules(repo):
    found = private_imports(*repo)
    assert not found, ("underscore names are private to their module; make the name public or move the "
                       "code:\n  " + "\n  ".join(found))


def test_the_folder_map_is_the_one_pyproject_installs():
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert {folder: name for name, folder in config["tool"]["setuptools"]["package-dir"].items()} == PACKAGE_DIRS
    on_disk = {module_name(p.parent.relative_to(ROOT) / "__init__.py") for top in PACKAGE_DIRS
               for p in (ROOT / top).rglob("__init__.py")}
    assert on_disk == set(config["tool"]["setuptools"]["packages"])


# --- file paths in the prose --------------------------------------------------------------------

DOCUMENTS = ("docs/architecture.md",)  # besides every README.md under the package folders
PATH_MENTION = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.py)\b")
# what the prose names that is not a file of this repository: other projects' files and placeholders
NOT_OURS = ("torch/", "deepspeed/", "path/to/")
PLACEHOLDERS = {"file.py", "model.py"}  # `FILE.py:line` in the format of a message


def docstrings(source: str, filename: str) -> list[str]:
    """The docstrings of a module, its classes and its functions."""
    nodes = ast.walk(ast.parse(source, filename))
    return [doc for node in nodes if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            for doc in [ast.get_docstring(node, clean=False)] if doc]


def missing_paths(texts, root: Path = ROOT) -> list[str]:
    """``(path of the text, text)`` pairs -> each ``.py`` path a text names that is not there. A path with a folder
    is read from the repository root or from the text's folder or one above it (``state/weight_init.py`` in
    codegen/runtime/); a bare name must be some file's name."""
    names = {p.name for top in (*PACKAGE_DIRS, *SIDE_DIRS) for p in (root / top).rglob("*.py")}
    missing = []
    for where, text in texts:
        folders = [root / parent for parent in Path(where).parents]  # its own folder, ..., the repository root
        for mention in sorted(set(PATH_MENTION.findall(text))):
            if mention.startswith(NOT_OURS) or mention in PLACEHOLDERS:
                continue
            found = mention in names if "/" not in mention else any((f / mention).is_file() for f in folders)
            if not found:
                missing.append(f"{where}: {mention}")
    return missing


def test_every_file_the_docstrings_and_readmes_name_exists():
    texts = [(p.relative_to(ROOT).as_posix(), p.read_text())
             for top in PACKAGE_DIRS for p in sorted((ROOT / top).rglob("README.md"))]
    texts += [(name, (ROOT / name).read_text()) for name in DOCUMENTS]
    for module in repository_modules().values():
        if module.folder in PACKAGE_DIRS:
            texts += [(module.path, doc) for doc in docstrings(module.source, module.path)]
    missing = missing_paths(texts)
    assert not missing, "the prose names files that are not there (moved or renamed?):\n  " + "\n  ".join(missing)


def test_the_path_check_finds_a_moved_file(tmp_path):
    (tmp_path / "codegen/runtime/state").mkdir(parents=True)
    (tmp_path / "codegen/runtime/state/weight_init.py").write_text("")
    texts = [("codegen/runtime/compiled_model.py", "state/weight_init.py, codegen/runtime/state/weight_init.py, "
                                                    "weight_init.py, torch/__init__.py, path/to/file.py"),
             ("codegen/runtime/README.md", "codegen/runtime/weight_init.py and codegen/schedules.py, grad_sync.py")]
    assert missing_paths(texts, tmp_path) == ["codegen/runtime/README.md: codegen/runtime/weight_init.py",
                                              "codegen/runtime/README.md: codegen/schedules.py",
                                              "codegen/runtime/README.md: grad_sync.py"]




def test_every_folder_of_the_package_has_a_readme_naming_its_files():
    """Each folder's README names each of its modules (``file.py``, or a ``prefix*.py`` for a family)."""
    unnamed = []
    for top in PACKAGE_DIRS:
        for folder in sorted({p.parent for p in (ROOT / top).rglob("*.py")}):
            readme = folder / "README.md"
            where = folder.relative_to(ROOT).as_posix()
            if not readme.is_file():
                unnamed.append(f"{where}/ has no README.md")
                continue
            text = readme.read_text()
            families = re.findall(r"`([\w]+)\*\.py`", text)
            unnamed += [f"{where}/README.md: {p.name}" for p in sorted(folder.glob("*.py"))
                        if not p.name.startswith("__") and p.name not in text
                        and not any(p.name.startswith(prefix) for prefix in families)]
    assert not unnamed, "say in the folder's README what lives in these files:\n  " + "\n  ".join(unnamed)

def test_the_pass_table_of_the_architecture_page_is_the_pass_lists():
    """docs/architecture.md's table of passes: each row's pass in the lists' order, in the file it names."""
    import inspect
    from xirang.pipeline import ANALYSIS_PASSES, LOWERING_PASSES
    rows = re.findall(r"^\| \w+ \| `(\w+)` \| ([\w/]+\.py) \|", (ROOT / "docs/architecture.md").read_text(), re.M)
    actual = [(p.name, Path(inspect.getsourcefile(p.fn)).resolve().relative_to(ROOT).as_posix())
              for p in (*ANALYSIS_PASSES, *LOWERING_PASSES)]
    assert rows == actual


# --- the checks catch what they should -----------------------------------------------------------

def made_up(sources: dict[str, tuple[str, str]]) -> dict[str, Module]:
    """Modules from ``{name: (folder, source)}``; a name ending in ``/`` is a package (its __init__)."""
    modules = {}
    for key, (folder, source) in sources.items():
        name, is_package = key.rstrip("/"), key.endswith("/")
        path = name.replace(".", "/") + ("/__init__.py" if is_package else ".py")
        modules[name] = Module(name, folder, source, is_package, path)
    return modules


SOUND = {
    "xirang/": ("xirang_compile", "from xirang.ir.plan import Plan\nfrom xirang import explain\n"),
    "xirang.explain": ("xirang_compile", "from xirang.ir.plan import Plan\nfrom xirang.ir.checks import check_int\n"),
    "xirang.ir/": ("ir", ""),
    "xirang.ir.checks": ("ir", "import math\n\ndef _helper():\n    pass\n\ndef check_int():\n    _helper()\n"),
    "xirang.ir.plan": ("ir", "from .checks import check_int\n\nclass Plan:\n    def explain(self):\n"
                             "        from xirang.ir.checks import check_int\n"),
    "xirang.passes/": ("passes", ""),
    "xirang.passes.a": ("passes", "import torch\nfrom ..ir import plan\nfrom . import b\n"),
    "xirang.passes.b": ("passes", "from __future__ import annotations\nimport xirang.ir.plan\n"),
    "tests.test_x": ("tests", "from xirang.passes.a import __doc__\nfrom xirang.ir.checks import check_int\n"),
}


def checked(sources):
    modules = made_up(sources)
    imports = all_imports(modules)
    return (import_cycles(import_graph(modules, imports)), ir_upward_imports(modules, imports),
            lower_to_api_imports(modules, imports), private_imports(modules, imports))


def test_a_sound_made_up_package_passes():
    assert checked(SOUND) == ([], [], [], [])


def test_the_checks_catch_each_kind_of_violation():
    broken = dict(SOUND)
    # a deferred import up to the API package: a cycle, an upward import and a lower -> API import
    broken["xirang.ir.plan"] = ("ir", "class Plan:\n    def explain(self):\n"
                                      "        from xirang.explain import render\n")
    # a relative import of the sibling package's private helper, and a cycle between two passes
    broken["xirang.passes.a"] = ("passes", "from ..ir.checks import _helper\nfrom . import b\n")
    broken["xirang.passes.b"] = ("passes", "import xirang.passes.a\n")
    broken["tests.test_x"] = ("tests", "from xirang.ir.checks import _helper as helper\n")
    broken["xirang.codegen/"] = ("codegen", "")
    broken["xirang.codegen.run"] = ("codegen", "def run():\n    import xirang.explain\n")
    cycles, upward, to_api, private = checked(broken)
    assert cycles == [["xirang.explain", "xirang.ir.plan"], ["xirang.passes.a", "xirang.passes.b"]]
    assert upward == ["xirang.ir.plan -> xirang.explain (xirang/ir/plan.py:3)"]
    assert to_api == ["xirang.codegen.run -> xirang.explain (xirang/codegen/run.py:2)",
                      "xirang.ir.plan -> xirang.explain (xirang/ir/plan.py:3)"]
    assert private == ["tests.test_x imports xirang.ir.checks._helper (tests/test_x.py:1)",
                       "xirang.passes.a imports xirang.ir.checks._helper (xirang/passes/a.py:1)"]
    graph = import_graph(made_up(broken), all_imports(made_up(broken)))
    assert "xirang.passes.b -> xirang.passes.a: xirang/passes/b.py:1" in describe_cycles(graph, cycles)
