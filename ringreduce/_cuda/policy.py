"""The CUDA transports' policy, apart from the communicator: which transport a group gets and why,
MPS and GPU sharing, the blocks a rank may keep resident, the p2p knobs every rank must set alike,
the measured tuning table (gpu_tuning.json), and what a build without CUDA says. Plain functions of
their inputs, tested without a GPU (tests/test_gpu_tools.py, tests/test_lifecycle.py)."""
import json
import logging
import os
import sysconfig

import torch

from .. import _C
from .._lifecycle import host_id  # RINGREDUCE_HOST_ID, else host name and boot id
from .. import _env
from .._lifecycle import Bootstrap, default_timeout

log = logging.getLogger("ringreduce")
_WIRE_F16 = _C.WIRE_CODES["float16"]  # the only wire that can overflow

# The transports' defaults come from the native code (csrc/cuda/p2p/layout.h, where each number's
# reason is; csrc/cuda/nccl/defaults.h), never spelled here.
_DEFAULTS = _C.CUDA_DEFAULTS
# p2p knobs. RINGREDUCE_CUDA_SLICE_BYTES is also the test-only knob: a tiny value (e.g. 256)
# forces many pipeline steps per chunk.
DEFAULT_CHANNELS = _DEFAULTS["channels"]
DEFAULT_SLICE_BYTES = _DEFAULTS["slice_bytes"]  # the largest slice; each call's plan cuts smaller ones
# The symmetric workspace's largest piece, bytes per rank (RINGREDUCE_CUDA_CHUNK_BYTES; the
# workspace is two of them): one barrier (two-shot: two) per piece. A tiny value forces many
# pieces per call, as RINGREDUCE_CUDA_SLICE_BYTES does slices for the ring.
DEFAULT_CHUNK_BYTES = _DEFAULTS["chunk_bytes"]
# copy: no kernel waits for another rank (for ranks sharing a GPU without MPS; opt-in, unmeasured;
# csrc/cuda/p2p/copy.cpp).
ALGOS = _C.P2P_ALGOS  # csrc/cuda/p2p/plan.h: kForcedAlgos
# The copy algorithm's largest piece (RINGREDUCE_CUDA_COPY_BYTES): each piece is a handshake, i.e.
# time slices, between ranks sharing a GPU without MPS.
DEFAULT_COPY_BYTES = _DEFAULTS["copy_bytes"]
# The direct algorithms write into every rank's memory: up to this many ranks.
MAX_DIRECT_RANKS = _DEFAULTS["max_peers"]
# nccl staging buffer (bytes, two of them).
DEFAULT_STAGING_BYTES = _DEFAULTS["staging_bytes"]
# How long close() waits for the other ranks to stop using this rank's memory.
CLOSE_BARRIER_S = 30.0
# CUDA_DEVICE_MAX_CONNECTIONS that ringreduce sets when it is imported before CUDA starts (CUDA's
# maximum); see ringreduce/__init__.py.
WANTED_CONNECTIONS = 32


# How to build the CUDA kernels where the build left them out (setup.py: no GPU was visible).
REBUILD = "RINGREDUCE_CUDA=1 pip install --no-build-isolation -e ."


def no_cuda_message():
    """What a build without CUDA says when it meets a CUDA tensor: why, and how to rebuild."""
    if torch.version.cuda is None:
        why = (f"it was built against torch {torch.__version__}, a CPU-only build; install a CUDA "
               f"build of torch, then rebuild in ringreduce's source folder")
    else:
        why = ("it was built where no GPU was visible (or with RINGREDUCE_CUDA=0, or without a "
               "CUDA toolkit); rebuild in ringreduce's source folder")
    return f"ringreduce: this build has no CUDA kernels: {why}: {REBUILD}"


def _require_cuda():
    if not getattr(_C, "cuda_compiled", False):
        raise RuntimeError(no_cuda_message())


def _nccl_lib():
    """Path of the libnccl.so.2 shipped with torch (nvidia-nccl-cu13), tried if none is loaded."""
    path = os.path.join(sysconfig.get_paths()["purelib"], "nvidia", "nccl", "lib", "libnccl.so.2")
    return path if os.path.exists(path) else ""


TUNING_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu_tuning.json")


def tuned(device_name, world, ranks_per_device, path=TUNING_PATH):
    """(oneshot_max or None, sym_blocks or None, where from): the entry of the measured table
    (gpu_tuning.json) for this device name, world size and ranks per device: auto's one-shot
    threshold, and a workspace call's most blocks where a measurement found more blocks faster;
    None: the model's threshold, the default blocks."""
    try:
        with open(path) as f:
            entries = json.load(f)["entries"]
    except (OSError, ValueError, KeyError) as e:
        return None, None, f"the model's thresholds (no table: {e})"
    for e in entries:
        if (e["device"], e["world"], e["ranks_per_device"]) == (device_name, world, ranks_per_device):
            blocks = e.get("sym_blocks")
            return (int(e["oneshot_max"]), int(blocks) if blocks else None,
                    f"measured on {e['device']} ({e.get('date', '?')}, {e.get('command', '?')})")
    return None, None, (f"the model's thresholds (no measurement for {device_name}, world {world}, "
                        f"{ranks_per_device} ranks per device in {os.path.basename(path)})")


