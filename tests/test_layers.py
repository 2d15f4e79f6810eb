"""Imports in ringreduce/ go one way, bottom to top (issue 37): a module imports its own layer or
lower ones, transports do not import each other, and no module reaches itself through imports.
Imports are read with `ast`, inside functions too (a lazy import is still an import). Nothing is
imported or built: this test runs without the extension."""
import ast
import re
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "ringreduce"

# Bottom to top. The extension (_C) sits below all of them; any layer may use it.
LAYERS = [
    ("core", {"_lifecycle"}),  # errors, Work, registry, options, environment, host identity
    ("transport", {"_shm", "_hier", "_cuda"}),  # shared memory, across hosts, CUDA
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
    known = {"__init__", "_lifecycle", "_shm", "_hier", "backend", "bench", "bench.cli", "_C"}
    src = ("import os\nimport torch\nfrom . import _C, _lifecycle\nfrom ._hier import plan_for\n"
           "def f():\n    from . import backend\n    import ringreduce.bench.cli\n"
           "    from ringreduce import all_reduce\n")
    assert imports_of(src, "_shm", known) == {"_C", "_lifecycle", "_hier", "backend",
                                               "bench.cli", "__init__"}
    assert imports_of("from . import cli\nfrom .. import _shm\n", "bench.launch",
                      known | {"bench.launch"}) == {"bench.cli", "_shm"}


@pytest.mark.parametrize("graph, expected", [
    ({"_lifecycle": {"backend"}, "backend": set()},
     "_lifecycle (core) imports backend (backend), a higher layer"),
    ({"_shm": {"_hier"}, "_hier": set()},
     "_shm imports _hier: transport modules go through the core, not each other"),
    ({"collectives": {"nn"}, "nn": {"collectives"}}, None),  # same layer: allowed, but a cycle
])
def test_checks_catch_what_they_are_for(graph, expected):
    if expected is None:
        assert violations(graph) == []
        assert cycles(graph) == [["collectives", "nn", "collectives"]]
    else:
        assert violations(graph) == [expected]


# -- csrc/: the same rules for the C++ folders ---------------------------------------------------

CSRC = PACKAGE.parent / "csrc"
# Bottom to top: a folder includes its own files and lower levels' only; folders on one level stay
# apart. cuda/p2p and cuda/nccl (the two CUDA transports) sit above cuda/ (what they share).
CSRC_LEVELS = {
    "ring": 0,                   # the call vocabulary: types, calls, schedules (header-only)
    "cpu": 1, "runtime": 1,      # CPU kernels; runtime services (threads, peers, recorder, mappings)
    "shm": 2, "cuda": 2,         # the shared-memory transport; what the CUDA transports share
    "cuda/p2p": 3, "cuda/nccl": 3,
    "cuda/hier": 4,              # ranks on several hosts: p2p inside each, nccl between them
    "binding": 5,                # the torch side: every file that includes torch or Python
}
TORCH_HEADERS = ("torch/", "ATen/", "c10/", "Python.h", "pybind11/", "nvtx3/")


def csrc_folder(rel):
    """The folder of a path relative to csrc ("cuda/p2p/endpoint.h" -> "cuda/p2p")."""
    parts = rel.split("/")[:-1]
    for k in range(len(parts), 0, -1):
        if "/".join(parts[:k]) in CSRC_LEVELS:
            return "/".join(parts[:k])
    raise KeyError(rel)


def csrc_includes(root=CSRC):
    """{file relative to csrc: [(line number, included path, quoted?)]}"""
    out = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        found = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            m = re.match(r'\s*#\s*include\s*([<"])([^>"]+)[>"]', line)
            if m:
                found.append((n, m.group(2), m.group(1) == '"'))
        out[path.relative_to(root).as_posix()] = found
    return out


def csrc_violations(includes):
    out = []
    for f, incs in sorted(includes.items()):
        here = csrc_folder(f)
        for n, target, quoted in incs:
            if target.startswith(TORCH_HEADERS) and here != "binding":
                out.append(f"{f}:{n} includes <{target}>: only csrc/binding/ sees torch or Python")
            if not quoted:
                continue
            there = csrc_folder(target)
            if there == here:
                continue
            if CSRC_LEVELS[there] >= CSRC_LEVELS[here]:
                out.append(f"{f}:{n} ({here}) includes {target} ({there}): "
                           + ("a higher level" if CSRC_LEVELS[there] > CSRC_LEVELS[here]
                              else "a folder beside it"))
    return out


def csrc_depth(includes):
    """Folders on the longest chain of includes between folders."""
    edges = {}
    for f, incs in includes.items():
        for _, target, quoted in incs:
            if quoted and csrc_folder(target) != csrc_folder(f):
                edges.setdefault(csrc_folder(f), set()).add(csrc_folder(target))

    def longest(folder, seen=()):
        assert folder not in seen, f"include cycle between folders: {seen + (folder,)}"
        return 1 + max((longest(t, seen + (folder,)) for t in edges.get(folder, ())), default=0)
    return max(longest(f) for f in CSRC_LEVELS)


def test_csrc_folders_include_down_only():
    includes = csrc_includes()
    assert set(map(csrc_folder, includes)) <= set(CSRC_LEVELS)
    assert csrc_violations(includes) == []
    # ring/ is the bottom: nothing outside it (and the standard library)
    assert all(csrc_folder(t) == "ring" for f, incs in includes.items() if csrc_folder(f) == "ring"
               for _, t, quoted in incs if quoted)
    assert csrc_depth(includes) <= 6  # ring, runtime, cuda, cuda/p2p, cuda/hier, binding


def test_csrc_checks_catch_what_they_are_for():
    bad = {"cuda/p2p/endpoint.h": [(3, "ATen/ATen.h", False), (4, "binding/shm_comm.h", True),
                                   (5, "cuda/nccl/endpoint.h", True), (6, "cuda/host.h", True)],
           "ring/call.h": [(7, "cpu/reduce.h", True)],
           "binding/module.cpp": [(1, "torch/extension.h", False), (2, "cuda/p2p/endpoint.h", True)]}
    assert csrc_violations(bad) == [
        "cuda/p2p/endpoint.h:3 includes <ATen/ATen.h>: only csrc/binding/ sees torch or Python",
        "cuda/p2p/endpoint.h:4 (cuda/p2p) includes binding/shm_comm.h (binding): a higher level",
        "cuda/p2p/endpoint.h:5 (cuda/p2p) includes cuda/nccl/endpoint.h (cuda/nccl): a folder beside it",
        "ring/call.h:7 (ring) includes cpu/reduce.h (cpu): a higher level"]
    assert csrc_depth({"binding/a.cpp": [(1, "cuda/p2p/x.h", True)],
                       "cuda/p2p/x.h": [(1, "cuda/k.h", True)], "cuda/k.h": [(1, "ring/t.h", True)]}) == 4


# -- one transport interface, each check written once (issue: one transport interface) ------------

def strip_comment(line):
    """A C++ line without its // comment: the first // outside a string or character literal."""
    quote, k = None, 0
    while k < len(line):
        ch = line[k]
        if quote:
            if ch == "\\":
                k += 1  # an escaped character
            elif ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
        elif line.startswith("//", k):
            return line[:k]
        k += 1
    return line


def test_strip_comment_reads_literals():
    assert strip_comment('f("a // b"); // c') == 'f("a // b"); '
    assert strip_comment("x = '\"'; // \"y\" // z") == "x = '\"'; "
    assert strip_comment('s = "\\"// q"; // r') == 's = "\\"// q"; '


def code_text(path):
    """A C++ file without its // comments (string contents kept)."""
    return "\n".join(strip_comment(line) for line in path.read_text().splitlines())


def csrc_files_with(text, root=CSRC):
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                  if p.is_file() and text in code_text(p))


