"""Command-line flags (nccl-tests names where they mean the same) and their defaults."""
import argparse
import math
import functools
import importlib.util
import os
import re
import shutil
import sys
import subprocess
import time

import torch

from .. import _env

# nccl-tests' type names first (the name the table prints), then torch's spellings.
DTYPES = {
    "float": torch.float32, "float32": torch.float32,
    "half": torch.float16, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "double": torch.float64, "float64": torch.float64,
    "int32": torch.int32, "int": torch.int32,
    "int64": torch.int64, "long": torch.int64,
    "int8": torch.int8, "char": torch.int8,
    "uint8": torch.uint8,
}
DTYPE_NAMES = {torch.float32: "float", torch.float16: "half", torch.bfloat16: "bfloat16",
               torch.float64: "double", torch.int32: "int32", torch.int64: "int64",
               torch.int8: "int8", torch.uint8: "uint8"}
OPS = ("sum", "prod", "min", "max", "avg")
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")
BACKENDS = ("ringreduce", "ringreduce/shm", "ringreduce/ring", "ringreduce/oneshot",
            "ringreduce/twoshot", "ringreduce/cma", "ringreduce/pool", "ringreduce/hier",
            "ringreduce/p2p", "ringreduce/p2p-shared", "ringreduce/nccl", "torch", "torch/ringreduce",
            "torch/symm", "torch/symm-oneshot", "torch/symm-twoshot", "torch/symm-oneshot-sym",
            "torch/symm-twoshot-sym", "ps", "mpi", "mpi/openmpi", "mpi/mpich", "deepspeed",
            "ringreduce/wire-bf16", "ringreduce/wire-fp16", "ringreduce/wire-fp8",
            "ringreduce/wire-fp8e5m2", "torch/bf16-compress", "torch/fp16-compress")
WIRE_NAMES = ("bf16", "fp16", "fp8", "fp8e5m2")  # --wire: ringreduce/wire-<name> (fp8: e4m3)
# torch/symm: torch's SymmetricMemory all-reduces on ordinary tensors (copied into its buffer) and
# on its symmetric tensors (-sym, beside ringreduce/p2p-shared); CUDA only
SYMM_LABELS = ("torch/symm-oneshot", "torch/symm-twoshot", "torch/symm-oneshot-sym",
               "torch/symm-twoshot-sym")
SYMM_OPS = ("one_shot_all_reduce_out", "two_shot_all_reduce_")
PEERS_HINT = "pip install '.[peers]'"
MPI_HINT = ("--backends mpi needs mpi4py and an MPI launcher: apt-get install openmpi-bin "
            f"libopenmpi-dev (and/or mpich), then {PEERS_HINT}")
# Launchers looked for: the system's default first, then the names Debian and Ubuntu give each MPI
# when several are installed side by side.
MPI_LAUNCHER_NAMES = ("mpirun", "mpiexec", "mpirun.openmpi", "mpirun.mpich", "mpiexec.hydra")
DEEPSPEED_HINT = f"--backends deepspeed needs DeepSpeed: {PEERS_HINT} (or pip install deepspeed)"

