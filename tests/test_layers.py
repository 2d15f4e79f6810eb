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
    ("core", {"_lifecycle", "_env", "_calibrate"}),  # errors, Work, registry, options, environment,
    # host identity; the machine class's measured steps (cache, timing) that a transport may run on
    ("transport", {"_shm", "_hier", "_cuda"}),  # shared memory, across hosts, CUDA
    ("api", {"collectives", "ops", "functional", "ddp", "bucketing", "nn", "_shrink"}),
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


TRANSPORTS = {"cuda/p2p/endpoint.h": "p2p", "cuda/nccl/endpoint.h": "nccl", "cuda/hier/endpoint.h": "hier"}


def test_every_transport_implements_the_one_interface():
    for rel, name in TRANSPORTS.items():
        text = (CSRC / rel).read_text()
        assert re.search(r"class Endpoint : public runtime::Transport\b", text), rel
        assert f'const char* name() const override {{ return "{name}"; }}' in text, rel
    # The shared-memory endpoint does not claim the interface (issue 82): its one driver, ShmComm,
    # plans and runs on its protocol directly, once per call, with what the interface does not
    # carry (the Ctrl-C check, the pool buffer).
    assert "runtime::Transport" not in code_text(CSRC / "shm" / "endpoint.h")
    assert code_text(CSRC / "binding" / "shm_comm.cpp").count(".choose(") == 2  # run_ring, algo()
    # Each capability is read by the binding (a field no communicator reads is not kept).
    caps = re.search(r"struct Caps \{(.*?)\n\};", code_text(CSRC / "runtime" / "transport.h"), re.S).group(1)
    fields = re.findall(r"bool (\w+) = ", caps)
    readers = code_text(CSRC / "runtime" / "transport.h").split("struct Caps", 1)[0] + "".join(
        code_text(p) for p in sorted((CSRC / "binding").iterdir())) + \
        code_text(CSRC / "runtime" / "transport.h").split("\n};", 1)[1]
    for f in fields:
        assert re.search(rf"\.{f}\b", readers), f"Caps::{f} is never read"


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
        "bool wire_refusal(": [],                                  # (a string, below)
        "std::string wire_refusal(": ["runtime/transport.h"],     # what a transport's wire runs
        "std::string fail_and_dump(": ["runtime/recorder.h"],     # the failure wrapper
        "names_of(": ["binding/torch_types.h"],                   # the vocabulary's names in messages
        "inline DType to_dtype(": ["binding/torch_types.h"],      # the one dtype check
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



# -- each rule spelled in one place (issue 82 item 3) ---------------------------------------------
# A rule is re-spelled when what it says (the op names and codes, the closed message, the dtypes a
# wire takes, the shared-memory algorithms) appears as literals outside its one home: these read
# every string literal and every literal tuple, in C++ (comments dropped) and in Python
# (docstrings dropped), not one exact string.

OP_NAMES = {"SUM", "AVG", "MIN", "MAX", "PRODUCT"}
# the three in a list ("float32, float16 or bfloat16", "float32/float16/bfloat16", in any order)
WIRE_LIST = re.compile(r"(b?float(32|16))(\W{1,3}(and |or )?b?float(32|16)){2}")
SHM_ALGOS = {"oneshot", "twoshot", "cma"}  # (p2p's list has no cma)
CPP_LITERAL = re.compile(r'"(?:[^"\\\n]|\\.)*"')


def cpp_sources(root=CSRC):
    return sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in (".h", ".cpp", ".cu", ".cuh"))


def cpp_literals(path):
    """(line, text) of every string literal of a C++ file, and of every run of adjacent ones."""
    out = []
    for n, line in enumerate(code_text(path).splitlines(), 1):
        lits = [m.group(0)[1:-1] for m in CPP_LITERAL.finditer(line)]
        out += [(n, t) for t in lits] + ([(n, " ".join(lits))] if len(lits) > 1 else [])
    return out


