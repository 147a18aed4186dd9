"""The package's internal import graph: acyclic, and no internal imports inside functions.

Parses every module of ``megatron_fsdp`` with :mod:`ast` (nothing is imported),
builds the graph of module-level imports between its modules (imports under
``if TYPE_CHECKING:`` excluded), and checks that it has no cycle and that no
function imports a ``megatron_fsdp`` module (function-level imports are kept for
optional dependencies only: megatron-core, TransformerEngine, safetensors, ...).
See docs/design.md section 1 for the layers this guards.

Run as a script to print the graph's numbers: ``python tests/unit/test_import_graph.py``.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

PACKAGE = "megatron_fsdp"
PACKAGE_DIR = Path(__file__).resolve().parents[2] / PACKAGE


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module name a ``from ... import`` names."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(module: str, is_package: bool, node: ast.stmt, known: set[str]) -> list[str]:
    """The package modules an import statement depends on."""
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        source = _resolve(module, is_package, node)
        submodules = [f"{source}.{a.name}" for a in node.names if f"{source}.{a.name}" in known]
        # ``from pkg import submodule`` depends on the submodule, not on what ``pkg`` defines.
        names = submodules if len(submodules) == len(node.names) else [source, *submodules]
    return [n for n in names if n in known and n != module]


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(
    module: str,
    is_package: bool,
    body: list[ast.stmt],
    known: set[str],
    in_function: bool,
    edges: set[str],
    function_imports: list[str],
) -> None:
    """Add ``body``'s imports to ``edges`` (module level) or ``function_imports`` (inside a function)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            targets = _targets(module, is_package, node, known)
            if in_function:
                function_imports += [f"{module}:{node.lineno} -> {t}" for t in targets]
            else:
                edges.update(targets)
            continue
        if isinstance(node, ast.If) and _is_type_checking(node):
            _walk(module, is_package, node.orelse, known, in_function, edges, function_imports)
            continue
        nested = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for field in ("body", "orelse", "finalbody", "handlers"):
            children = getattr(node, field, None)
            if isinstance(children, list) and children and isinstance(children[0], (ast.stmt, ast.excepthandler)):
                _walk(module, is_package, children, known, in_function or nested, edges, function_imports)


def import_graph() -> tuple[dict[str, set[str]], list[str]]:
    """(module -> the package modules it imports at module level, function-level internal imports)."""
    modules = _modules()
    known = set(modules)
    graph: dict[str, set[str]] = {}
    function_imports: list[str] = []
    for name, path in modules.items():
        edges: set[str] = set()
        tree = ast.parse(path.read_text(), filename=str(path))
        _walk(name, path.name == "__init__.py", tree.body, known, False, edges, function_imports)
        graph[name] = edges
    return graph, function_imports


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_package_import_graph_is_acyclic() -> None:
    graph, _ = import_graph()
    cycles = find_cycles(graph)
    assert not cycles, "import cycles among megatron_fsdp modules:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_function_level_internal_imports() -> None:
    _, function_imports = import_graph()
    assert not function_imports, "imports of megatron_fsdp modules inside functions:\n" + "\n".join(function_imports)


if __name__ == "__main__":
    graph, function_imports = import_graph()
    subpackages = Counter(
        m.split(".")[1] if (PACKAGE_DIR / m.split(".")[1]).is_dir() else "(top level)" for m in graph if m != PACKAGE
    )
    print(f"modules: {len(graph)}", dict(sorted(subpackages.items())))
    print("cycles:", find_cycles(graph))
    print(f"function-level internal imports: {len(function_imports)}")
    for line in function_imports:
        print("  ", line)
