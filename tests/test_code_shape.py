"""The shape of the library code: file and function sizes, no import cycles between its
modules, and no environment switches in code and docs."""

from __future__ import annotations

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("spec_runtime", "protocol", "target_proc", "draft_proc")
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60
# Library files and functions allowed over the limits (none).
LONG_FILES: set[str] = set()
LONG_FUNCTIONS: set[str] = set()


def _sources():
    for pkg in PACKAGES:
        for d, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in sorted(files):
                if f.endswith(".py"):
                    path = os.path.join(d, f)
                    with open(path) as fh:
                        yield os.path.relpath(path, ROOT), fh.read()


def test_files_and_functions_fit_a_screen():
    long_files, long_functions = set(), set()
    for rel, src in _sources():
        if src.count("\n") > MAX_FILE_LINES:
            long_files.add(rel)
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                    long_functions.add(f"{rel}:{node.name}")
    assert long_files <= LONG_FILES, f"files over {MAX_FILE_LINES} lines: {sorted(long_files - LONG_FILES)}"
    assert long_functions <= LONG_FUNCTIONS, (
        f"functions over {MAX_FUNCTION_LINES} lines: {sorted(long_functions - LONG_FUNCTIONS)}")


def _module(rel: str) -> str:
    mod = rel[:-3].replace(os.sep, ".")
    return mod[: -len(".__init__")] if mod.endswith(".__init__") else mod


def _top_level_imports(src: str, mod: str, known: set[str]) -> set[str]:
    """The package modules `mod` imports when it is imported (not inside functions)."""
    out = set()
    for node in ast.parse(src).body:
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = mod.split(".")[: -node.level] if not mod.endswith("__init__") else mod.split(".")
                base = ".".join(parts + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        out |= {n for n in names if n in known}
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of `graph` (module -> the modules it imports), or []."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> list[str]:
        state[m] = 1
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n):] + [m, n] if n in path else [m, n]
            if n not in state and (found := visit(n, path + [m])):
                return found
        state[m] = 2
        return []

    for m in sorted(graph):
        if m not in state and (found := visit(m, [])):
            return found
    return []


def test_no_import_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []
    sources = {_module(rel): src for rel, src in _sources()}
    graph = {m: _top_level_imports(src, m, set(sources)) - {m} for m, src in sources.items()}
    assert sum(map(len, graph.values())) > 100  # the graph is read, not empty
    cycle = find_cycle(graph)
    assert not cycle, f"import cycle: {' -> '.join(cycle)}"


def test_no_environment_switches():
    """Behaviour is chosen by flags and config, not by SPEC_RUNTIME_* variables (the API
    key's variable, which vLLM users know as VLLM_API_KEY, is a credential, not a switch)."""
    switch = re.compile(r"\bSPEC_RUNTIME_(?!API_KEY\b)[A-Z_]+")
    found = []
    docs = [os.path.join(ROOT, "README.md")] + [os.path.join(ROOT, "docs", f)
                                                  for f in os.listdir(os.path.join(ROOT, "docs"))]
    texts = [(rel, src) for rel, src in _sources()]
    for path in docs:
        with open(path) as f:
            texts.append((os.path.relpath(path, ROOT), f.read()))
    for rel, text in texts:
        for i, line in enumerate(text.splitlines(), 1):
            if switch.search(line):
                found.append(f"{rel}:{i}: {line.strip()}")
    assert not found, "\n".join(found)