def decide_transport(hosts, verdicts, deterministic=False):
    """(transport, reason) from every rank's host and its peer-access verdict ("ok", or why its
    device cannot map the memory of the ranks it must: its neighbours on one host, every rank of
    its host across hosts). The same inputs on every rank give the same answer.
    Across hosts: "hier" (the two-level plan: p2p inside each host, nccl between hosts) when every
    host has the same number of ranks, at most MAX_DIRECT_RANKS, all mapping each other, and not in
    deterministic mode (each host's partial sum first is not the rank order); else the flat
    "nccl" ring."""
    nhosts = len(set(hosts))
    for rank, verdict in enumerate(verdicts):
        if verdict != "ok":
            whose = "its host's ranks'" if nhosts > 1 else "its neighbours'"
            return "nccl", f"rank {rank} cannot map {whose} memory: {verdict}"
    if nhosts > 1:
        sizes = [hosts.count(h) for h in dict.fromkeys(hosts)]
        where = f"the {len(hosts)} ranks are on {nhosts} hosts"
        if deterministic:
            return "nccl", f"{where}; deterministic mode reduces in rank order: the flat ring"
        if len(set(sizes)) > 1:
            return "nccl", f"{where} with unequal rank counts {sizes}: the flat ring"
        if sizes[0] > MAX_DIRECT_RANKS:
            return "nccl", f"{where}, {sizes[0]} on each (the host's plan maps at most {MAX_DIRECT_RANKS})"
        return "hier", (f"{where}, {sizes[0]} on each, mapping each other: p2p inside each host, "
                        f"nccl between hosts")
    return "p2p", (f"all {len(hosts)} ranks are on host {hosts[0].split('/')[0]} and can map "
                   f"their neighbours' memory")


def choose_transport(member, requested, device, timeout=None):
    """p2p when every rank is on this host and every device can map its neighbours' memory (the
    same GPU, or peers in cudaDeviceCanAccessPeer's sense; every other rank's in deterministic
    mode); across hosts hier when each host's ranks map each other (decide_transport); else nccl.
    RINGREDUCE_TRANSPORT overrides. Collective: every rank of the member's group calls it."""
    if requested == "shm":
        raise ValueError("RINGREDUCE_TRANSPORT=shm cannot move CUDA tensors; use auto, p2p, hier or nccl")
    if requested in ("p2p", "nccl", "hier"):
        log.debug("transport %s: set by RINGREDUCE_TRANSPORT", requested)
        return requested
    world, rank = member.size, member.rank
    setup = Bootstrap(member, "hosts", timeout or default_timeout())
    setup.set(f"where/{rank}", f"{host_id()}|{_C.cuda_bus_id(device.index)}")
    where = [v.decode().split("|") for v in setup.all("where", world, "host and device")]
    mine = [q for q in range(world) if where[q][0] == where[rank][0]]
    verdict = "ok"
    if len(mine) < world:
        # Across hosts: the host's plan runs p2p's direct algorithms among the host's ranks.
        peers = set(mine) - {rank}
    else:
        # Deterministic mode runs p2p's direct algorithms only: every pair must map, not just
        # neighbours; else nccl (which reduces in rank order over any layout).
        peers = {(rank - 1) % world, (rank + 1) % world} - {rank}
        if _C.deterministic():
            peers = set(range(world)) - {rank}
            if world > MAX_DIRECT_RANKS:
                verdict = (f"deterministic mode needs p2p's direct algorithms, at most "
                           f"{MAX_DIRECT_RANKS} ranks")
    for peer in sorted(peers):
        ok, why = _C.cuda_can_map(device.index, where[peer][1])
        if not ok:
            verdict = why
    setup.set(f"p2p/{rank}", verdict)
    verdicts = [v.decode() for v in setup.all("p2p", world, "peer-access check")]
    transport, reason = decide_transport([h for h, _ in where], verdicts, _C.deterministic())
    log.debug("transport %s: %s", transport, reason)
    return transport


