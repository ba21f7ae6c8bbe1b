"""Structural rules of the code base: no import cycles in clover/, training/ or the whole tree, the training pipeline apart from its
experiments and recipes, a light CLI import and a torch-free ``--help``, short functions, no private names used across modules, no sys.path
edits outside tests, no method names compared outside the proposers' factory (and the drafter architectures'
config)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "clover"
CYCLE_FREE_PACKAGES = (PACKAGE, "training")  # training/ imports clover/, never the reverse
MAX_FUNCTION_LINES = 80
FUNCTION_DIRS = ("clover", "training", "export", "benchmarks", "scripts", "tests")  # trt_plugins/ is exempt


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _package_modules(packages: tuple[str, ...] | None = None) -> dict[str, Path]:
    return {_module_name(p): p for package in packages or (PACKAGE,) for p in sorted((ROOT / package).rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(node: ast.AST, type_checking: bool = False):
    """Every Import / ImportFrom in ``node`` at any depth (functions, classes, try blocks...), except under
    ``if TYPE_CHECKING:`` unless ``type_checking`` (its ``else`` branch does run, so it is kept)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        elif isinstance(child, ast.If) and _is_type_checking(child.test) and not type_checking:
            for other in child.orelse:
                yield from _import_nodes(ast.Module(body=[other], type_ignores=[]))
        else:
            yield from _import_nodes(child, type_checking)


