"""The package's layers depend only downwards (DESIGN.md), function-local imports included."""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "treedec"
# Top to bottom; a module may import its own layer and those below it. errors, checks (the argument checks), versions,
# transfer (host <-> device copies), workloads (recorded data and its builders), cache (the cache folder), outputs
# (what LLM returns: plain data) and lazy (the packages' lazy public names) sit beside tree at the bottom. core (the
# engine core and its clients) sits below llm and serve, its two users.
LAYERS = ["cli", "serve", "llm", "core", "programs", "runtime", "sampling", "replay", "engine", "models", "attention",
          "kernels", "tree"]
BOTTOM = {"errors", "checks", "versions", "transfer", "workloads", "cache", "outputs", "lazy", "tree"}
RANK = {**{name: len(LAYERS) - i for i, name in enumerate(LAYERS)}, **{name: 0 for name in BOTTOM}}


def _layer(parts: tuple[str, ...]) -> str:
    """The layer of a module, from its path parts inside treedec/ (top-level modules are the cli layer)."""
    top = parts[0].removesuffix(".py")
    return top if top in RANK else "cli"


def _imported_layers(path: Path) -> set[str]:
    layers = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
            [a.name for a in node.names] if isinstance(node, ast.Import) else []
        for name in names:
            if name.startswith("treedec."):
                layers.add(_layer(tuple(name.split(".")[1:2])))
    return layers


MODULES = sorted(p for p in PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down(path):
    own = _layer(path.relative_to(PACKAGE).parts)
    if path.parent == PACKAGE and path.stem in ("__init__", "__main__", "cli"):
        return  # the package's front door re-exports and dispatches to every layer
    above = sorted(layer for layer in _imported_layers(path) if RANK[layer] > RANK[own])
    assert not above, f"{path.relative_to(PACKAGE)} ({own} layer) imports from higher layers {above}"


@pytest.mark.slow
def test_package_imports_without_triton():
    """`pip install treedec` has no triton (it is the `triton` extra): every layer imports without it,
    the custom ops included (their kernels are imported when an op runs)."""
    import subprocess
    import sys
    code = ("import sys; sys.modules['triton'] = None\n"
            "import treedec, treedec.attention, treedec.models, treedec.engine, treedec.programs, treedec.runtime, "
            "treedec.sampling, treedec.replay\n"
            "import treedec.cli\n"
            "import torch; assert hasattr(torch.ops.treedec, 'tree_attention')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def _module_name(path: Path) -> str:
    parts = ("treedec",) + path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """Module -> the treedec modules it imports, function-local imports included (``from pkg import mod`` names
    the module ``pkg.mod``; ``from pkg import name`` the package ``pkg``, its face)."""
    modules = {_module_name(p): p for p in MODULES}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("treedec"):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    graph[name].add(sub if sub in modules else node.module)
            elif isinstance(node, ast.Import):
                graph[name].update(a.name for a in node.names if a.name in modules)
    return graph


def test_no_import_circles():
    """No module imports one that imports it back, directly or through others (DESIGN.md: a circle hidden by a
    function-local import is a design bug)."""
    graph = _import_graph()
    state: dict[str, int] = {}   # 1: on the current path, 2: done
    circles = []

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for nxt in sorted(graph.get(name, ())):
            if state.get(nxt) == 1:
                circles.append(path[path.index(nxt):] + [nxt] if nxt in path else [name, nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles[:5])


REPO = PACKAGE.parent
LONGEST = 500


@pytest.mark.parametrize("folder", ["treedec", "tests", "bench", "examples"])
def test_no_source_file_over_500_lines(folder):
    long = {str(p.relative_to(REPO)): n for p in (REPO / folder).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > LONGEST}
    assert not long, f"files over {LONGEST} lines (split them by concern): {long}"


def test_tests_mirror_the_packages():
    """tests/<package>/test_<module>.py for treedec's packages (bench/ for the benchmark scripts); only the house
    checks (layers, README, examples) and the tests of treedec's top-level modules
    (``treedec/checks.py``: ``tests/test_checks.py``) sit at the top."""
    packages = {str(p.parent.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")} | {"bench"}
    top = {"test_layers", "test_readme", "test_examples"} | {f"test_{p.stem}" for p in PACKAGE.glob("*.py")}
    tests = REPO / "tests"
    for path in tests.rglob("test_*.py"):
        folder = str(path.parent.relative_to(tests))
        if folder == ".":
            assert path.stem in top, f"{path.name}: move it under tests/<package>/"
        else:
            assert folder in packages, f"tests/{folder}/ mirrors no package of treedec (known: {sorted(packages)})"


# ================================================================ private reach

# Private names of objects that are not treedec's, reached where their owner gives no public one (not ours to
# rename). Private names of third-party *modules* (``torch._dynamo``, ``torch.ops._c10d_functional``) are told
# apart by the import that binds them and need no entry.
FOREIGN_PRIVATE = {
    "_actions": "argparse.ArgumentParser keeps no public list of a parser's arguments (commands/args.py)",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _root(node: ast.expr) -> ast.expr:
    """The start of an attribute chain: ``torch`` of ``torch.ops.x``, the call ``f()`` of ``f().x``."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node


def _private_reach(path: Path) -> list[tuple[str, int, str]]:
    """``(attribute, line, code)`` of each private reach in ``path``: ``X._name`` where ``X`` is not ``self``,
    ``cls``, ``super()`` or a class of the module itself (its class attributes, as ``cls`` would read them), nor a
    chain from a third-party module;
    ``getattr(X, "_name")`` and friends; ``from treedec.x import _name``."""
    tree = ast.parse(path.read_text())
    own_classes = {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    foreign = set()   # names the module binds to what is not treedec's: torch, np, nn, ...
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            foreign.update((a.asname or a.name).split(".")[0] for a in node.names if not a.name.startswith("treedec"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and not node.module.startswith("treedec"):
            foreign.update(a.asname or a.name for a in node.names)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            value, root = node.value, _root(node.value)
            if isinstance(value, ast.Name) and value.id in {"self", "cls"} | own_classes:
                continue
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super":
                continue
            if isinstance(root, ast.Name) and root.id in foreign:
                continue
            found.append((node.attr, node.lineno, ast.unparse(node)))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _private(node.args[1].value)
              and not (isinstance(node.args[0], ast.Name) and node.args[0].id in ("self", "cls"))):
            found.append((node.args[1].value, node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.ImportFrom) and (node.level or node.module.startswith("treedec")):
            found += [(a.name, node.lineno, f"from {node.module} import {a.name}")
                      for a in node.names if _private(a.name)]
        elif isinstance(node, ast.Import):
            found += [(a.name, node.lineno, f"import {a.name}") for a in node.names
                      if a.name.startswith("treedec") and any(_private(part) for part in a.name.split("."))]
    return sorted(found, key=lambda f: f[1])


def test_no_private_reach():
    """A module uses only the public names of treedec's other objects and modules (issue #36: a private name
    another module needs gets a public, documented method or property); FOREIGN_PRIVATE lists the third-party
    objects' private names reached, each with its reason, and every entry is still needed."""
    reaches, used = [], set()
    for path in MODULES:
        for name, line, code in _private_reach(path):
            if name in FOREIGN_PRIVATE:
                used.add(name)
            else:
                reaches.append(f"{path.relative_to(REPO)}:{line}: {code}")
    assert not reaches, "private names reached from outside their object:\n" + "\n".join(reaches)
    unused = sorted(set(FOREIGN_PRIVATE) - used)
    assert not unused, f"FOREIGN_PRIVATE entries no module needs any more: {unused}"
