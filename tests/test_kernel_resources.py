"""The hot kernels' resources in the built extension against stated limits, so that a kernel cannot
grow unseen between GPU runs (DESIGN.md's conventions), and the LL one-shot's 16-byte polls.

Read from ringreduce._C's library (sm_80 and sm_90 code, as the README's install builds it) with
cuobjdump: registers and stack bytes from `-res-usage`; spill stores and loads (bytes, as `ptxas -v`
counts them: a kernel's and its callees' together) from the record each cubin keeps of its spill
instructions (the .nv.info attribute EIATTR_ANNOTATIONS, "SpillRefill" at each offset in nvdisasm's
listing), decoded at those offsets (checked against the disassembler's own listing below). Should
that record ever go unread, the stack limits still hold: spilled registers live in the stack frame.
No GPU needed; a few seconds. Skipped only where the extension was built without CUDA.

cuobjdump: the CUDA toolkit's (the one setup.py builds with), else the nvidia-cuda-cuobjdump wheel's
(the test extra installs it on Linux x86-64), else the one on PATH. Its -sass needs nvdisasm, found
the same way (wheel nvidia-cuda-nvdisasm)."""
import ast
import fnmatch
import functools
import os
import re
import shutil
import struct
import subprocess
from concurrent.futures import ThreadPoolExecutor

import numpy
import pytest

from ringreduce import _C

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARCHS = ("sm_80", "sm_90")

pytestmark = pytest.mark.skipif(not getattr(_C, "cuda_compiled", False),
                                reason="ringreduce._C was built without CUDA (cuda_compiled is False): "
                                       "no kernels to read")

# The limits, per kernel: the first row whose pattern matches an instantiation's short name
# (kernel<type, op or wire>, fnmatch) on one of the row's architectures applies to it. Registers,
# stack bytes, spill store bytes, spill load bytes (a kernel's and its callees'), where each comes
# from: the build of commit 3a2b473 and issue 81's sym_kernel.cu (nvcc 13.0, -O3, as setup.py
# builds), the largest value over the row's instantiations; registers with a little headroom (never
# above 128: 512 threads a block, kThreads, leave 65536 / 512), stack and spills as measured. A
# kernel that needs more: find out why first, then raise its row here and say so.
B = ARCHS
LIMITS = [
    # pattern                            archs      regs stack st  ld
    # csrc/cuda/p2p/sym_kernel.cu: 128 / 32 / 0 / 0 (issue 81; at 33da6d5 up to 128 / 224 / 76 / 140:
    # a local array of tags since imported memory, and two-shot's state kept across the fold)
    ("sym_kernel<*>",                      B,         128, 32, 0, 0),
    # csrc/cuda/p2p/ll_kernel.cu polling 16 bytes a load spills (at 33da6d5: 64 / 96 / 0 / 0)
    ("ll_kernel<*char, *>",                B,         72, 112, 20, 68),
    ("ll_kernel<*>",                       ("sm_80",), 72, 96, 8, 24),
    ("ll_kernel<*>",                       ("sm_90",), 72, 80, 0, 0),
    # csrc/cuda/p2p/ring_kernel.cu: ring measured 126 registers at most, copy 114
    ("ring_kernel<*>",                     B,         128, 0, 0, 0),
    ("copy_kernel<*>",                     B,         120, 32, 0, 0),
    # csrc/cuda/p2p/sym_wire.cu: a float tensor over a 16-bit wire, a 16-bit one over the fp16
    # wire, spill; wire_local_kernel measured 60 registers
    ("sym_wire_kernel<float, Wire::BF16>", ("sm_80",), 128, 88, 46, 64),
    ("sym_wire_kernel<float, Wire::F16>",  ("sm_80",), 128, 80, 46, 60),
    ("sym_wire_kernel<*16, Wire::F16>",    ("sm_80",), 128, 88, 44, 64),
    ("sym_wire_kernel<float, Wire::F16>",  ("sm_90",), 128, 48, 16, 20),
    ("sym_wire_kernel<*16, Wire::F16>",    ("sm_90",), 128, 48, 12, 16),
    ("sym_wire_kernel<*>",                 B,         128, 32, 0, 0),
    ("wire_local_kernel<*>",               B,         64, 0, 0, 0),
]
# Every family must be in every architecture the library has (a renamed kernel must not drop out).
FAMILIES = ("sym_kernel", "ll_kernel", "ring_kernel", "copy_kernel", "sym_wire_kernel", "wire_local_kernel")

