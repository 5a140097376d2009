"""The package's import graph: no cycle between modules (function-level imports included), no arrow that runs back
up the layers (`LAYERS`), and `refusion --help` without torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import refusion

PACKAGE = Path(refusion.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """{module: refusion modules it imports anywhere in its body}; `from a import b` points at a.b when that is a
    module, else at a."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                            for a in node.names}
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
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
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert len(graph) > 40  # the walk saw the package
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


LAYERS = (
    ("foundation", ("refusion.config", "refusion.cpu", "refusion.data", "refusion.open_ended", "refusion.jsonl",
                    "refusion.hub", "refusion.data_files", "refusion.cache_dirs")),
    ("model", ("refusion.model",)),
    ("decode", ("refusion.decode",)),
    ("viz", ("refusion.viz",)),
    ("api", ("refusion",)),
    ("train", ("refusion.train",)),
    ("eval", ("refusion.eval",)),
    ("serve", ("refusion.serve",)),
    ("commands", ("refusion.cli", "refusion.__main__", "refusion.arguments", "refusion.chat", "refusion.engine",
                  "*.cli")),
)
"""The package's layers, lowest first: a module may import its own layer and the layers below it, never one above
(function-level imports count). A module belongs to the last layer one of whose prefixes it matches ("*.cli": every
package's command-line module, a front end that may call any layer): the model and its kernels know nothing of
decoding; decoding knows nothing of training, evaluation or serving."""


def layer_of(module: str) -> int:
    found = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if prefix == "*.cli":
                hit = module.endswith(".cli")
            else:
                hit = module == prefix or module.startswith(prefix + ".") and prefix != "refusion"
            if hit:
                found = i
    if found is None:
        raise AssertionError(f"{module} is in no layer of LAYERS: add it to one")
    return found


def upward_arrows(graph: dict[str, set[str]]) -> list[str]:
    """Every import from a module to a module of a higher layer."""
    return sorted(f"{m} ({LAYERS[layer_of(m)][0]}) -> {t} ({LAYERS[layer_of(t)][0]})"
                  for m, targets in graph.items() for t in targets if layer_of(t) > layer_of(m))


def test_no_import_runs_back_up_the_layers():
    assert upward_arrows(import_graph()) == []


def test_the_layer_check_finds_an_arrow_up():
    graph = {"refusion.model.setup": {"refusion.decode.costs"}, "refusion.decode.costs": {"refusion.model.setup"}}
    assert upward_arrows(graph) == ["refusion.model.setup (model) -> refusion.decode.costs (decode)"]
    assert layer_of("refusion.model.cli") == layer_of("refusion.cli") and layer_of("refusion") == 4


def test_decoding_does_not_import_training():
    graph = import_graph()
    arrows = [(m, t) for m, targets in graph.items() if m.startswith("refusion.decode")
              for t in targets if t.startswith("refusion.train")]
    assert arrows == []


def test_help_starts_without_torch():
    code = ("import sys; from refusion.cli import build_parser; build_parser().format_help(); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