TRANSPORTS = {"shm/endpoint.h": "shm", "cuda/p2p/endpoint.h": "p2p", "cuda/nccl/endpoint.h": "nccl"}


def test_every_transport_implements_the_one_interface():
    for rel, name in TRANSPORTS.items():
        text = (CSRC / rel).read_text()
        assert re.search(r"class Endpoint : public runtime::Transport\b", text), rel
        assert f'const char* name() const override {{ return "{name}"; }}' in text, rel


def test_the_binding_branches_on_capabilities_not_on_types():
    """No transport type in the communicator's policy: no std::is_same on it, no template over it,
    and the CUDA communicator's header a plain declaration."""
    for path in sorted((CSRC / "binding").iterdir()):
        text = code_text(path)
        assert not re.search(r"is_same(_v)?\s*<", text), path.name
        assert not re.search(r"template\s*<\s*(class|typename)\s+(Ring|Endpoint|Transport)\b", text), path.name
    header = CSRC / "binding" / "cuda_comm.h"
    assert len(header.read_text().splitlines()) <= 150
    assert "p2p::" not in code_text(header) and "nccl::" not in code_text(header)
    assert "p2p::" not in code_text(CSRC / "binding" / "cuda_comm.cpp")


def test_each_check_and_mechanism_written_once():
    once = {
        "broken by an earlier failure": ["runtime/transport.h"],  # the broken check's message
        "is not a multiple of": ["runtime/transport.h"],          # the multiple of the world
        "METH_FASTCALL": ["binding/fast_path.cpp"],              # one fast path for CPU and CUDA
        "PyCapsule_GetPointer": ["binding/fast_path.cpp"],
        "translate_exception_to_python": ["binding/fast_path.cpp"],  # one exception map
        "\\nflight recorder: ": ["runtime/recorder.cpp"],          # the record/dump wrapper
        "bool wire_takes(": ["ring/types.h"],                     # what a wire takes
        "constexpr size_t kDefaultStagingBytes": ["cuda/nccl/defaults.h"],
        "constexpr int kDefaultSymBlocks": ["cuda/p2p/layout.h"],
    }
    for text, where in once.items():
        assert csrc_files_with(text) == where, text
    # ... and each is used where the copies were
    assert "rethrow_failed(" in code_text(CSRC / "binding" / "shm_comm.cpp")
    assert "rethrow_failed(" in code_text(CSRC / "binding" / "cuda_comm.cpp")
    for rel in ("shm/protocol.cpp", "cuda/p2p/endpoint.cpp", "cuda/nccl/endpoint.cpp"):
        assert "runtime::check_call(" in code_text(CSRC / rel), rel


def test_host_ring_loop_written_once():
    """The schedule's steps are walked by ring/loop.h for the host transports (shm, nccl) and by
    the device kernel; the transports bring primitives, not loops."""
    walkers = [f for f in csrc_files_with("rs_recv_chunk(") if f != "ring/schedule.h"]
    assert walkers == ["cuda/p2p/ring_kernel.cu", "ring/loop.h"]
    for rel in ("shm/protocol.cpp", "cuda/nccl/algorithms.cpp"):
        assert "ring::run_ring(" in code_text(CSRC / rel), rel