# Sweep defaults: (minbytes, maxbytes, stepfactor, iters, warmup). The CPU ones keep a default run
# of 4 ranks on the 2-core dev machine to a few minutes (measured: under 3); the GPU ones follow
# nccl-tests' habits.
DEFAULTS_CPU = (4 << 10, 64 << 20, 4, 10, 2)
DEFAULTS_GPU = (4 << 10, 256 << 20, 4, 20, 5)
DEFAULTS_QUICK = (1 << 10, 64 << 10, 8, 3, 1)
# Auto -m: each backend's batch of back-to-back calls per timed iteration is calibrated in the
# warm-up to last at least --batch_ms (default BATCH_MS), so that neither the skew of the barrier
# before an iteration nor one descheduled rank (on a 2-core machine with 4 ranks) swamps calls that
# take microseconds. The first warm-up batch moves AGG_BYTES (at most AGG_MAX calls).
AGG_BYTES, AGG_MAX = 1 << 20, 32
BATCH_MS = 50.0
BATCH_CALLS_MAX = 1 << 20
# Default rank counts, capped at the cores (at least 2): more ranks than cores wait for a core, and
# their times swing (4 ranks on the 2-core dev machine measured 4 KiB at 292x Gloo, 2 ranks 28-34x).
DEFAULT_RANKS_CPU = 4
DEFAULT_RANKS_ONE_GPU = 4
RESULTS_ROOT = "bench-results"  # default --results: RESULTS_ROOT/<date>-<time> in the current folder

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text):
    """'4096', '4K', '64M', '1G' (binary multiples; a trailing B or iB is allowed) -> bytes."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)(i?[bB])?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"invalid size {text!r} (expected e.g. 4096, 4K, 64M, 1G)")
    value = int(m.group(1)) * _SUFFIX[m.group(2).upper()]
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be > 0, got {text!r}")
    return value


def _int_at_least(low):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    return parse


def _choice_list(choices, what):
    def parse(text):
        items = [s.strip().lower() for s in text.split(",") if s.strip()]
        bad = [s for s in items if s not in choices]
        if not items or bad:
            raise argparse.ArgumentTypeError(
                f"invalid {what} {', '.join(bad) or repr(text)} (choose from {', '.join(choices)})")
        return list(dict.fromkeys(items))
    return parse


def _nranks(text):
    try:
        items = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid rank count list {text!r}") from None
    if not items or min(items) < 1:
        raise argparse.ArgumentTypeError(f"rank counts must be >= 1, got {text!r}")
    return list(dict.fromkeys(items))


DEFAULT_BACKENDS = ["ringreduce", "torch", "torch/ringreduce", "torch/symm", "ps"]


def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m ringreduce.bench",
        description="Benchmark ringreduce's collectives against torch.distributed (Gloo/NCCL) "
                    "and a parameter-server baseline, nccl-tests style.")
    p.add_argument("-b", "--minbytes", type=parse_size, help="smallest size (default 4K)")
    p.add_argument("-e", "--maxbytes", type=parse_size, help="largest size (CPU 64M, GPU 256M)")
    p.add_argument("-f", "--stepfactor", type=_int_at_least(2), help="size multiplier (default 4)")
    p.add_argument("-n", "--iters", type=_int_at_least(1), help="timed iterations (CPU 10, GPU 20)")
    p.add_argument("-w", "--warmup_iters", type=_int_at_least(0), help="warmup (CPU 2, GPU 5)")
    p.add_argument("-m", "--agg_iters", type=_int_at_least(1),
                   help="calls aggregated back to back in each timed iteration; the time is per "
                        "call (default: calibrated per backend and size to --batch_ms; --quick 1)")
    p.add_argument("--batch_ms", type=float, default=BATCH_MS,
                   help="with automatic -m, the least duration of a timed batch (default 50)")
    p.add_argument("-c", "--check", type=int, choices=(0, 1), default=1,
                   help="check every timed result (default 1)")
    p.add_argument("-d", "--datatype", choices=sorted(DTYPES), default="float")
    p.add_argument("-o", "--op", choices=OPS, default="sum")
    p.add_argument("--nranks", type=_nranks,
                   help="rank counts, comma list; the sweep runs once per count (default: CPU "
                        "one per core, 2 to 4; one rank per GPU, or 4 on one GPU, at most one "
                        "per core)")
    p.add_argument("--collectives", type=_choice_list(COLLECTIVES, "collective"),
                   default=list(COLLECTIVES), help="comma list (default all)")
    p.add_argument("--backends", type=_choice_list(BACKENDS, "backend"),
                   default=DEFAULT_BACKENDS,
                   help="comma list of ringreduce[/shm|/ring|/oneshot|/twoshot|/cma|/pool|/p2p|/p2p-shared|/nccl] (ringreduce on "
                        "the CPU: auto, ring and one-shot algorithms), torch (Gloo or NCCL), "
                        "torch/ringreduce (torch.distributed calls on ringreduce's backend), "
                        "torch/symm[-oneshot|-twoshot][-sym] (GPU: torch's SymmetricMemory "
                        "all-reduces; skipped without a GPU), ps, "
                        "mpi[/openmpi|/mpich] (mpi4py; every MPI installed, or one; the suite starts "
                        "the ranks with that MPI's mpirun), deepspeed (its "
                        "shm all-reduce, float32 sum) (default: all but mpi and deepspeed)")
    p.add_argument("--wire", type=_choice_list(WIRE_NAMES, "wire"), default=[],
                   help="comma list of bf16, fp16, fp8 (e4m3), fp8e5m2: adds ringreduce/wire-<name> "
                        "(all_reduce / reduce_scatter_tensor with wire_dtype=; CUDA: the p2p "
                        "transport) and, on the CPU, torch's "
                        "compress hooks' way (torch/bf16-compress, torch/fp16-compress) beside the "
                        "backends, and a column of the largest error against the exact result")
    p.add_argument("--results", metavar="DIR",
                   help="folder for results.json, busbw.png (needs matplotlib) and summary.md "
                        f"(default: {RESULTS_ROOT}/<date>-<time> in the current folder)")
    p.add_argument("--no-results", action="store_true", help="write no results folder")
    p.add_argument("--json", metavar="PATH", help="write every row and the machine to PATH")
    p.add_argument("--plot", metavar="PATH.png",
                   help="busbw vs size plot; with several --nranks also PATH-stem_vs_n.png")
    p.add_argument("--hosts", type=_int_at_least(1), default=1,
                   help="CPU: split the ranks into H simulated hosts (blocks of consecutive ranks) "
                        "for the row ringreduce/hier, the hierarchical all-reduce (shared memory "
                        "inside a host, Gloo over loopback TCP between hosts); the other rows stay "
                        "flat. GPU: every rank on one of H emulated hosts (RINGREDUCE_HOST_ID and "
                        "NCCL_HOSTID per block of ranks; NCCL's sockets over loopback between "
                        "them), rows ringreduce/hier (CUDA IPC inside a host, NCCL between "
                        "hosts), ringreduce/nccl (the flat ring) and torch/nccl (default 1)")
    p.add_argument("--link", metavar="RATE",
                   help="with --hosts H >= 2: run every rank on H emulated hosts (network "
                        "namespaces on a bridge, each host's link shaped both ways to RATE by tc "
                        "tbf, e.g. 1gbit, 10gbit; 'none': unshaped veth), started by torchrun "
                        "per host; needs root. Default backends there: torch (Gloo or NCCL over "
                        "the link) and ringreduce/hier, and on GPUs ringreduce/nccl")
    p.add_argument("--quick", action="store_true", help="small sweep for smoke tests")
    # Test-only: corrupts rank 0's result of BACKEND once per row (see the package docstring).
    p.add_argument("--corrupt-for-test", metavar="BACKEND", help=argparse.SUPPRESS)
    # Test-only: rank 0 sleeps MS inside every batch of the first --warmup_iters iterations.
    p.add_argument("--stall-for-test", metavar="MS", type=float, default=0.0,
                   help=argparse.SUPPRESS)
    # Test-only: rank RANK aborts (SIGABRT) at exit, after its sweep and teardown.
    p.add_argument("--crash-at-exit-for-test", metavar="RANK", type=int, default=None,
                   help=argparse.SUPPRESS)
    return p


def under_torchrun():
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def parse_args(argv=None):
    """Parses and completes the flags; errors exit 2 with argparse's message."""
    parser = build_parser()
    a = parser.parse_args(argv)
    gpu = torch.cuda.is_available()
    a.device = "cuda" if gpu else "cpu"
    base = DEFAULTS_QUICK if a.quick else DEFAULTS_GPU if gpu else DEFAULTS_CPU
    for name, value in zip(("minbytes", "maxbytes", "stepfactor", "iters", "warmup_iters"), base):
        if getattr(a, name) is None:
            setattr(a, name, value)
    if a.quick and a.agg_iters is None:
        a.agg_iters = 1
    if a.batch_ms <= 0:
        parser.error(f"--batch_ms must be > 0, got {a.batch_ms}")
    if a.agg_iters is None:
        a.warmup_iters = max(a.warmup_iters, 1)  # the calibration runs in the warm-up
    if a.minbytes > a.maxbytes:
        parser.error(f"-b/--minbytes ({a.minbytes}) is larger than -e/--maxbytes ({a.maxbytes})")
    a.dtype = DTYPES[a.datatype]
    a.type_name = DTYPE_NAMES[a.dtype]
    a.torchrun = under_torchrun()
    if a.torchrun:
        world = int(os.environ["WORLD_SIZE"])
        if a.nranks and a.nranks != [world]:
            parser.error(f"--nranks {','.join(map(str, a.nranks))} differs from torchrun's "
                         f"WORLD_SIZE={world}")
        a.nranks = [world]
    elif a.nranks is None:
        count = torch.cuda.device_count() if gpu else 0
        n = DEFAULT_RANKS_ONE_GPU if gpu else DEFAULT_RANKS_CPU
        a.nranks = [count if count >= 2 else min(n, max(2, cores()))]
    if a.results is not None and a.no_results:
        parser.error(f"--results {a.results} and --no-results: choose one")
    if a.results is None and not a.no_results:
        a.results = os.path.join(RESULTS_ROOT, time.strftime("%Y%m%d-%H%M%S"))
        if os.path.exists(a.results):  # another run this second
            a.results += f"-{os.getpid()}"
    a.lab = _env.get(LAB_ENV)  # set by the --link launcher for the ranks it starts
    a.link_gbps = _env.get(LAB_GBPS_ENV)  # what a socket got across it
    if a.hosts > 1 and a.device == "cuda" and a.torchrun and not a.lab:
        parser.error(f"--hosts {a.hosts} on GPUs emulates hosts among the ranks the bench starts "
                     f"itself (or, with --link, in the lab); under torchrun the hosts are "
                     f"torchrun's nodes: run without --hosts")
    if a.hosts > 1 and a.device == "cuda" and any(n % a.hosts for n in a.nranks):
        parser.error(f"--hosts {a.hosts} on GPUs: --nranks must be multiples of it (the two-level "
                     f"plan needs the same number of ranks on every host), got "
                     f"{','.join(map(str, a.nranks))}")
    if a.link is not None:
        _check_link(a, parser)
    if a.hosts > min(a.nranks):
        parser.error(f"--hosts {a.hosts}: more simulated hosts than ranks (--nranks "
                     f"{','.join(map(str, a.nranks))})")
    a.skipped = []  # one line per command-line name left out here, with the reason
    # Every rank on an emulated host: the lab's, or on GPUs --hosts alone (one process's NCCL and
    # transports see one host id, so no row of such a run is on one host).
    lab = a.link is not None or a.lab or (a.hosts > 1 and a.device == "cuda")
    if lab and a.backends == DEFAULT_BACKENDS:
        a.backends = ["torch", "ringreduce/hier"] + (["ringreduce/nccl"] if a.device == "cuda" else [])
    if a.wire:
        # CUDA: the p2p transport's wire; torch's compress hooks are compared on the CPU only
        a.backends = list(a.backends) + [f"ringreduce/wire-{w}" for w in a.wire] + (
            (["torch/bf16-compress"] + (["torch/fp16-compress"] if "fp16" in a.wire else []))
            if a.device == "cpu" else [])
    a.backends = expand_backends(a.backends, a.device, parser, a.hosts, a.skipped)
    if lab:
        for b in [b for b in a.backends if b in ONE_HOST]:
            a.backends.remove(b)
            a.skipped.append(f"{b} skipped: it joins the ranks of one host, and "
                             f"{'--link' if a.device == 'cpu' else '--hosts on GPUs'} puts them on "
                             f"{a.hosts} emulated hosts")
    if not a.backends:
        parser.error("no backend to run: " + "; ".join(a.skipped))
    if a.corrupt_for_test in BACKENDS:  # a command-line name: the first label it stands for
        a.corrupt_for_test = (expand_backends([a.corrupt_for_test], a.device, parser, a.hosts, [])
                              or [a.corrupt_for_test])[0]
    if a.corrupt_for_test and a.corrupt_for_test not in a.backends:
        parser.error(f"--corrupt-for-test {a.corrupt_for_test}: not one of the backends run "
                     f"({', '.join(a.backends)})")
    if a.plot and not a.plot.lower().endswith(".png"):
        parser.error(f"--plot {a.plot}: the path must end in .png")
    if a.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib: pip install matplotlib (or install ringreduce with "
                     "its [bench] extra: pip install '.[bench]')")
    return a


