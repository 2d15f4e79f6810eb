"""The shared-memory transport: a ring over POSIX shared memory between the CPU processes of one host.

The group is used only to bootstrap (rank 0 creates the segment and publishes its name through the
group's store); then data moves through the native ring. Caching, the worker thread that runs async
calls in order, and close() are the lifecycle every transport shares (_lifecycle.py). Which CPU
communicator a group gets (this ring on one host, _hier/'s across hosts) is chosen a layer up
(collectives.cpu_communicator).
"""
import json
import logging
import os
import time
import uuid

import torch

from . import _C, _calibrate, _env, _lifecycle
from ._lifecycle import Bootstrap, RingReduceError, Work

log = logging.getLogger("ringreduce")

# Slice size of the shared-memory ring (bytes). Test-only knob: a tiny value (e.g. 64) forces many
# pipeline steps per chunk. The default is csrc/shm/protocol.h's kDefaultSliceBytes (where it
# comes from is said there).
DEFAULT_SLICE_BYTES = _C.SHM_SLICE_BYTES
# Busy-poll before sleeping on a futex. With more ranks than cores a spinning waiter steals the
# core from the rank it waits for, so it goes straight to yielding then (one 64-pause poll first):
# world 4 on 2 cores, 4 KiB all-reduce, 12.5-17 us a call against 15-25 with a 2 us spin, and no
# worse at 256 KiB-4 MiB.
SPIN_NS_DEDICATED = 50_000
SPIN_NS_OVERSUBSCRIBED = 0
# Then, with more ranks than cores, poll with sched_yield this long before the futex sleep: the
# yield hands the core to the rank being waited for at once, where a futex sleep and wake-up costs
# two system calls and a scheduler round trip per ring step.
YIELD_NS_OVERSUBSCRIBED = 1_000_000
# Auto algorithm: one-shot for all-reduces up to this many bytes, the ring above. Measured on the
# 2-core dev machine: at world 4 (oversubscribed) one-shot wins at 4-16 KiB, wins or ties at
# 32 KiB, and loses at 64 KiB (four runs). At world 2 one-shot wins up to 1 KiB and the ring from
# 2 KiB (4 runs, one-shot 3-31% slower at 2-32 KiB in all 24 cells, faster at 512 B-1 KiB in 7 of
# 8); earlier runs, before the ring's later changes, had them tied up to 16 KiB.
# Noisy machine; not measured with more ranks or on dedicated cores at world > 2.
ONESHOT_MAX_BYTES = 32 << 10
ONESHOT_MAX_BYTES_WORLD2 = 1 << 10
ALGOS = _C.SHM_ALGOS  # csrc/shm/protocol.h: kForcedAlgos
# The measured table (benchmarks/cpu_tune.py writes it): per CPU model, cores and world size, auto's
# one-shot threshold and its algorithm above it. RINGREDUCE_CPU_TUNING names another table, or
# "none" for the defaults above.
TUNING_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_tuning.json")
STEP_ALGOS = _C.SHM_STEP_ALGOS  # kStepAlgos, and "cmawhole" (cma reading whole chunks)


def is_cma(algo):
    return algo in ("cma", "cmawhole")


def check_cma_block_bytes(value):
    """The cma_block_bytes option, checked once (the environment's value went through _env)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"ringreduce: cma_block_bytes must be an integer >= 0 (the bytes cma reads "
                         f"from a peer at a time; 0: the whole chunk), got {value!r}")
    return value


def cpu_model():
    """/proc/cpuinfo's model name (the tuning table's key), else the platform's name for the CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