INSTALL_HINT = ("install the CUDA binary tools: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm "
                "(the test extra does: pip install -e \".[test]\"), or put a CUDA toolkit's bin/ on PATH")


# -- finding the tools ------------------------------------------------------------------------------

def setup_cuda_home():
    """The toolkit setup.py builds with: its own find_cuda_home, read out of setup.py (which cannot
    be imported: it builds)."""
    path = os.path.join(REPO, "setup.py")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "find_cuda_home"), None)
    if fn is None:
        return None
    scope = {"os": os, "shutil": shutil}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), path, "exec"), scope)
    return scope["find_cuda_home"]()


def wheel_bins():
    """bin/ folders of the NVIDIA wheels installed here (nvidia/cu13/bin; nvidia/cuda_*/bin before 13)."""
    try:
        import nvidia
    except ImportError:
        return []
    return sorted({os.path.join(root, sub, "bin") for root in nvidia.__path__ for sub in os.listdir(root)
                   if os.path.isdir(os.path.join(root, sub, "bin"))})


def find_tool(name):
    """(path, where) of a CUDA binary tool: the toolkit's, else a wheel's, else PATH's; (None, tried)."""
    home = setup_cuda_home()
    places = ([("toolkit " + home, os.path.join(home, "bin"))] if home else []) + \
        [("wheel " + b, b) for b in wheel_bins()]
    for where, folder in places:
        path = os.path.join(folder, name)
        if os.access(path, os.X_OK):
            return path, where
    path = shutil.which(name)
    if path:
        return path, "PATH"
    return None, ", ".join(w for w, _ in places) + (", " if places else "") + "PATH"


@pytest.fixture(scope="module")
def cuobjdump():
    path, where = find_tool("cuobjdump")
    assert path, f"cuobjdump not found (looked in: {where}): {INSTALL_HINT}"
    print(f"cuobjdump: {path} ({where})")
    return path


@pytest.fixture(scope="module")
def library():
    return _C.__file__


def run(args, **kw):
    p = subprocess.run(args, capture_output=True, text=True, timeout=120, **kw)
    assert p.returncode == 0, f"{' '.join(args)} failed ({p.returncode}): {p.stderr[-2000:]}"
    return p.stdout


# -- reading the library ----------------------------------------------------------------------------

def short_names(mangled):
    """kernel<type, op or wire> per mangled name: sym_kernel<float, Sum>, sym_wire_kernel<F16, Wire::BF16>."""
    demangled = run(["c++filt"], input="\n".join(mangled)).splitlines()
    ops = {"0": "Sum", "1": "Avg", "2": "Min", "3": "Max", "4": "Prod"}
    wires = {"0": "None", "1": "BF16", "2": "F16", "3": "E4M3", "4": "E5M2"}
    out = {}
    for m, d in zip(mangled, demangled):
        d = re.sub(r"\b\w+::", "", d.replace("(anonymous namespace)::", ""))
        d = re.sub(r"\(RedOp\)(\d)", lambda x: ops[x.group(1)], d)
        d = re.sub(r"\(Wire\)(\d)", lambda x: "Wire::" + wires[x.group(1)], d)
        k = re.search(r"(\w+<[^()]*>)\(", d)
        out[m] = k.group(1) if k else d
    return out


@functools.lru_cache(maxsize=None)
def elf_sections(path):
    """{name: bytes} of an ELF64 file's sections (a cubin)."""
    with open(path, "rb") as f:
        b = f.read()
    assert b[:5] == b"\x7fELF\x02", f"{path}: not an ELF64 file"
    shoff, = struct.unpack_from("<Q", b, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", b, 0x3A)
    heads = [struct.unpack_from("<IIQQQQIIQQ", b, shoff + i * shentsize) for i in range(shnum)]
    names = heads[shstrndx][4]

    def name(off):
        return b[names + off:b.index(b"\0", names + off)].decode()
    return {name(h[0]): b[h[4]:h[4] + h[5]] for h in heads}


EIATTR_ANNOTATIONS = 0x55  # cuobjdump -elf names it; entries of (u32 kind, u32 offset), kind 1: SpillRefill
STL, LDL = 0x387, 0x983    # opcodes in an instruction's low 12 bits (sm_70 and later)
WIDTH = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 8, 6: 16}  # its bits 73-75: U8 S8 U16 S16 32 64 128


