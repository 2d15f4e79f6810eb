"""What a run says before its tables: the ranks against the cores, the load average, a legend of
the backends it runs and a line for each peer it leaves out, with the reason."""
import importlib.util
import os
import textwrap

from . import load
from .cli import DEFAULT_RANKS_CPU, PEERS_HINT, cores, mpi_launchers

WIDTH = 100  # columns, as the summary (tests/test_bench.py)

# One line per table label (or its prefix before "/"), the launcher's words for what a row is.
LEGEND = {
    "ringreduce/shm": "ringreduce's automatic choice on CPU shared memory (one-shot for small "
                      "sizes, ring above)",
    "ringreduce/ring": "ringreduce's ring (reduce-scatter + all-gather) forced at every size",
    "ringreduce/oneshot": "ringreduce's one-shot (every rank reads every input) forced",
    "ringreduce/twoshot": "ringreduce's two-shot (direct reduce-scatter, then all-gather) forced",
    "ringreduce/cma": "ringreduce's two-shot over process_vm_readv (one copy) forced",
    "ringreduce/pool": "ringreduce on tensors every rank maps (rr.shared_empty): one pass",
    "ringreduce/hier": "ringreduce across hosts (--hosts): CPU tensors: shared memory inside a "
                       "host, Gloo between hosts (two-level plan, or leaders for uneven hosts); "
                       "GPU tensors: CUDA IPC inside a host, NCCL between hosts (the two-level "
                       "plan, its legs pipelined)",
    "ringreduce/p2p": "ringreduce's CUDA transport over CUDA IPC (automatic algorithm)",
    "ringreduce/p2p-shared": "ringreduce/p2p on rr.shared_empty tensors (no copy in or out)",
    "ringreduce/nccl": "ringreduce's ring over NCCL send/recv (across hosts: the flat ring, every "
                       "hop on NCCL)",
    "torch/gloo": "torch.distributed on Gloo (the CPU baseline)",
    "ringreduce/wire-bf16": "all_reduce(wire_dtype=torch.bfloat16): each rank rounded once, an "
                            "exact float32 sum in rank order, rounded once more (shm); across "
                            "hosts, each host's float32 partial sum rounded once between hosts",
    "ringreduce/wire-fp16": "ringreduce/wire-bf16 with float16 on the wire",
    "ringreduce/wire-fp8": "ringreduce/wire-bf16 with float8_e4m3fn on the wire (a float32 scale "
                           "per 128 elements)",
    "ringreduce/wire-fp8e5m2": "ringreduce/wire-fp8 with float8_e5m2",
    "torch/bf16-compress": "what torch's bf16_compress_hook does with a float32 bucket: cast to "
                           "bfloat16, all_reduce on Gloo (rounds at every step), cast back",
    "torch/fp16-compress": "torch/bf16-compress with float16 (fp16_compress_hook)",
    "torch/nccl": "torch.distributed on NCCL (the GPU baseline; ranks sharing one GPU with NCCL < 2.30 "
                  "pose as hosts and their rows say torch/nccl-socket: NCCL's socket transport, a "
                  "correctness peer, not a speed one)",
    "torch/symm-oneshot": "torch's SymmetricMemory one-shot all-reduce, the tensor copied into its "
                          "symmetric buffer first (as vLLM uses it)",
    "torch/symm-twoshot": "torch's SymmetricMemory two-shot all-reduce, with the copies in and out",
    "torch/symm-oneshot-sym": "SymmetricMemory one-shot on its own symmetric tensors (beside "
                              "ringreduce/p2p-shared)",
    "torch/symm-twoshot-sym": "SymmetricMemory two-shot on its own symmetric tensors, in place",
    "torch/ringreduce": "torch.distributed's calls on ringreduce's backend: the same transport and "
                        "algorithms as ringreduce/shm, called from torch's C++ dispatch instead "
                        "of ringreduce's Python API; at large sizes both do the same work, so a "
                        "gap there is run-to-run noise",
    "ps": "parameter server from torch.distributed ops (reduce to rank 0, then broadcast or "
          "scatter): rank 0 moves 2(N-1) tensors",
    "mpi": "MPI's collectives through mpi4py, ranks started by that MPI's mpirun",
    "deepspeed/shm": "DeepSpeed's CPU shared-memory all-reduce (sum, all-reduce only)",
}

