"""The import graph of the packages has no circles.

Every `import` statement counts, at module level or inside a function (a lazy import
still ties two modules together). Modules are read as text, nothing is imported.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("spec_runtime", "target_proc", "draft_proc", "protocol")


def _modules() -> dict[str, str]:
    mods = {}
    for pkg in PACKAGES:
        for d, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(d, f)
                    mods[os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")] = path
    return mods


def _graph(mods: dict[str, str]) -> dict[str, set[str]]:
    graph = {}
    for name, path in mods.items():
        deps = set()
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            deps.update(t for t in targets if t in mods and t != name)
        graph[name] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_walk_sees_the_imports():
    graph = _graph(_modules())
    assert "spec_runtime.config" in graph["spec_runtime.client"]
    assert "spec_runtime.results" in graph["spec_runtime.server.http_client"]
    assert "spec_runtime.server.http_client" in graph["spec_runtime.client"]  # lazy, inside Client.connect
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circles():
    assert _cycles(_graph(_modules())) == []


def test_http_client_does_not_load_the_local_runtime():
    """The HTTP client imports neither the local client (zmq, launcher) nor target_proc."""
    code = ("import sys, spec_runtime.server.http_client; "
            "print(sorted(m for m in sys.modules if m in ('spec_runtime.client', 'spec_runtime.launcher') "
            "or m.startswith('target_proc')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# The modules of spec_runtime that host a model process rather than talk to one: Ray's
# actors start target_proc and draft_proc inside themselves.
PROCESS_HOSTS = {"spec_runtime.ray.actors"}


def test_the_front_end_imports_no_process_package():
    """spec_runtime (Client, CLI, server, launcher, and the engine the processes share)
    imports neither target_proc nor draft_proc: what both sides need lives in
    spec_runtime or protocol."""
    graph = _graph(_modules())
    bad = {name: sorted(d for d in deps if d.split(".")[0] in ("target_proc", "draft_proc"))
           for name, deps in graph.items() if name.split(".")[0] == "spec_runtime" and name not in PROCESS_HOSTS}
    assert {name: deps for name, deps in bad.items() if deps} == {}