def tuned(model, cores, world, path=TUNING_PATH):
    """(oneshot_max or None, steps, where from): the table's entry for this CPU model, number of
    cores the ranks share and world size. steps: [(from_bytes, algo)], auto's algorithm above the
    one-shot threshold (the last step a size reaches; the ring below the first). No entry: (None,
    [], why), the defaults in this file."""
    try:
        with open(path) as f:
            entries = json.load(f)["entries"]
    except (OSError, ValueError, KeyError) as e:
        return None, [], f"the defaults (no table: {e})"
    for e in entries:
        if (e["cpu_model"], e["cores"], e["world"]) == (model, cores, world):
            steps = [(int(b), str(a)) for b, a in e.get("steps", [])]
            bad = [a for _, a in steps if a not in STEP_ALGOS]
            if bad:
                raise ValueError(f"ringreduce: {path}: a step's algorithm must be one of "
                                 f"{', '.join(STEP_ALGOS)}, got {bad[0]!r}")
            return (int(e["oneshot_max"]), sorted(steps),
                    f"measured on {model} ({e.get('date', '?')}, {e.get('command', '?')})")
    return None, [], (f"the defaults (no measurement for {model!r}, {cores} cores, world {world} "
                      f"in {os.path.basename(path)})")


def without_cma(steps):
    """steps with cma replaced by the ring: where a rank cannot read its peers' memory."""
    return [(b, "ring" if is_cma(a) else a) for b, a in steps]


def calibrate_from_env():
    """RINGREDUCE_CALIBRATE: auto (default: the cached calibration of this machine class, else a
    fresh one), off or 0 (the table, else the defaults), force (calibrate again, rewrite the cache)."""
    mode = _env.get("RINGREDUCE_CALIBRATE", "auto")
    return "off" if mode == "0" else mode