# Peers a run may leave out: (table label, device it moves, the --backends name that asks for it).
PEERS = (("torch/gloo", "cpu", "torch"), ("ps/gloo", "cpu", "ps"),
         ("torch/nccl", "cuda", "torch"), ("ps/nccl", "cuda", "ps"),
         ("ringreduce/p2p", "cuda", "ringreduce"), ("ringreduce/nccl", "cuda", "ringreduce"),
         ("torch/symm", "cuda", "torch/symm"),
         ("mpi", "cpu", "mpi"), ("deepspeed/shm", "cpu", "deepspeed"))


def legend(label):
    return LEGEND.get(label) or LEGEND.get(label.split("/")[0]) or "(no description)"


def left_out(a):
    """[(label, why)] for every peer of PEERS that this run does not run."""
    out = []
    for label, device, name in PEERS:
        if any(b == label or b.startswith((label + "/", label + "-")) for b in a.backends):
            continue
        if device != a.device:
            why = "no GPU" if device == "cuda" else "moves CPU tensors; this run is on the GPU"
        elif device == "cuda" and a.hosts > 1 and label in ("ringreduce/p2p", "torch/symm"):
            why = f"joins the ranks of one host; this run puts them on {a.hosts} emulated hosts"
        elif name == "mpi" and (importlib.util.find_spec("mpi4py") is None or not mpi_launchers()):
            why = f"not installed (needs an MPI and mpi4py: apt-get install openmpi-bin " \
                  f"libopenmpi-dev, then {PEERS_HINT})"
        elif name == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
            why = f"not installed ({PEERS_HINT})"
        elif name in ("mpi", "deepspeed"):
            why = f"not asked for (add {name} to --backends)"
        else:
            why = f"not in --backends (add {name})"
        out.append((label, why))
    return out


def load_average():
    """(1, 5, 15 minute) load averages, or None where the platform has none."""
    try:
        return tuple(round(x, 2) for x in os.getloadavg())
    except OSError:
        return None


def load_line(when, load):
    if load is None:
        return f"# load average at {when}: unknown"
    return f"# load average at {when}: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (1, 5, 15 min) " \
           f"on {cores()} cores"


def other_work(start, end, ranks):
    """(cores other processes kept busy on average during the run, how that was measured, the
    note when they took the cores the ranks need or None). start, end: (load average, load.Sample).
    The small sizes suffer most: each call there is a few microseconds of a core, and one time
    slice lost to another process is milliseconds. Without /proc: the larger 1-minute load
    average, less the bench's ranks."""
    other = load.other_cores(start[1], end[1])
    how = "CPU time from /proc"
    if other is None:
        loads = [x[0] for x in (start[0], end[0]) if x]
        other = max(0.0, max(loads) - ranks) if loads else None
        how = "the 1-minute load average less the ranks"
    return other, how, load.busy_note(other, ranks, cores(), how)


def oversubscribed(a, local_world=None):
    """A note when a run has more ranks on this host than cores, else None."""
    n = local_world if local_world is not None else max(a.nranks)
    c = cores()
    if n <= c:
        return None
    return (f"{n} ranks on {c} cores: ranks wait for a core, so times include time slices and "
            f"ratios swing from run to run (the default is one rank per core, at most "
            f"{DEFAULT_RANKS_CPU})")


def lines(a, load, local_world=None):
    """The header: load average, ranks against cores, legend, peers left out (within WIDTH)."""
    out = [load_line("start", load)]
    note = oversubscribed(a, local_world)
    if note:
        out += textwrap.wrap(note, WIDTH, initial_indent="# note: ", subsequent_indent="#   ",
                             break_on_hyphens=False)
    out.append("# backends:")
    out += _table([(b, legend(b)) for b in a.backends])
    skipped = left_out(a)
    if skipped:
        out.append("# left out:")
        out += _table(skipped)
    return out


def _table(pairs):
    w = max(len(name) for name, _ in pairs) + 2
    out = []
    for name, text in pairs:
        out += textwrap.wrap(text, WIDTH, initial_indent=f"#   {name:<{w}}",
                             subsequent_indent="#   " + " " * w, break_on_hyphens=False)
    return out