def py_literals(source):
    """(line, text) of every string literal of Python source but docstrings (an f-string: its
    constant parts, "{}" between), and (line, tuple of its strings) of every literal tuple, list
    or set."""
    tree = ast.parse(source)
    docs = {id(b.body[0].value) for b in ast.walk(tree)
            if isinstance(b, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and b.body and isinstance(b.body[0], ast.Expr) and isinstance(b.body[0].value, ast.Constant)}
    out, inner = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            inner.update(id(v) for v in node.values)
            out.append((node.lineno, "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)))
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            out.append((node.lineno, tuple(e.value for e in node.elts
                                           if isinstance(e, ast.Constant) and isinstance(e.value, str))))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs \
                and id(node) not in inner:
            out.append((node.lineno, node.value))
    return out


def words(text):
    return set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text))


def text_of(lit):
    return lit if isinstance(lit, str) else " ".join(lit)


def respelled(rule, homes):
    """Where a literal says what rule(text) recognises, outside homes (C++ paths under csrc/,
    Python modules under ringreduce/)."""
    found = []
    for p in cpp_sources():
        rel = p.relative_to(CSRC).as_posix()
        if rel not in homes:
            found += [f"{rel}:{n}" for n, t in cpp_literals(p) if rule(t)]
    for p in sorted(PACKAGE.rglob("*.py")):
        rel = "ringreduce/" + p.relative_to(PACKAGE).as_posix()
        if rel not in homes:
            found += [f"{rel}:{n}" for n, t in py_literals(p.read_text()) if rule(text_of(t))]
    return found


def test_rule_spotting_reads_literals_not_comments():
    src = '''"""SUM, AVG, MIN in a docstring"""
x = ("SUM", "AVG", "MIN")  # a comment: MAX PRODUCT
y = f"takes {a} float32, float16 or {b} bfloat16"
'''
    lits = py_literals(src)
    assert (2, ("SUM", "AVG", "MIN")) in lits and (3, "takes {} float32, float16 or {} bfloat16") in lits
    assert not any(isinstance(t, str) and "docstring" in t for _, t in lits)
    tmp = pathlib.Path(__file__).with_name("_layers_probe.h")
    try:
        tmp.write_text('f("a", "b"); // "c"\nthrow E("x is closed");\n')
        assert cpp_literals(tmp) == [(1, "a"), (1, "b"), (1, "a b"), (2, "x is closed")]
    finally:
        tmp.unlink()


# Sites the owners of those folders are changing to the rule's home (issue 82); the list only
# shrinks: a site fixed fails the test until its entry goes too.
AWAITING = {"closed": set(), "wire dtypes": set()}


def test_the_closed_error_is_spelled_once():
    """ring/call.h's kClosedMessage (closed_error(), RingReduceError); Python reads it as
    _C.CLOSED_MESSAGE. trace.py matches it in dumps of any version (a reader, not a raiser)."""
    found = respelled(lambda t: re.search(r"\bis closed\b", t), {"ring/call.h", "ringreduce/trace.py"})
    assert sorted({f.split(":")[0] for f in found}) == sorted(AWAITING["closed"]), found
    for rel in ("binding/shm_comm.cpp", "binding/cuda_comm.cpp", "shm/endpoint.cpp", "runtime/executor.h",
                "cuda/hier/endpoint.cpp"):
        assert "closed_error()" in code_text(CSRC / rel) or "kClosedMessage" in code_text(CSRC / rel), rel
    assert "_C.CLOSED_MESSAGE" in (PACKAGE / "_lifecycle.py").read_text()


def test_the_op_list_is_spelled_once():
    """ring/types.h (RedOp, op_name); Python reads _C.OP_CODES; the backend's C++ maps c10d's ops
    to RedOp's values, never to numbers."""
    assert respelled(lambda t: len(words(t) & OP_NAMES) >= 3, {"ring/types.h"}) == []
    for p in cpp_sources():
        assert not re.search(r"ReduceOp::\w+\s*:\s*return\s+\d", code_text(p)), p
    for p in sorted(PACKAGE.rglob("*.py")):
        assert not re.search(r"ReduceOp\.\w+\s*,\s*\d\s*\)", p.read_text()), p


def test_what_a_wire_takes_is_spelled_once():
    """ring/types.h's wire_takes (Python: _C.WIRE_TENSOR_DTYPES, _C.WIRE_OPS); no list of those
    dtypes in a literal or by hand in C++ elsewhere; what a transport's wire runs is its Caps."""
    found = respelled(lambda t: WIRE_LIST.search(t), {"ring/types.h"})
    assert found == [], found
    by_hand = [p.relative_to(CSRC).as_posix() for p in cpp_sources() if p.name != "types.h" and
               re.search(r"DType::F32\b[^;\n]*DType::F16\b[^;\n]*DType::BF16\b", code_text(p))]
    assert sorted(by_hand) == sorted(AWAITING["wire dtypes"]), by_hand
    py = "".join(p.read_text() for p in sorted(PACKAGE.rglob("*.py")))
    assert not re.search(r"transport (not )?in \(\"(shm|p2p|hier)", py)  # a wire by transport name


P2P_ALGOS = {"oneshot", "twoshot", "copy", "ll"}  # cuda/p2p/plan.h: kForcedAlgos


def test_the_p2p_algorithms_are_spelled_once():
    """cuda/p2p/plan.h's kForcedAlgos (Python: _C.P2P_ALGOS), parsed by the one parse_algo."""
    found = respelled(lambda t: P2P_ALGOS <= words(t), {"ring/call.h", "ringreduce/bench/cli.py"})
    assert found == [], found
    assert "_C.P2P_ALGOS" in (PACKAGE / "_cuda" / "policy.py").read_text()
    assert "_C.P2P_ALGOS" in (PACKAGE / "_env.py").read_text()
    assert csrc_files_with("Algo parse_algo(") == ["binding/torch_types.h"]
    assert "parse_algo(" in code_text(CSRC / "binding" / "cuda_module.cpp")


def test_sizes_checked_once():
    """reduce_scatter's and all_gather's "a multiple of the world" is binding/torch_types.h's
    check_sizes, for both communicators, the backend's C++ half and (by _C.check_sizes) its Python."""
    assert csrc_files_with("world size = ") == ["binding/torch_types.h"]
    py = {p.name: p.read_text() for p in PACKAGE.rglob("*.py")}
    assert [n for n, t in py.items() if "world size = " in t] == []
    assert "_C.check_sizes(" in py["backend.py"]


def test_capture_asked_once():
    """Whether a call's stream is capturing is asked of CUDA by the binding only (Call::captured);
    a transport that is not capture-safe refuses with the one message."""
    assert csrc_files_with("cudaStreamIsCapturing(") == ["binding/cuda_comm.cpp"]
    assert csrc_files_with("cannot run inside a CUDA graph") == ["runtime/transport.h"]
    for rel in ("binding/cuda_comm.cpp", "cuda/nccl/endpoint.cpp"):
        assert "capture_refusal(" in code_text(CSRC / rel), rel


def test_the_shm_algorithms_are_spelled_once():
    """shm/protocol.h's kForcedAlgos and kStepAlgos (Python: _C.SHM_ALGOS, _C.SHM_STEP_ALGOS)."""
    # (the benchmark's command line names its backends after them: labels, not the rule)
    found = respelled(lambda t: SHM_ALGOS <= words(t), {"ring/call.h", "ringreduce/bench/cli.py"})
    assert found == [], found
    text = (PACKAGE / "_shm.py").read_text()
    assert "_C.SHM_ALGOS" in text and "_C.SHM_STEP_ALGOS" in text and "_C.SHM_SLICE_BYTES" in text
    assert "_C.TRACE_BUFFER" in (PACKAGE / "_lifecycle.py").read_text()
    assert csrc_files_with("RINGREDUCE_TRACE_BUFFER must be") == []  # checked once, in Python