def connections_warning(value, comms_on_device):
    """The warning to give when comms_on_device communicators share a device while
    CUDA_DEVICE_MAX_CONNECTIONS is value (None: unset, CUDA's default 8), or None."""
    effective = 8
    if value is not None:
        try:
            effective = int(value)
        except ValueError:
            pass
    if comms_on_device < 2 or effective >= WANTED_CONNECTIONS:
        return None
    return (f"ringreduce: {comms_on_device} communicators use one device while "
            f"CUDA_DEVICE_MAX_CONNECTIONS={value if value is not None else '8 (unset)'}: their "
            f"kernels, which wait on other ranks, can be queued behind each other on one hardware "
            f"queue and stall until the timeout. Set CUDA_DEVICE_MAX_CONNECTIONS="
            f"{WANTED_CONNECTIONS} before CUDA starts (importing ringreduce first does that).")


_warned_connections = set()


def mps_pipe_present():
    """Whether an MPS control daemon's pipe is where CUDA clients look for it (a daemon is
    running; CUDA offers no query of whether this process is an MPS client)."""
    pipe_dir = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    return os.path.exists(os.path.join(pipe_dir, "control"))


def mps_active():
    """Whether this host's ranks share GPUs through MPS: RINGREDUCE_CUDA_MPS=1/0 says so, else
    an MPS control daemon's pipe is taken for a running daemon (mps_pipe_present)."""
    forced = _env.get("RINGREDUCE_CUDA_MPS")
    return mps_pipe_present() if forced is None else forced


def device_record(host, machine, bus, sms, mps):
    """What a rank tells the group of itself: its host (RINGREDUCE_HOST_ID: what plans go by), the
    machine it really runs on, its device's PCI bus id, the SMs it may use and whether MPS runs."""
    return f"{host}|{machine}|{bus}|{sms}|{int(bool(mps))}"


def parse_device_records(values):
    """Every rank's device_record -> (where, devices): where[q] = (host, bus, SMs, MPS) for the
    plans, devices[q] = (machine, bus, SMs, MPS) for who shares a GPU: emulated hosts (tests, the
    bench's --hosts) put ranks of different hosts on one GPU, whose blocks must all be resident."""
    where, devices = [], []
    for v in values:
        host, machine, bus, sms, mps = (v.decode() if isinstance(v, bytes) else v).rsplit("|", 4)
        where.append((host, bus, int(sms), mps == "1"))
        devices.append((machine, bus, int(sms), mps == "1"))
    return where, devices


def time_sliced(where):
    """Whether some device of the group is shared by ranks without MPS (where[q]: rank q's
    (machine, PCI bus id, SM count, MPS active)): their contexts take turns in time slices, so each
    wait of a kernel of ours for another rank's waits for a slice (logged; the copy algorithm,
    RINGREDUCE_CUDA_ALGO=copy, avoids such waits). The same answer on every rank."""
    per_device = {}
    for host, bus, _, _ in where:
        per_device[(host, bus)] = per_device.get((host, bus), 0) + 1
    return any(per_device[(host, bus)] > 1 and not mps for host, bus, _, mps in where)


def mps_sm_share(device_index):
    """The percentage of the device's SMs this process may use: the MPS client's execution
    affinity (cuCtxGetExecAffinity, CUDA 11.4+), else CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, else 100."""
    try:
        import ctypes
        cuda = ctypes.CDLL("libcuda.so.1")
        sms = torch.cuda.get_device_properties(device_index).multi_processor_count
        # CUexecAffinityParam {CUexecAffinityType type; union {struct {unsigned val;} smCount;}}
        param = (ctypes.c_uint * 2)()
        if cuda.cuCtxGetExecAffinity(param, 0) == 0 and 0 < param[1] <= sms:  # 0: SM count
            return max(1, 100 * param[1] // sms)
    except (OSError, AttributeError):
        pass
    pct = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "").strip()
    try:
        return min(100, max(1, int(float(pct)))) if pct else 100
    except ValueError:
        return 100