def local_access(text, off):
    """('STL' or 'LDL', bytes) of the instruction at off, else None."""
    lo, hi = struct.unpack_from("<QQ", text, off)
    kind = {STL: "STL", LDL: "LDL"}.get(lo & 0xFFF)
    return (kind, WIDTH[(hi >> 9) & 7]) if kind else None


def spill_offsets(info):
    """The offsets of the spill instructions a function's .nv.info section lists."""
    i, offsets = 0, []
    while i < len(info):
        fmt, attr, value = struct.unpack_from("<BBH", info, i)
        if fmt != 4:  # EIFMT_NVAL, _BVAL, _HVAL: the value in the record's last 2 bytes
            i += 4
            continue
        if attr == EIATTR_ANNOTATIONS:
            for j in range(i + 4, i + 4 + value, 8):
                kind, off = struct.unpack_from("<II", info, j)
                if kind == 1:
                    offsets.append(off)
        i += 4 + value  # EIFMT_SVAL: a 2-byte size, then that many bytes
    assert i == len(info), "a .nv.info section this reader does not know: fix spill_offsets"
    return offsets


@pytest.fixture(scope="module")
def cubins(cuobjdump, library, tmp_path_factory):
    """{arch: [cubin path]}: every cubin in the library."""
    folder = str(tmp_path_factory.mktemp("cubins"))
    run([cuobjdump, "-xelf", "all", library], cwd=folder)
    found = {}
    for f in sorted(os.listdir(folder)):
        m = re.search(r"\.(sm_\d+)\.cubin$", f)
        if m:
            found.setdefault(m.group(1), []).append(os.path.join(folder, f))
    assert found, f"no cubin in {library}"
    return found


@pytest.fixture(scope="module")
def kernels(cuobjdump, library, cubins):
    """{(arch, mangled name): {name, reg, stack, st, ld, cubin}} of every kernel in the library."""
    found, arch, elf, fn = {}, None, False, None
    for line in run([cuobjdump, "-res-usage", library]).splitlines():
        if line.startswith("Fatbin "):
            elf = line.startswith("Fatbin elf code")  # PTX entries have no resources
        elif line.startswith("arch = "):
            arch = line.split()[-1]
        elif line.strip().startswith("Function "):
            fn = line.split()[1].rstrip(":")
        elif elf and fn and line.strip().startswith("REG:"):
            m = re.match(r"\s*REG:(\d+) STACK:(\d+)", line)
            found[(arch, fn)] = {"reg": int(m.group(1)), "stack": int(m.group(2)), "st": 0, "ld": 0}
            fn = None
    names = short_names(sorted({f for _, f in found}))
    for key, k in found.items():
        k["name"] = names[key[1]]
    for arch, paths in cubins.items():
        for path in paths:
            sections = elf_sections(path)
            for sec, info in sections.items():
                fn = sec[len(".nv.info."):]
                if not sec.startswith(".nv.info.") or (arch, fn) not in found:
                    continue
                k = found[(arch, fn)]
                k["cubin"] = path
                text = sections[".text." + fn]
                for off in spill_offsets(info):
                    access = local_access(text, off)
                    assert access, f"{k['name']} ({arch}): no STL/LDL at spill offset {off:#x}: " \
                                   "fix local_access"
                    k["st" if access[0] == "STL" else "ld"] += access[1]
    return found


def limit_of(name, arch):
    """(pattern, registers, stack, spill stores, spill loads) of the row for a kernel, or None."""
    return next(((p, *lim) for p, archs, *lim in LIMITS if arch in archs and fnmatch.fnmatchcase(name, p)),
                None)


def hot(kernels):
    """The kernels LIMITS covers: the hot families' code for sm_80 and sm_90 (other targets a local
    build may add are not checked)."""
    return {key: k for key, k in kernels.items() if k["name"].split("<")[0] in FAMILIES and key[0] in ARCHS}


# -- the checks -------------------------------------------------------------------------------------

def test_every_hot_kernel_in_every_architecture(kernels):
    archs = sorted({a for a, _ in kernels} & set(ARCHS))
    assert archs, f"the library has code for {sorted({a for a, _ in kernels})}, none of {ARCHS}"
    missing = [(a, f) for a in archs for f in FAMILIES
               if not any(k["name"].startswith(f + "<") for (ka, _), k in kernels.items() if ka == a)]
    assert not missing, f"kernels not in the library (renamed? then update FAMILIES and LIMITS): {missing}"
    unlisted = sorted({f"{k['name']} ({a})" for (a, _), k in hot(kernels).items()
                       if limit_of(k["name"], a) is None})
    assert not unlisted, f"hot kernels without a row in LIMITS: {unlisted}"