def imported_modules(name: str, path: Path, modules: set[str], type_checking: bool = False) -> list[tuple[str, int]]:
    """(module of ``modules``, line) for each import in module ``name`` (``type_checking``: also those under
    ``if TYPE_CHECKING:``).

    ``import clover.a.b`` and ``from clover.a import b`` (b a submodule) import ``clover.a.b``; their implicit
    imports of the parent packages are not counted. ``from clover.a import x`` (x not a module) imports
    ``clover.a``. Relative imports are resolved against the module's package.
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in _import_nodes(tree, type_checking):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
            continue
        if node.level:
            base = package.split(".")
            base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        for alias in node.names:
            submodule = f"{source}.{alias.name}"
            found.append((submodule if submodule in modules else source, node.lineno))
    return [(module, line) for module, line in found if module in modules]


def import_graph(packages: tuple[str, ...] | None = None, type_checking: bool = False) -> dict[str, dict[str, int]]:
    """module -> {imported module of ``packages`` (default clover): first line}."""
    modules = _package_modules(packages)
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges: dict[str, int] = {}
        for target, line in imported_modules(name, path, set(modules), type_checking):
            edges.setdefault(target, line)
        graph[name] = edges
    return graph


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle per strongly connected component that has one (Tarjan, then a path inside the component)."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []
    counter = [0]

    def strongconnect(v: str) -> None:  # recursion depth is bounded by the number of modules
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            components.append(set(component))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    cycles = []
    for component in components:
        start = min(component)
        if len(component) == 1 and start not in graph[start]:
            continue
        # breadth-first from start back to start inside the component: a shortest cycle through it
        parents, frontier, end = {start: None}, [start], None
        while frontier and end is None:
            following = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w == start:
                        end = v
                        break
                    if w in component and w not in parents:
                        parents[w] = v
                        following.append(w)
                if end is not None:
                    break
            frontier = following
        path, v = [], end
        while v is not None:
            path.append(v)
            v = parents[v]
        cycles.append(path[::-1] + [start])
    return cycles


def test_cycle_finder_on_small_graphs():
    assert find_cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {}}) == []
    assert find_cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"a": 1}}) == [["a", "a"]]


def test_import_resolution(tmp_path, monkeypatch):
    package = tmp_path / PACKAGE
    (package / "sub").mkdir(parents=True)
    for name in ("__init__.py", "a.py", "sub/__init__.py", "sub/b.py", "sub/c.py"):
        (package / name).write_text("")
    (package / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import c\n"                        # a sibling submodule
        "from .. import a\n"                       # the parent's submodule
        "from clover.sub import helper\n"          # an attribute of the package: the package itself
        "def f():\n    import clover.a\n"          # function-level
        "if TYPE_CHECKING:\n    from clover.sub.c import T\n"
        "else:\n    from clover import sub\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    modules = set(_package_modules())
    assert modules == {"clover", "clover.a", "clover.sub", "clover.sub.b", "clover.sub.c"}
    found = imported_modules("clover.sub.b", package / "sub" / "b.py", modules)
    assert found == [("clover.sub.c", 2), ("clover.a", 3), ("clover.sub", 4), ("clover.a", 6), ("clover.sub", 10)]


def _cycle_report(graph: dict[str, dict[str, int]], packages: tuple[str, ...]) -> list[str]:
    paths, lines = _package_modules(packages), []
    for cycle in find_cycles(graph):
        hops = [f"{a} ({paths[a].relative_to(ROOT)}:{graph[a][b]}) -> {b}" for a, b in zip(cycle, cycle[1:])]
        lines.append(" | ".join(hops))
    return lines


def test_no_import_cycles_in_clover():
    graph = import_graph()
    assert len(graph) > 20 and graph["clover.decode"], "the import graph was not read"
    cycles = _cycle_report(graph, (PACKAGE,))
    assert not cycles, "import cycles among clover modules:\n" + "\n".join(cycles)


def test_no_import_cycles_in_training():
    """Function-level imports count. ``train`` and ``evaluate`` share the teacher-forced measure through
    training/accuracy.py (and the forward through training/forward.py), so neither imports the other."""
    graph = import_graph(CYCLE_FREE_PACKAGES)
    assert "training.accuracy" in graph["training.train"] and "training.accuracy" in graph["training.evaluate"], \
        "the graph was not read"
    assert "training.evaluate" not in graph["training.train"], "train.py reaches into the evaluation script"
    cycles = _cycle_report(graph, CYCLE_FREE_PACKAGES)
    assert not cycles, "import cycles among clover and training modules:\n" + "\n".join(cycles)


WHOLE_TREE = ("clover", "training", "scripts", "benchmarks", "tests", "export", "trt_plugins")  # every Python directory


def test_no_import_cycles_in_the_whole_tree():
    """Every directory of Python code together, with function-level imports and those under ``if TYPE_CHECKING:``
    counted: a circle is broken by moving what both sides share down a module (scripts/gpu_check_common.py,
    training/train_config.py), not hidden by importing later or only for the type checker."""
    graph = import_graph(WHOLE_TREE, type_checking=True)
    assert "scripts.gpu_check_common" in graph["scripts.gpu_check_engine"] and \
        "training.train_config" in graph["training.run_dir"] and "tests.helpers" in graph, "the graph was not read"
    cycles = _cycle_report(graph, WHOLE_TREE)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_type_checking_imports_count_where_asked(tmp_path, monkeypatch):
    package = tmp_path / PACKAGE
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from clover import b\n")
    (package / "b.py").write_text("from clover import a\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert find_cycles(import_graph()) == []
    assert find_cycles(import_graph(type_checking=True)) == [["clover.a", "clover.b", "clover.a"]]


EXPERIMENTS = "training.experiments"  # one-off probes: they import the pipeline, never the reverse


def pipeline_imports_of_experiments(graph: dict[str, dict[str, int]]) -> list[str]:
    """``module -> experiment`` for each import of training/experiments/ by a training module outside it."""
    return [f"{module} -> {target}" for module, edges in sorted(graph.items())
            if module.startswith("training") and not (module == EXPERIMENTS or module.startswith(EXPERIMENTS + "."))
            for target in edges if target == EXPERIMENTS or target.startswith(EXPERIMENTS + ".")]


def test_the_pipeline_does_not_import_the_experiments():
    """training/experiments/ (probes, ``python -m training.experiments.X``) builds on the pipeline; no module of
    the pipeline imports it (function-level imports count), so an experiment can go without breaking a stage."""
    graph = import_graph(CYCLE_FREE_PACKAGES)
    assert "training.train" in graph[f"{EXPERIMENTS}.cost_probe"], "the graph was not read"
    assert EXPERIMENTS in graph and f"{EXPERIMENTS}.snapshot_heads" in graph, "training/experiments/ is no package"
    assert pipeline_imports_of_experiments({"training.train": {f"{EXPERIMENTS}.cost_probe": 3}}) == [
        f"training.train -> {EXPERIMENTS}.cost_probe"]
    found = pipeline_imports_of_experiments(graph)
    assert not found, "the pipeline imports an experiment:\n" + "\n".join(found)


def test_no_shell_script_at_the_root_of_training():
    """Shell recipes live in training/recipes/; training/ itself holds the pipeline's modules and configs/."""
    recipes = sorted(p.name for p in (ROOT / "training" / "recipes").glob("*.sh"))
    assert "install_sources.sh" in recipes and "pilot.sh" in recipes, "training/recipes/ was not read"
    found = sorted(p.name for p in (ROOT / "training").iterdir()
                   if p.is_file() and (p.suffix == ".sh" or p.read_bytes().startswith(b"#!")))
    assert not found, f"shell scripts at the root of training/ (move them to training/recipes/): {found}"


