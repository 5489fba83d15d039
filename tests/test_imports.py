"""The package's modules import each other without a cycle, counting function-local imports
(a cycle hidden inside a function is still a cycle: the two modules cannot be read, tested or
loaded one without the other)."""

import ast
from pathlib import Path

import bigbatch

ROOT = Path(bigbatch.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that ``path`` imports anywhere in its body (packages' own
    ``__init__`` left out: they only gather their submodules)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            target = f"{base}.{node.module}" if node.level and node.module else node.module or base
            candidates = [f"{target}.{alias.name}" for alias in node.names] + [target]
        elif isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            continue
        found.update(c for c in candidates if c in modules)
    return found


def graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in ROOT.rglob("*.py") if p.name != "__init__.py"}
    return {name: imported_modules(path, set(paths)) for name, path in paths.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_checker_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_graph_sees_relative_and_function_local_imports():
    edges = graph()
    assert "bigbatch.optim._fused" in edges["bigbatch.optim._base"]  # imported inside a method
    assert "bigbatch.engine" in edges["bigbatch.loop"]


def test_no_module_of_the_package_imports_itself_back():
    assert find_cycle(graph()) is None


def test_importing_bigbatch_leaves_dynamo_and_triton_unloaded():
    # both are heavy, and Triton must see TRITON_INTERPRET (tests/conftest.py) before it loads
    import subprocess
    import sys

    code = "import sys, bigbatch; print('torch._dynamo' in sys.modules, 'triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