def test_registers_stack_and_spills_within_limits(kernels):
    over = []
    for (arch, _), k in sorted(hot(kernels).items(), key=lambda x: (x[1]["name"], x[0][0])):
        row = limit_of(k["name"], arch)
        if row is None:
            continue  # test_every_hot_kernel_in_every_architecture names it
        pattern, *limits = row
        for what, have, most in zip(("registers", "stack bytes", "spill store bytes", "spill load bytes"),
                                    (k["reg"], k["stack"], k["st"], k["ld"]), limits):
            if have > most:
                over.append(f"{k['name']} ({arch}): {what} {have} > {most} (row {pattern!r})")
    assert not over, "kernels over their limits in LIMITS (measure why; raise a row only with a " \
                     "reason):\n  " + "\n  ".join(over)


@pytest.fixture(scope="module")
def ll_sass(cuobjdump, kernels):
    """{(arch, short name): (cubin, mangled name, SASS listing)} of every function in the cubins
    that hold ll_kernel (cuobjdump -sass: a couple of seconds a cubin)."""
    path, where = find_tool("nvdisasm")
    assert path, f"nvdisasm (which cuobjdump -sass runs) not found (looked in: {where}): {INSTALL_HINT}"
    env = dict(os.environ, PATH=os.path.dirname(path) + os.pathsep + os.environ.get("PATH", ""))
    cubins = sorted({k["cubin"] for k in kernels.values() if k["name"].startswith("ll_kernel<")})
    assert cubins, "no ll_kernel in the library"
    with ThreadPoolExecutor(len(cubins)) as pool:
        listings = list(pool.map(lambda c: run([cuobjdump, "-sass", c], env=env), cubins))
    names = {fn: k["name"] for (_, fn), k in kernels.items()}
    out = {}
    for cubin, listing in zip(cubins, listings):
        arch = re.search(r"\.(sm_\d+)\.cubin$", cubin).group(1)
        for part in listing.split("Function : ")[1:]:
            fn, body = part.split("\n", 1)
            out[(arch, names.get(fn.strip(), fn.strip()))] = (cubin, fn.strip(), body)
    return out


def test_ll_fold_polls_16_bytes_at_a_time(ll_sass):
    """Each LL poll is one 16-byte volatile load (two data words and their flags), as NCCL's LL
    reads them: in SASS, LDG.E.128.STRONG.SYS (a volatile global load), at least one per kernel."""
    counts = {key: (body.count(" LDG.E.128.STRONG.SYS "), body.count(" LDG.E.64.STRONG.SYS "))
              for key, (_, _, body) in ll_sass.items() if key[1].startswith("ll_kernel<")}
    assert counts
    narrow = sorted(f"{name} ({arch}): {wide} of 16 bytes, {eight} of 8 bytes"
                    for (arch, name), (wide, eight) in counts.items() if wide == 0)
    assert not narrow, f"{len(narrow)} of {len(counts)} ll_kernel instantiations poll without a " \
                       f"16-byte strong SYS load:\n  " + "\n  ".join(narrow)


WIDTH_OF = {"U8": 1, "S8": 1, "U16": 2, "S16": 2, "64": 8, "128": 16}  # the listing's suffixes (none: 4)


def test_spill_reader_decodes_what_the_disassembler_lists(ll_sass):
    """local_access against cuobjdump's listing of the LL cubins (their local stores and loads:
    STL/LDL of 1, 4, 8 and 16 bytes at 3a2b473): the same instructions, the same widths."""
    seen = set()
    for (arch, name), (cubin, fn, body) in ll_sass.items():
        text = elf_sections(cubin)[".text." + fn]
        listed = {}
        for off, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", body):
            kind, *suffixes = op.split(".")
            if kind in ("STL", "LDL"):
                listed[int(off, 16)] = (kind, next((WIDTH_OF[x] for x in suffixes if x in WIDTH_OF), 4))
        words = numpy.frombuffer(text, dtype="<u8").reshape(-1, 2)  # 16-byte instructions
        local = numpy.flatnonzero(numpy.isin(words[:, 0] & 0xFFF, (STL, LDL)))
        decoded = {int(i) * 16: local_access(text, int(i) * 16) for i in local}
        assert decoded == listed, f"{name} ({arch}): local_access reads other instructions than " \
                                  f"cuobjdump lists"
        seen.update(w for _, w in listed.values())
    assert seen, "no local store or load in the LL cubins: check local_access against another cubin"
