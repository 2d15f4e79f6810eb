"""Imports in ringreduce/ go one way, bottom to top (issue 37): a module imports its own layer or
lower ones, transports do not import each other, and no module reaches itself through imports.
Imports are read with `ast`, inside functions too (a lazy import is still an import). Nothing is
imported or built: this test runs without the extension."""
import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "ringreduce"

# Bottom to top. The extension (_C) sits below all of them; any layer may use it.
LAYERS = [
    ("core", {"_lifecycle"}),  # errors, Work, registry, options, environment, host identity
    ("transport", {"_comm", "_hier", "_cuda"}),  # shared memory, across hosts, CUDA
    ("api", {"collectives", "ops", "functional", "ddp", "bucketing", "nn"}),
    ("backend", {"backend"}),  # dist.init_process_group("ringreduce")
    ("package", {"__init__"}),  # `import ringreduce`: the public names
    ("tools", {"trace", "bench"}),  # command lines: python -m ringreduce.trace / .bench
]
# Layers whose modules may not import each other (only the core's interfaces).
APART = {"transport"}
NATIVE = {"_C"}


def layer_of(module):
    """(index, name) of a module named relative to the package ("bench.cli" -> "bench")."""
    top = module.split(".")[0]
    for i, (name, members) in enumerate(LAYERS):
        if top in members:
            return i, name
    raise KeyError(module)


def module_name(path, root):
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def imports_of(source, module, known, package="ringreduce"):
    """The package's modules that source imports (module-level and inside functions), as names
    relative to the package; known: every module name, to tell `from . import x` (a module) from
    `from . import name` (a name of the package)."""
    is_pkg = module == "__init__" or f"{module}.__init__" in known or any(
        k.startswith(module + ".") for k in known)
    here = [] if module == "__init__" else module.split(".")
    base_pkg = here if is_pkg else here[:-1]
    found = set()

    def add(name):
        while name and name not in known:  # `from .x import y`: y is a name in x
            name = name.rpartition(".")[0]
        found.add(name or "__init__")

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == package or alias.name.startswith(package + "."):
                    add(alias.name[len(package) + 1:])
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parent = base_pkg[:len(base_pkg) - (node.level - 1)] if node.level > 1 else base_pkg
                prefix = ".".join(parent + ([node.module] if node.module else []))
            elif node.module == package or (node.module or "").startswith(package + "."):
                prefix = node.module[len(package) + 1:]
            else:
                continue
            for alias in node.names:
                full = f"{prefix}.{alias.name}" if prefix else alias.name
                add(full if full in known else prefix)
    found.discard(module)
    return found


def package_imports(root=PACKAGE):
    files = sorted(root.rglob("*.py"))
    known = {module_name(p, root) for p in files} | {"__init__"} | NATIVE
    return {module_name(p, root): imports_of(p.read_text(), module_name(p, root), known)
            for p in files}


def violations(graph):
    """Messages for every import that goes up a layer or across transports."""
    out = []
    for mod, targets in sorted(graph.items()):
        lo, lname = layer_of(mod)
        for t in sorted(targets):
            if t.split(".")[0] in NATIVE:
                continue
            hi, tname = layer_of(t)
            if hi > lo:
                out.append(f"{mod} ({lname}) imports {t} ({tname}), a higher layer")
            elif hi == lo and lname in APART and t.split(".")[0] != mod.split(".")[0]:
                out.append(f"{mod} imports {t}: {lname} modules go through the core, not each other")
    return out


def cycles(graph):
    """One import cycle per strongly connected group of modules (as lists of names), if any."""
    found, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return found


def test_every_module_has_a_layer():
    missing = [m for m in package_imports() if m != "__init__" and
               not any(m.split(".")[0] in members for _, members in LAYERS)]
    assert not missing, f"modules without a layer in tests/test_layers.py LAYERS: {missing}"


def test_imports_go_down_only():
    assert violations(package_imports()) == []


def test_no_import_cycles():
    assert cycles(package_imports()) == []


def test_reader_sees_lazy_and_relative_imports():
    """The reader finds what the checks depend on: imports inside functions, `from . import x`,
    `from .x import y`, absolute `ringreduce.x`, and not torch's or a name of the package."""
    known = {"__init__", "_lifecycle", "_comm", "_hier", "backend", "bench", "bench.cli", "_C"}
    src = ("import os\nimport torch\nfrom . import _C, _lifecycle\nfrom ._hier import plan_for\n"
           "def f():\n    from . import backend\n    import ringreduce.bench.cli\n"
           "    from ringreduce import all_reduce\n")
    assert imports_of(src, "_comm", known) == {"_C", "_lifecycle", "_hier", "backend",
                                               "bench.cli", "__init__"}
    assert imports_of("from . import cli\nfrom .. import _comm\n", "bench.launch",
                      known | {"bench.launch"}) == {"bench.cli", "_comm"}


@pytest.mark.parametrize("graph, expected", [
    ({"_lifecycle": {"backend"}, "backend": set()},
     "_lifecycle (core) imports backend (backend), a higher layer"),
    ({"_comm": {"_hier"}, "_hier": set()},
     "_comm imports _hier: transport modules go through the core, not each other"),
    ({"collectives": {"nn"}, "nn": {"collectives"}}, None),  # same layer: allowed, but a cycle
])
def test_checks_catch_what_they_are_for(graph, expected):
    if expected is None:
        assert violations(graph) == []
        assert cycles(graph) == [["collectives", "nn", "collectives"]]
    else:
        assert violations(graph) == [expected]