def cores():
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0))


def _launcher_kind(path):
    """The MPI implementation a launcher belongs to (openmpi, mpich, or mpi if unknown), or None."""
    try:
        text = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return "openmpi" if "Open MPI" in text or "OpenRTE" in text else \
        "mpich" if "HYDRA" in text or "MPICH" in text else "mpi"


@functools.lru_cache(None)
def mpi_launchers():
    """{implementation: launcher path} of every MPI launcher on PATH, the default mpirun's first."""
    found = {}
    for name in MPI_LAUNCHER_NAMES:
        path = shutil.which(name)
        kind = _launcher_kind(path) if path else None
        if kind is not None and kind not in found:
            found[kind] = path
    return found


def mpi_launcher():
    """(implementation, mpirun path) of the default MPI launcher, or None."""
    return next(iter(mpi_launchers().items()), None)


def symm_unavailable(device):
    """Why torch's SymmetricMemory all-reduces cannot run here, or None."""
    if device != "cuda":
        return "no GPU"
    ops = getattr(torch.ops, "symm_mem", None)
    missing = [op for op in SYMM_OPS if ops is None or not hasattr(ops, op)]
    if missing:
        return f"torch {torch.__version__} has no torch.ops.symm_mem.{missing[0]}"
    return None


# The --link launcher tells the ranks it starts (under torchrun, one per emulated host) what the
# lab is, in this variable: the header line, and "the hosts are real" to ringreduce/hier.
LAB_ENV = "RINGREDUCE_BENCH_LAB"
LAB_GBPS_ENV = "RINGREDUCE_BENCH_LAB_GBPS"  # and the GB/s one TCP stream got across the link
# Backends that join ranks of one host only: left out on emulated hosts.
ONE_HOST = ("ringreduce/shm", "ringreduce/ring", "ringreduce/oneshot", "ringreduce/twoshot",
            "ringreduce/cma", "ringreduce/pool", "torch/ringreduce", "deepspeed/shm",
            "ringreduce/p2p", "ringreduce/p2p-shared") + SYMM_LABELS