def allow_ptrace_by_peers():
    """Where Yama restricts ptrace to descendants, let the peers read this process by cma (what
    csrc/shm/protocol.cpp does when cma is configured); calibration may time cma before it is."""
    import ctypes
    try:
        ctypes.CDLL(None, use_errno=True).prctl(0x59616D61, ctypes.c_ulong(-1), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def algo_from_env():
    return _env.get("RINGREDUCE_ALGO", "auto")


class Communicator(_lifecycle.Communicator):
    """A shared-memory ring over the ranks of one process group on one host."""

    transport = "shm"

    def __init__(self, group=None, timeout=None, slice_bytes=None, member=None, algo=None,
                 machine_ranks=None, cma_block_bytes=None):
        _lifecycle.require_initialized()
        super().__init__(member or _lifecycle.Member.of_group(group), timeout)
        self.slice_bytes = int(slice_bytes or _env.get("RINGREDUCE_SLICE_BYTES", DEFAULT_SLICE_BYTES))
        # cma's read size (csrc/shm/options.h): the slice unless set; 0 reads whole chunks.
        self.cma_block_bytes = check_cma_block_bytes(
            _env.get("RINGREDUCE_CMA_BLOCK_BYTES", self.slice_bytes) if cma_block_bytes is None
            else cma_block_bytes)
        ncpu = len(os.sched_getaffinity(0))
        # machine_ranks: the processes of the job on this machine, when more than this ring's own
        # (simulated hosts); they compete for the same cores.
        oversubscribed = max(self.world_size, machine_ranks or 0) > ncpu
        self.spin_ns = _env.get("RINGREDUCE_SPIN_NS",
                                SPIN_NS_OVERSUBSCRIBED if oversubscribed else SPIN_NS_DEDICATED)
        self.yield_ns = _env.get("RINGREDUCE_YIELD_NS", YIELD_NS_OVERSUBSCRIBED if oversubscribed else 0)
        self.algo = algo if algo is not None else algo_from_env()
        if self.algo not in ALGOS:
            raise ValueError(f"ringreduce: algo must be one of {', '.join(ALGOS)}, got {self.algo!r}")
        self.stream = _env.get("RINGREDUCE_STREAM", "auto")
        table = _env.get("RINGREDUCE_CPU_TUNING", TUNING_PATH)
        if table == "none":
            oneshot_max, steps, self.tuning = None, [], "the defaults (RINGREDUCE_CPU_TUNING=none)"
        else:
            oneshot_max, steps, self.tuning = tuned(cpu_model(), ncpu, self.world_size, table)
        # Where the steps come from: "table", "defaults", or "calibration (cached|fresh)" (below).
        self.tuning_source = "table" if self.tuning.startswith("measured on ") else "defaults"
        if oneshot_max is None:
            oneshot_max = ONESHOT_MAX_BYTES_WORLD2 if self.world_size == 2 else ONESHOT_MAX_BYTES
        self.oneshot_max_bytes = _env.get("RINGREDUCE_ONESHOT_MAX_BYTES", oneshot_max)
        self.auto_steps = steps if self.algo == "auto" else []
        self._calibration = self._may_calibrate(ncpu, machine_ranks)
        if self._calibration:
            allow_ptrace_by_peers()
        self._native = self._bootstrap()
        self._setup_trace(self._trace_prefix, self._native.recorder())
        plan = self._plan_text()
        log.debug("rank %d/%d: shm ring ready (slice %d B, cma block %d B, timeout %g s, spin %d ns, "
                  "yield %d ns, %s: %s)", self.rank, self.world_size, self.slice_bytes,
                  self.cma_block_bytes, self.timeout,
                  self.spin_ns, self.yield_ns, plan, self.tuning)

    def _plan_text(self):
        """What auto runs, as the debug log says it; in deterministic mode what csrc/shm/protocol.cpp's
        choose() runs then (rank-order algorithms only)."""
        if not _C.deterministic():
            return (f"algo {self.algo}, one-shot up to {self.oneshot_max_bytes} B, then "
                    f"{self.auto_steps or 'the ring'}")
        if self.algo in ("cma", "twoshot"):
            return f"deterministic mode: {self.algo}"
        if self.algo == "oneshot":
            return "deterministic mode: all_reduce one-shot, reduce_scatter two-shot"
        cma = " (cma from where the steps pick it)" if any(is_cma(a) for _, a in self.auto_steps) else ""
        return (f"deterministic mode: all_reduce one-shot up to {self.oneshot_max_bytes} B, then "
                f"two-shot{cma}; reduce_scatter two-shot")

    # -- setup -------------------------------------------------------------------------------
    def _bootstrap(self):
        setup = Bootstrap(self.member, "shm", self.timeout)
        self._trace_prefix = setup.prefix
        deadline = time.monotonic() + self.timeout
        name = None
        try:
            if self.rank == 0:
                name = "/ringreduce-%d-%s" % (os.getpid(), uuid.uuid4().hex[:12])
                native = _C.ShmComm(name, True, 0, self.world_size, self.slice_bytes, self.timeout,
                                    **self._tuning())
                setup.set("name", name)
            else:
                name = setup.get("name", "rank 0 of the group to create the shared memory").decode()
                native = _C.ShmComm(name, False, self.rank, self.world_size, self.slice_bytes,
                                    self.timeout, **self._tuning())
            # The last rank to map the segment removes its name: from then on nothing is left in
            # /dev/shm, even if every process is killed.
            joined = setup.add("mapped", 1)
            if joined == self.world_size:
                _C.shm_unlink(name)
            while joined < self.world_size:
                if time.monotonic() > deadline:
                    native.close()
                    raise RingReduceError(
                        f"ringreduce: rank {self.rank}: communicator setup timed out after "
                        f"{self.timeout:g} s: only {joined} of {self.world_size} ranks joined "
                        f"({_lifecycle.SETUP_HINT})")
                time.sleep(0.001)
                joined = setup.add("mapped", 0)
            self._cma_agreed = False
            if self._calibration:
                self._calibrate(setup, native)
            if any(is_cma(a) for _, a in self.auto_steps) and not self._cma_agreed:
                self._agree_on_cma(setup, native)
            return native
        except BaseException:
            if self.rank == 0 and name is not None:
                _C.shm_unlink(name)
            raise

    def _tuning(self):
        return dict(spin_ns=self.spin_ns, yield_ns=self.yield_ns, algo=self.algo,
                    oneshot_max_bytes=self.oneshot_max_bytes, trace_buffer=self.trace_buffer,
                    stream=self.stream, auto_steps=self.auto_steps,
                    cma_block_bytes=self.cma_block_bytes)

    def _may_calibrate(self, ncpu, machine_ranks):
        """The machine key if this communicator calibrates (or reads the cache), else None, the
        reason said in self.tuning."""
        mode = calibrate_from_env()
        why = ("RINGREDUCE_CALIBRATE=off" if mode == "off" else
               "an algorithm is forced" if self.algo != "auto" else
               "world 1" if self.world_size == 1 else
               # deterministic calls run rank-order substitutes of what would be timed
               "deterministic mode" if _C.deterministic() else None)
        if why:
            self.tuning += f"; not calibrated: {why}"
            return None
        key = _calibrate.machine_key(cpu_model(), ncpu, self.world_size, self.slice_bytes,
                                     self.cma_block_bytes)
        key["machine_ranks"] = max(self.world_size, machine_ranks or 0)
        return dict(key=key, mode=mode)

    def _calibrate(self, setup, native):
        """Rank 0 takes this machine class's cached steps, or every rank times the algorithms and
        rank 0 derives the steps; every rank then runs rank 0's steps."""
        key, mode = self._calibration["key"], self._calibration["mode"]
        path = _calibrate.cache_path(key)
        if self.rank == 0:
            cached = None if mode == "force" else _calibrate.read_cache(path, key)
            setup.set("cal/plan", "cached" if cached else "fresh")
        plan = setup.get("cal/plan", "rank 0's calibration plan").decode()
        if plan == "cached":
            if self.rank == 0:
                setup.set("cal/steps", json.dumps({"steps": cached[0], "why": (
                    f"calibration (cached in {path}, measured {cached[1].get('date', '?')})")}))
        else:
            t0 = time.perf_counter()
            why = native.cma_probe()
            setup.set(f"cma/{self.rank}", why)
            denied = [v.decode() for v in setup.all("cma", self.world_size, "cross-memory attach probe")
                      if v]
            self._cma_agreed = True
            algos = [a for a in STEP_ALGOS if not is_cma(a) or not denied]
            medians = _calibrate.time_algos(native, algos, _C.OP_CODES, self.rank)
            native.drop_cma_scratch()  # cmawhole's: up to (N-1)/N of 16 MiB, wanted or not
            cost_ms = (time.perf_counter() - t0) * 1e3
            if self.rank == 0:
                fallback = without_cma(self.auto_steps) if denied else self.auto_steps
                steps = _calibrate.derive_steps(medians, fallback)
                cma = f"; cma not timed: {denied[0]}" if denied else ""
                try:
                    _calibrate.write_cache(path, key, steps, {"median_us": medians, "cost_ms": cost_ms})
                    where = f"cached in {path}"
                except OSError as e:
                    where = f"not cached: {e}"
                setup.set("cal/steps", json.dumps({"steps": steps, "why": (
                    f"calibration (fresh, {cost_ms:.0f} ms, {where}; median us {medians}{cma})")}))
        got = json.loads(setup.get("cal/steps", "rank 0's calibrated steps").decode())
        self.auto_steps = [(int(b), str(a)) for b, a in got["steps"]]
        native.set_auto_steps(self.auto_steps)
        self.tuning = f"{got['why']}, over {self.tuning}"
        self.tuning_source = f"calibration ({plan})"

    def _agree_on_cma(self, setup, native):
        """Auto runs cma only if every rank can read every peer (a ptrace policy or a seccomp
        filter may forbid it); every rank learns the same verdict before its first call."""
        why = native.cma_probe()
        setup.set(f"cma/{self.rank}", why)
        verdicts = [v.decode() for v in setup.all("cma", self.world_size, "cross-memory attach probe")]
        denied = [v for v in verdicts if v]
        if denied:
            self.auto_steps = without_cma(self.auto_steps)
            native.set_auto_steps(self.auto_steps)
            if self.rank == 0:
                log.warning("ringreduce: the measured table picks cma for large all_reduces here, "
                            "but %s; the ring runs instead", denied[0])

    def _pids(self):
        return self._native.pids()

    def algo_for(self, numel, dtype):
        """The algorithm ("ring", "oneshot", "twoshot", "cma" or "cmawhole": cma reading whole chunks)
        an all_reduce of numel elements of dtype runs."""
        return self._native.algo(numel, torch.empty(0, dtype=dtype))

    def shared_empty(self, shape, dtype):
        """A tensor in a new buffer that every rank maps (ringreduce.shared_empty). Collective."""
        numel = 1
        for d in shape:
            numel *= d
        es = torch.empty(0, dtype=dtype).element_size()
        nbytes = max(numel * es, 1)
        setup = Bootstrap(self.member, "pool", self.timeout)
        name = "/ringreduce-pool-%d-%s" % (os.getpid(), uuid.uuid4().hex[:12])
        self._native.pool_create(name, nbytes)
        try:  # the name goes as soon as every rank mapped it (or on any failure): no leftovers
            setup.set(f"buf/{self.rank}", f"{name} {nbytes}")
            entries = [v.decode().split() for v in
                       setup.all("buf", self.world_size, "shared buffer (ringreduce.shared_empty)")]
            sizes = [int(b) for _, b in entries]
            if len(set(sizes)) != 1:
                self._native.pool_drop()
                raise ValueError(f"ringreduce.shared_empty: every rank must ask for the same size "
                                 f"and dtype; bytes asked by rank: {sizes}")
            raw = self._native.pool_attach([n for n, _ in entries])
            if not setup.count("mapped", self.world_size, self.timeout):
                raise RingReduceError(
                    f"ringreduce: rank {self.rank}: shared_empty timed out after "
                    f"{self.timeout:g} s waiting for every rank to map the buffers "
                    f"({_lifecycle.SETUP_HINT})")
        finally:
            _C.shm_unlink(name)
        return raw[:numel * es].view(dtype).view(shape)

    # -- collectives (arguments already checked by ringreduce.collectives) --------------------
    # The native communicator runs every call in order on its own executor (csrc/runtime/executor.h):
    # a sync call on this thread, an async one on its worker or on the thread that waits for it.
    # Non-contiguous tensors run through contiguous copies, copied back when the call is done.
    def all_reduce(self, tensor, op_code, async_op, wire=0):
        return self._wrap(self._native.all_reduce(tensor, op_code, async_op, wire))

    def reduce_scatter(self, output, input, op_code, async_op, wire=0):
        return self._wrap(self._native.reduce_scatter(output, input, op_code, async_op, wire))

    def all_gather(self, output, input, async_op):
        return self._wrap(self._native.all_gather(output, input, async_op))

    def _wrap(self, work):
        return None if work is None else Work(None, self._interrupted, work)

    @property
    def _inflight(self):
        return self._native.inflight()

    def synchronize(self):
        """Waits until every call made so far has finished."""
        self._native.synchronize()

    # -- lifetime ----------------------------------------------------------------------------
    @property
    def broken(self):
        return self._native.broken()

    def abort(self, reason="aborted by the user"):
        """Marks the group's ring broken: every rank's current and later calls raise."""
        self._native.abort(f"rank {self.rank}: {reason}")

    def _stop_calls(self, busy):
        if busy:  # a call still waiting on its peers would otherwise keep close() until its deadline
            self._native.abort(f"rank {self.rank}: communicator closed with calls in flight")

    def _close_native(self):
        self._native.close()  # lets queued calls end (aborted first if busy), joins the worker