def usable_sms(sms, share_pct, live_comms):
    """SMs one communicator's kernels may keep resident in this process: the MPS share of the
    device, split between this communicator and the live ones already on it (their kernels may
    spin at the same time: a DDP hook's bucket beside another group's call)."""
    return max(1, sms * share_pct // 100 // (1 + live_comms))


def resident_blocks(where):
    """The most thread blocks one p2p call may use, the same on every rank: where[q] is rank q's
    (machine, PCI bus id, SM count). Every block of every rank's kernel spins until its peers' blocks
    run, so all must be resident at once, and one block of these kernels fills an SM: the SMs of a
    device over the ranks sharing it, the least over the group."""
    per_device = {}
    for host, bus, *_ in where:
        per_device[(host, bus)] = per_device.get((host, bus), 0) + 1
    return max(1, min(sms // per_device[(host, bus)] for host, bus, sms, *_ in where))


# The knobs' names in p2p_knobs()["config"] and in the error when ranks disagree.
P2P_KNOBS = ("channels", "slice_bytes", "chunk_bytes", "algo", "blocks_cap", "copy_bytes", "sym_blocks",
             "imports")
# A workspace call's most blocks, by default and at most (csrc/cuda/p2p/layout.h).
DEFAULT_SYM_BLOCKS, MAX_SYM_BLOCKS = _DEFAULTS["sym_blocks"], _DEFAULTS["max_sym_blocks"]


def p2p_knobs():
    """The p2p transport's knobs from the environment, checked, as a dict; the same string of them
    (knobs["config"]) must come from every rank, since every call's plan depends on them."""
    k = dict(channels=_env.get("RINGREDUCE_CUDA_CHANNELS", DEFAULT_CHANNELS),
             slice_bytes=_env.get("RINGREDUCE_CUDA_SLICE_BYTES", DEFAULT_SLICE_BYTES),
             chunk_bytes=_env.get("RINGREDUCE_CUDA_CHUNK_BYTES", DEFAULT_CHUNK_BYTES),
             algo=_env.get("RINGREDUCE_CUDA_ALGO", "auto"),
             # 0: as many as every rank's kernel can keep resident (resident_blocks); fewer leave
             # SMs to the model's kernels (as NCCL_MAX_CTAS does), and measure what blocks buy.
             blocks_cap=_env.get("RINGREDUCE_CUDA_MAX_BLOCKS", 0),
             copy_bytes=_env.get("RINGREDUCE_CUDA_COPY_BYTES", DEFAULT_COPY_BYTES),
             # The workspace's blocks below that cap; unset: the device's entry in gpu_tuning.json
             # where a measurement found more blocks faster, else SymmetricMemory's ~24.
             sym_blocks=_env.get("RINGREDUCE_CUDA_SYM_BLOCKS", 0))
    # Ordinary tensors reduced where they lie (csrc/cuda/p2p/imports.cpp); 0: always through the
    # workspace (a copy in and out), to measure what importing buys.
    k["imports"] = int(_env.get("RINGREDUCE_CUDA_IMPORT", True))
    k["sym_blocks_set"] = k["sym_blocks"] or None
    if not _env.is_set("RINGREDUCE_CUDA_SYM_BLOCKS"):
        k["sym_blocks"] = "measured"  # in the config the ranks compare: the table's, else the default
    k["config"] = "/".join(str(k[name]) for name in P2P_KNOBS)
    return k


def blocking_wait():
    """RINGREDUCE_BLOCKING_WAIT: every synchronous call waits for the GPU and raises its failure."""
    return _env.get("RINGREDUCE_BLOCKING_WAIT", False)


def staging_bytes():
    """The nccl transport's staging buffer (RINGREDUCE_NCCL_STAGING_BYTES; tests use 4096)."""
    return _env.get("RINGREDUCE_NCCL_STAGING_BYTES", DEFAULT_STAGING_BYTES)


def agree_imports(setup, rank, world, why_not):
    """Whether the group reduces ordinary tensors where they lie (imported memory): only if every
    rank's allocator can share them (why_not: "" where this rank's can, else why not; a rank with
    RINGREDUCE_CUDA_IMPORT=0 never gets here, as the knob is compared first). Every rank publishes
    its verdict before any waits, so a rank that cannot never leaves the others waiting. Returns
    (on, note): note names the first rank that cannot and why ("" when on)."""
    setup.set(f"imports/{rank}", why_not.encode() or b"ok")
    for q, theirs in enumerate(setup.all("imports", world, "allocator check")):
        if theirs != b"ok":
            return False, (f"ringreduce: imported memory is off for this group (ordinary tensors go "
                           f"through the workspace: a copy in and out): rank {q}: {theirs.decode()}")
    return True, ""


_warned_imports = set()


def sharing_warning(ranks_per_device, device, mps):
    """The warning for ranks_per_device ranks sharing one GPU, or None. Without MPS their kernels
    take turns in time slices and every handshake between them waits for one (measured, world 2:
    on an H100, 2.3 ms for a 4 KiB all_reduce, 38 us under MPS; 72 ms against 136 us at 16 MiB; on
    an H200, 2.26 ms against 20 us at 4 KiB, 18 ms against 62 us at 1 MiB)."""
    if ranks_per_device < 2 or mps:
        return None
    return (f"ringreduce: {ranks_per_device} ranks share {device} and no MPS daemon was found: "
            f"their contexts take turns in time slices, so every barrier between them waits for "
            f"one. Start MPS before the job (nvidia-cuda-mps-control -d; RINGREDUCE_CUDA_MPS=1 if "
            f"its pipe is elsewhere) or use one GPU per rank for speed. RINGREDUCE_CUDA_ALGO=copy "
            f"runs no kernel that waits for another rank (copies and stream waits; unmeasured).")


_warned_sharing = set()