def test_the_core_does_not_import_the_benchmark():
    """clover/bench/ measures the product; nothing else in clover/ imports it (function-level imports count)."""
    graph = import_graph()
    assert "clover.bench.genai" in graph["clover.bench.sweeps"], "the graph was not read"
    found = [f"{module} -> {target}" for module, edges in graph.items() if not module.startswith("clover.bench")
             for target in edges if target == "clover.bench" or target.startswith("clover.bench.")]
    assert not found, "the core imports the benchmark:\n" + "\n".join(found)


def test_cli_import_does_not_load_the_serving_package():
    code = ("import sys, clover.cli; "
            "print('\\n'.join(m for m in sys.modules if m == 'clover.serving' or m.startswith('clover.serving.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = out.stdout.split()
    assert not loaded, f"import clover.cli loads {loaded}"


HELP_COMMANDS = ([], ["generate"], ["serve"], ["client"], ["build"])
LOADED_MARK = "loaded torch modules:"


def help_output(command: list[str]) -> tuple[str, list[str]]:
    """(the help text, the torch modules loaded) of ``clover COMMAND --help``, in a fresh interpreter."""
    code = ("import sys\nfrom clover.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            f"print({LOADED_MARK!r}, *sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))\n")
    out = subprocess.run([sys.executable, "-c", code, *command, "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and LOADED_MARK in out.stdout, out.stderr
    text, _, loaded = out.stdout.rpartition(LOADED_MARK)
    return text, loaded.split()


def test_help_imports_no_torch():
    """``clover --help`` and every command's ``--help`` answer without importing torch, which took most of their
    3 s (issue 57); counted in a subprocess, not timed."""
    for command in HELP_COMMANDS:
        text, loaded = help_output(command)
        assert text.startswith(" ".join(["usage: clover", *command])), text[:200]
        assert not loaded, f"clover {' '.join(command)} --help imports {loaded[:5]}"


def test_help_names_the_defaults_of_cache_dir_and_threads():
    assert "(default: $CLOVER_CACHE_DIR, else ~/.cache/clover)" in " ".join(help_output(["build"])[0].split())
    assert "default: each library's own choice" in " ".join(help_output(["generate"])[0].split())


def long_functions() -> list[str]:
    found = []
    for directory in FUNCTION_DIRS:
        for path in sorted((ROOT / directory).rglob("*.py")):
            if "trt_plugins" in path.relative_to(ROOT).parts:
                continue
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    length = node.end_lineno - node.lineno + 1  # from `def` to the last body line
                    if length > MAX_FUNCTION_LINES:
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_function_longer_than_80_lines():
    found = long_functions()
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(found)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _skipped(parts: tuple[str, ...]) -> bool:
    """Test folders (tests/, trt_plugins/tests/) may use private names and edit sys.path; hidden folders, virtual
    environments and build outputs are not the code base."""
    return any(p.startswith(".") or p in ("tests", "build", "dist", "site-packages") for p in parts[:-1])


def source_files(root: Path | None = None) -> list[Path]:
    """Every .py file of the code base outside tests/."""
    root = root or ROOT
    return [p for p in sorted(root.rglob("*.py")) if not _skipped(p.relative_to(root).parts)]


DOCUMENTED_UNDERSCORE = ("os._exit",)  # the standard library's documented API despite the underscore


def private_name_uses(path: Path, root: Path | None = None) -> list[str]:
    """``from X import _name`` and ``X._name`` where X is a name bound by an import (a module, or a name taken
    from one): a module reaching into another's private names. Dunder names (``__version__``) are public."""
    tree = ast.parse(path.read_text(), filename=str(path))
    where = path.relative_to(root or ROOT)
    imported, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.asname or alias.name.partition(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported |= {alias.asname or alias.name for alias in node.names}
            found += [f"{where}:{node.lineno} from {'.' * node.level}{node.module or ''} import {alias.name}"
                      for alias in node.names if _is_private(alias.name)]
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and _is_private(node.attr) and isinstance(node.value, ast.Name)
                and node.value.id in imported and f"{node.value.id}.{node.attr}" not in DOCUMENTED_UNDERSCORE):
            found.append(f"{where}:{node.lineno} {node.value.id}.{node.attr}")
    return found


def test_private_name_check_catches_both_forms(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "t.py").write_text("from clover.client import _hidden\n")  # tests/ may
    (tmp_path / "bad.py").write_text("import clover.client as client\nfrom clover import cli\n"
                                     "from clover.client import _hidden, __version__\n"
                                     "x = client._hidden + cli._main + client.public\nimport os\nos._exit(0)\n")
    found = [use for path in source_files(tmp_path) for use in private_name_uses(path, tmp_path)]
    assert found == ["bad.py:3 from clover.client import _hidden", "bad.py:4 client._hidden", "bad.py:4 cli._main"]


def test_no_private_names_used_across_modules():
    files = source_files()
    assert len(files) > 50, "the code base was not read"
    found = [use for path in files for use in private_name_uses(path)]
    assert not found, "private names used across modules (make them public or move them):\n" + "\n".join(found)


SYS_PATH_EXEMPT: tuple[str, ...] = ()  # none: every module outside tests/ imports the installed package
SYS_PATH_METHODS = ("insert", "append", "extend", "remove", "pop", "clear")


def _is_sys_path(node: ast.AST) -> bool:
    """``sys.path`` itself, or an item or slice of it."""
    if isinstance(node, ast.Subscript):
        node = node.value
    return (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
            and node.value.id == "sys")


def _edits_sys_path(node: ast.AST) -> bool:
    if isinstance(node, ast.Call):
        return (isinstance(node.func, ast.Attribute) and node.func.attr in SYS_PATH_METHODS
                and _is_sys_path(node.func.value))
    if isinstance(node, (ast.Assign, ast.Delete)):
        return any(_is_sys_path(target) for target in node.targets)
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return _is_sys_path(node.target)
    return False


def sys_path_edits(path: Path, root: Path | None = None) -> list[str]:
    """Each place in one file that changes ``sys.path`` (calls of its list methods, assignments, ``del``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    where = path.relative_to(root or ROOT)
    return [f"{where}:{line}" for line in sorted(node.lineno for node in ast.walk(tree) if _edits_sys_path(node))]


def test_sys_path_check_catches_every_form(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "t.py").write_text("import sys\nsys.path.insert(0, 'x')\n")  # tests/ may
    (tmp_path / "bad.py").write_text("import sys\nsys.path.insert(0, 'a')\nsys.path.append('b')\n"
                                     "sys.path[:0] = ['c']\nsys.path += ['d']\nsys.path = []\n"
                                     "print(sys.path[0], 'x' in sys.path)\n")
    found = [edit for path in source_files(tmp_path) for edit in sys_path_edits(path, tmp_path)]
    assert found == [f"bad.py:{line}" for line in (2, 3, 4, 5, 6)]


def test_no_sys_path_edits_outside_tests():
    """training/, benchmarks/ and scripts/ run as ``python -m PACKAGE.MODULE`` from the repository root (the GPU
    check's wrapper sets PYTHONPATH), so they import clover, training... as packages."""
    files = source_files()
    assert len(files) > 50, "the code base was not read"
    found = [edit for path in files if str(path.relative_to(ROOT)) not in SYS_PATH_EXEMPT
             for edit in sys_path_edits(path)]
    assert not found, "sys.path edited outside tests/ (run the script with python -m instead):\n" + "\n".join(found)


# Decoding methods are named in clover/methods.py (METHODS, method_traits), clover/proposers.py (the factory) and
# drafter architectures in clover/config.py (DRAFTER_METHODS, DrafterConfig's capabilities); everywhere else asks
# their traits, never compares a name (issue 46).
METHOD_NAME_HOMES = ("clover/methods.py", "clover/proposers.py", "clover/config.py")
AUTO = "auto"  # a method name only where compared with something named method (backend, device... use it too)


def method_vocabulary() -> frozenset[str]:
    from clover.config import DRAFTER_METHODS
    from clover.methods import METHODS

    return frozenset(METHODS) | frozenset(DRAFTER_METHODS)


def _string_constants(node: ast.expr) -> list[str]:
    """The string constants of ``node``: itself, or the items of a literal tuple, list or set (starred ones too)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for item in node.elts for s in _string_constants(item.value if isinstance(item, ast.Starred)
                                                                      else item)]
    return []


def _names_a_method(node: ast.expr) -> bool:
    """Whether ``node`` (a name, attribute, subscript or call) mentions ``method`` (``args.method``,
    ``s["method"]``, ``method``...)."""
    return not _string_constants(node) and "method" in ast.unparse(node).lower()


def method_name_comparisons(path: Path, vocabulary: frozenset[str], root: Path | None = None) -> list[str]:
    """Each comparison with a method name in one file (``x == "vanilla"``, ``m in ("suffix", "clover2")``,
    ``"medusa" in engines``; ``"auto"`` only against something named method), and each argparse ``choices=``
    literal holding one (the choices come from the factory's constant)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    where, found = path.relative_to(root or ROOT), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            named = set().union(*(set(_string_constants(o)) for o in operands)) & vocabulary
            if AUTO in {s for o in operands for s in _string_constants(o)} and any(map(_names_a_method, operands)):
                named.add(AUTO)
            if named:
                found.append(f"{where}:{node.lineno} {ast.unparse(node)}")
        elif isinstance(node, ast.keyword) and node.arg == "choices" and set(_string_constants(node.value)) & vocabulary:
            found.append(f"{where}:{node.value.lineno} choices={ast.unparse(node.value)}")
    return found


def test_method_name_check_catches_every_form(tmp_path):
    (tmp_path / "clover").mkdir()
    (tmp_path / "clover" / "proposers.py").write_text("ok = method == 'vanilla'\n")  # the factory may
    (tmp_path / "clover" / "bad.py").write_text(
        "a = args.method != 'vanilla'\nb = m in ('suffix', 'clover2')\nc = 'medusa' in engines\n"
        "d = method == 'auto'\ne = x in (*OTHERS, 'clover-no-augment')\n"
        "p.add_argument('--method', choices=['auto', 'clover'])\n"
        "fine = backend == 'auto' or device in ('auto', 'cpu') or name == 'clover+suffix'\n"
        "p.add_argument('--backend', choices=['auto', 'torch'])\nq = s['method'] == VANILLA_LINE\n")
    vocabulary = frozenset({"vanilla", "medusa", "clover", "clover2", "suffix", "clover-no-augment"})
    found = [use for path in sorted((tmp_path / "clover").rglob("*.py"))
             if str(path.relative_to(tmp_path)) not in METHOD_NAME_HOMES
             for use in method_name_comparisons(path, vocabulary, tmp_path)]
    assert [use.split()[0] for use in found] == [f"clover/bad.py:{line}" for line in (1, 2, 3, 4, 5, 6)], found


def test_no_method_name_comparisons_outside_the_factory():
    """A call site asks :func:`clover.methods.method_traits` (or a :class:`~clover.config.DrafterConfig`
    capability) what a method does, so a new method is one entry in the factory, not a hunt through the code."""
    vocabulary = method_vocabulary()
    files = [p for p in sorted((ROOT / PACKAGE).rglob("*.py")) if str(p.relative_to(ROOT)) not in METHOD_NAME_HOMES]
    assert len(files) > 30, "the package was not read"
    found = [use for path in files for use in method_name_comparisons(path, vocabulary)]
    assert not found, ("method names compared outside clover/methods.py, clover/proposers.py and clover/config.py "
                       "(ask methods.method_traits or a DrafterConfig capability):\n" + "\n".join(found))