def _check_link(a, parser):
    from .netlab import lab_unavailable, rate_bits
    if a.link != "none":
        try:
            rate_bits(a.link)
        except ValueError as e:
            parser.error(f"--link: {e}")
    if a.hosts < 2:
        parser.error(f"--link {a.link} needs --hosts H with H >= 2 emulated hosts")
    if a.torchrun:
        parser.error("--link starts the ranks itself (torchrun per emulated host); run it "
                     "without torchrun")
    if any(b.startswith("mpi") for b in a.backends):
        parser.error("--link: the MPI backend starts its ranks with mpirun, not on the hosts")
    if len(a.nranks) != 1 or a.nranks[0] % a.hosts:
        parser.error(f"--link: --nranks must be one multiple of --hosts {a.hosts} (torchrun "
                     f"starts the same number of ranks on every host), got "
                     f"{','.join(map(str, a.nranks))}")
    why = lab_unavailable()
    if why:
        print(f"ringreduce.bench: --link: {why}", file=sys.stderr, flush=True)
        sys.exit(2)


def expand_backends(names, device, parser, hosts=1, skipped=None):
    """Command-line names -> labels shown in the table, e.g. ringreduce -> ringreduce/shm. Names
    that cannot run here but are not errors (torch/symm without a GPU) add a line to skipped."""
    base = "nccl" if device == "cuda" else "gloo"
    out = []
    for name in names:
        if name.startswith("torch/symm"):
            why = symm_unavailable(device)
            if why is None:
                out += list(SYMM_LABELS) if name == "torch/symm" else [name]
            elif name == "torch/symm":
                if skipped is not None:
                    skipped.append(f"torch/symm-* skipped: {why}")
            else:
                parser.error(f"--backends {name}: {why} (torch's SymmetricMemory moves CUDA "
                             f"tensors)")
            continue
        if name == "ringreduce":
            # GPUs across hosts: the two-level plan where p2p would stand (it joins one host)
            out += (["ringreduce/hier" if hosts > 1 else "ringreduce/p2p", "ringreduce/nccl"]
                    if device == "cuda" else
                    ["ringreduce/shm", "ringreduce/ring", "ringreduce/oneshot"] +
                    (["ringreduce/hier"] if hosts > 1 else []))
        elif name == "mpi" or name.startswith("mpi/"):  # mpi: every MPI installed
            if device != "cpu":
                parser.error(f"--backends {name}: the MPI backend moves CPU tensors only")
            launchers = mpi_launchers()
            if not launchers or importlib.util.find_spec("mpi4py") is None:
                parser.error(MPI_HINT)
            if name != "mpi" and name.split("/", 1)[1] not in launchers:
                parser.error(f"--backends {name}: no {name.split('/', 1)[1]} launcher on PATH "
                             f"(found: {', '.join(launchers)}); looked for "
                             f"{', '.join(MPI_LAUNCHER_NAMES)}")
            out += [f"mpi/{kind}" for kind in launchers] if name == "mpi" else [name]
        elif name == "deepspeed":
            if device != "cpu":
                parser.error("--backends deepspeed: DeepSpeed's shm all-reduce moves CPU tensors only")
            if importlib.util.find_spec("deepspeed") is None:
                parser.error(DEEPSPEED_HINT)
            out.append("deepspeed/shm")
        elif name.startswith("ringreduce/"):
            transport = name.split("/", 1)[1]
            if transport == "hier" and hosts < 2:
                parser.error(f"--backends {name} needs --hosts H with H >= 2 simulated hosts")
            if transport in ("ring", "oneshot", "twoshot", "cma", "pool"):
                transport = "shm"  # an algorithm of the shm transport
            if transport.startswith("wire-"):  # the narrow wire: shm on the CPU, p2p on CUDA
                transport = "shm" if device == "cpu" else "p2p"
            if transport == "p2p-shared":
                transport = "p2p"  # shared_empty buffers on the GPU: the registered algorithm
            if transport != "hier" and (transport == "shm") != (device == "cpu"):
                parser.error(f"--backends {name}: transport {transport} does not move "
                             f"{device.upper()} tensors")
            out.append(name)
        elif name in ("torch/ringreduce", "torch/bf16-compress", "torch/fp16-compress"):
            if name.endswith("-compress") and device != "cpu":
                parser.error(f"--backends {name}: the wire comparison runs on the CPU")
            out.append(name)
        else:
            out.append(f"{name}/{base}")
    return list(dict.fromkeys(out))


def agg_iters(a, size):
    """Calls in the first batch at this size: -m, or the automatic first guess above."""
    if a.agg_iters is not None:
        return a.agg_iters
    return max(1, min(AGG_MAX, AGG_BYTES // size))


def calibrated(agg, seconds, batch_ms):
    """Calls for a batch of at least batch_ms, from a batch of agg calls that took seconds."""
    per_call = max(seconds, 1e-9) / agg
    return max(1, min(BATCH_CALLS_MAX, math.ceil(batch_ms * 1e-3 / per_call)))


def sizes(a):
    """The sweep: minbytes, minbytes*f, ... <= maxbytes."""
    out, size = [], a.minbytes
    while size <= a.maxbytes:
        out.append(size)
        size *= a.stepfactor
    return out
