"""CUDA transports: p2p (our kernels over CUDA IPC), nccl (our ring over NCCL send/recv) and hier
(ranks on several hosts: p2p inside each host, nccl between hosts; csrc/cuda/hier/endpoint.h).

Python owns policy and lifetime, as for the shared-memory ring, through the same lifecycle
(_lifecycle.py): the transport choice (logged with its reason), the bootstrap through the group's
store, one cached communicator per (group, device, transport), the worker thread, close().

Semantics, as torch.distributed with NCCL where it has them:
- A synchronous p2p collective runs on the caller's current stream; an async one, or any nccl
  collective, on the communicator's stream after the work already on the caller's current stream
  (the caller's stream waits for a sync nccl call's result). Calls of one communicator run in call
  order whatever streams they are made on (csrc/binding/cuda_comm.cpp, follow()). A synchronous
  call returns once it is enqueued: the host does not wait. If the collective then fails on the
  device (a timeout, mismatched calls, a dead peer, an abort), the failure is recorded and the
  next call on the communicator raises it at once
  ("broken by an earlier failure: ..."): torch's NCCL backend reports asynchronous errors the same
  way, at a later call or wait. RINGREDUCE_BLOCKING_WAIT=1 makes every synchronous call wait for the
  device and raise its own failure (the role of TORCH_NCCL_BLOCKING_WAIT).
- async_op=True returns a Work whose future completes only once the collective has finished on the
  device (the communicator's worker thread waits for it), with the result or with the error: a DDP
  hook's future never hands on a bucket that failed, and Work.wait() blocks the host until the
  collective is done and raises its failure.
- A dead peer process is noticed within about a second (a native thread watches the pids of the
  ranks on this host) instead of at the timeout.
- World 1 moves nothing: all_reduce returns at once, reduce_scatter/all_gather out of place copy on
  the caller's stream; async_op=True returns a completed Work (nothing on our stream, no worker).

Lifetime (csrc/binding/cuda_comm.cpp says how): the communicator's stream is never destroyed, since
torch may refer to it after close() (self._stream, a Future's events); the tensors of a call on
that stream are held until the device is done with them instead of record_stream. A synchronous
p2p call runs on the caller's stream as any torch op does: a tensor made on another stream needs
record_stream there, as for any op (torch's NCCL backend records it itself).
"""
import os
import threading
import uuid
import warnings

import torch

from .. import _C, _lifecycle
from .._lifecycle import host_id  # RINGREDUCE_HOST_ID, else host name and boot id
from .. import _env
from .._lifecycle import REGISTRY, Bootstrap, Work
from . import policy
from .policy import (CLOSE_BARRIER_S, DEFAULT_SYM_BLOCKS, MAX_DIRECT_RANKS, blocking_wait,
                     staging_bytes,
                     MAX_SYM_BLOCKS, P2P_KNOBS, _WIRE_F16, _nccl_lib, _require_cuda,
                     _warned_connections, _warned_sharing, choose_transport, connections_warning, log,
                     device_record, mps_active, mps_sm_share, p2p_knobs, parse_device_records,
                     resident_blocks, sharing_warning,
                     time_sliced, usable_sms)

RingReduceError = _C.RingReduceError


def _check_connections(device):
    n = len([c for c in REGISTRY.live(("cuda", device.index))])
    msg = connections_warning(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"), n + 1)
    if msg and device.index not in _warned_connections:
        _warned_connections.add(device.index)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


class Communicator(_lifecycle.Communicator):
    """A ring over the ranks of one process group, moving tensors on one CUDA device."""

    def __init__(self, member, device, transport, timeout=None):
        _require_cuda()
        super().__init__(member, timeout)
        self.device = torch.device("cuda", device.index if device.index is not None else
                                   torch.cuda.current_device())
        self.transport = transport
        self._native = None
        self._lock = threading.Lock()  # calls from several threads enqueue one at a time
        self._blocking = blocking_wait()
        _check_connections(self.device)
        self._setup = Bootstrap(self.member, "cuda-" + transport, self.timeout)
        bootstrap = {"p2p": self._bootstrap_p2p, "nccl": self._bootstrap_nccl,
                     "hier": self._bootstrap_hier}.get(transport)
        if bootstrap is None:
            raise ValueError(f"ringreduce: RINGREDUCE_TRANSPORT must be auto, p2p, hier or nccl for "
                             f"CUDA tensors; got {transport!r}")
        native = bootstrap()
        try:
            self._watch_peers(native)
        except BaseException:
            native.close(False)
            raise
        self._native = native
        self._stream = torch.cuda.ExternalStream(native.stream_ptr(), device=self.device)
        self._setup_trace(self._setup.prefix)
        native.attach_recorder(self.recorder)  # the calls are recorded in C++, with device states

    def _bootstrap_p2p(self):
        k = p2p_knobs()
        channels, slice_bytes, chunk_bytes, algo = (k["channels"], k["slice_bytes"],
                                                    k["chunk_bytes"], k["algo"])
        # Whether every rank maps every other (the direct algorithms), and how many blocks a call
        # may use so that the kernels of all ranks sharing a device are resident together.
        direct = self._direct_possible()
        max_blocks = resident_blocks(self._devices)
        if k["blocks_cap"]:
            max_blocks = min(max_blocks, k["blocks_cap"])
        sliced = time_sliced(self._devices)
        if algo == "copy" and not direct:  # its counters are one host's shared memory
            raise ValueError("ringreduce: RINGREDUCE_CUDA_ALGO=copy needs every rank to map every "
                             "other rank's memory (one host, peer access); this group cannot")
        native = _C.P2pComm(self.device.index, self.rank, self.world_size, channels, slice_bytes,
                            self.timeout, algo, chunk_bytes, max_blocks, direct, k["copy_bytes"],
                            k["sym_blocks_set"] or DEFAULT_SYM_BLOCKS)
        try:
            # The plan of every call must be the same on every rank: so must these.
            config = k["config"].encode()
            setup, n, r = self._setup, self.world_size, self.rank
            setup.set(f"config/{r}", config)
            setup.set(f"handle/{r}", native.handle())
            for peer, theirs in enumerate(setup.all("config", n, "buffers")):
                if theirs != config:
                    raise ValueError(
                        f"ringreduce: rank {r} has p2p {'/'.join(P2P_KNOBS)} {config.decode()} "
                        f"but rank {peer} has {theirs.decode()}; set RINGREDUCE_CUDA_CHANNELS, "
                        f"RINGREDUCE_CUDA_SLICE_BYTES, RINGREDUCE_CUDA_CHUNK_BYTES, "
                        f"RINGREDUCE_CUDA_ALGO, RINGREDUCE_CUDA_MAX_BLOCKS, RINGREDUCE_CUDA_SYM_BLOCKS, "
                        f"RINGREDUCE_CUDA_IMPORT, "
                        f"and RINGREDUCE_CUDA_COPY_BYTES alike on "
                        f"every rank")
            # Every rank's handle when every rank can map every other, else the neighbours' only:
            # the same choice on every rank.
            self._tune(native, algo, k["sym_blocks_set"])
            self._warn_if_sharing()
            up, down = (r - 1) % n, (r + 1) % n
            native.connect([b"" if q == r or not (direct or q in (up, down)) else
                            setup.get(f"handle/{q}", f"rank {q}'s IPC handle") for q in range(n)])
            if native.copies() and native.direct():  # one host: the counters are shared memory
                self._attach_copy_counters(native)
            if k["imports"] and native.direct():  # ordinary tensors reduced where they lie
                on, note = policy.agree_imports(setup, r, n, _C.cuda_allocator_why_not())
                if on:
                    self._attach_shared_segment(native, "board", native.board_attach,
                                                "the board of imported memory")
                else:
                    log.debug("rank %d/%d: %s", r, n, note)
                    if note not in policy._warned_imports:  # once per process
                        policy._warned_imports.add(note)
                        warnings.warn(note, RuntimeWarning, stacklevel=3)
        except BaseException:
            native.close(False)  # the others may have mapped our memory already
            raise
        log.debug("rank %d/%d: p2p ready on %s: algorithm %s, %s, at most %d blocks a call, "
                  "%.1f MiB of device memory (ring FIFO: %d channels of %d B slices where the ring "
                  "runs; workspace: two halves of %d B where every rank maps every other), %s, "
                  "timeout %g s", self.rank, self.world_size, self.device, algo,
                  "symmetric workspace" if native.direct() else "ring only (not every rank maps "
                  "every other)", max_blocks, native.device_bytes() / 2**20, channels, slice_bytes,
                  chunk_bytes, "time-sliced (ranks share a GPU without MPS)" if sliced else
                  "not time-sliced", self.timeout)
        return native

    def _attach_copy_counters(self, native):
        """The copy algorithm's counters and abort word live in host memory every rank maps (POSIX
        shared memory, registered with CUDA), so that the watchdog and an abort release a stream
        wait with CPU stores: no release can queue behind the wait it releases."""
        self._attach_shared_segment(native, "copy", native.copy_attach,
                                    "the copy algorithm's counters")

    def _attach_shared_segment(self, native, kind, attach, what):
        """A segment of host memory every rank of the group maps (one host): rank 0 makes it, the
        others map it by name; the name goes once every rank mapped it (or on any failure)."""
        setup, r = self._setup, self.rank
        name = None
        try:
            if r == 0:
                name = "/ringreduce-%s-%d-%s" % (kind, os.getpid(), uuid.uuid4().hex[:12])
                attach(name, True)
                setup.set(f"{kind}-segment", name)
            else:
                name = setup.get(f"{kind}-segment", f"rank 0's {what}").decode()
                attach(name, False)
            if not setup.count(f"{kind}-mapped", self.world_size, self.timeout):
                raise RingReduceError(
                    f"ringreduce: rank {r}: communicator setup timed out after {self.timeout:g} s "
                    f"waiting for every rank to map {what} ({_lifecycle.SETUP_HINT})")
        finally:
            if r == 0 and name is not None:
                _C.shm_unlink(name)

    def _warn_if_sharing(self):
        per_device = sum(1 for b in self._bus_ids if b == self._bus_ids[self.rank])
        msg = sharing_warning(per_device, self.device, self._where[self.rank][3])
        if msg and self.device.index not in _warned_sharing:
            _warned_sharing.add(self.device.index)
            warnings.warn(msg, RuntimeWarning, stacklevel=2)

    def _tune(self, native, algo, sym_blocks):
        """The measured table's entry for this device, rank 0's for every rank (a plan must be the
        same on all): auto's one-shot threshold, and the workspace's most blocks unless
        RINGREDUCE_CUDA_SYM_BLOCKS set them (sym_blocks; the ranks agreed on it)."""
        if self.rank == 0:
            per_device = sum(1 for b in self._bus_ids if b == self._bus_ids[0])
            one, blocks, source = policy.tuned(torch.cuda.get_device_name(self.device), self.world_size,
                                        per_device)
            self._setup.set("tuning", f"{one if one is not None else -1}|{blocks or 0}|{source}")
        one, blocks, source = self._setup.get("tuning", "rank 0's measured table entry").decode().split("|", 2)
        one, blocks = int(one), int(blocks)
        if algo == "auto" and one >= 0:
            native.set_threshold(one)
        if sym_blocks is None and blocks > 0:
            native.set_sym_blocks(min(blocks, MAX_SYM_BLOCKS))
        log.debug("rank %d: p2p: one-shot <= %s, two-shot above (auto); workspace calls of at most %s "
                  "blocks (%s)", self.rank, f"{one} B" if one >= 0 else "the model's threshold",
                  sym_blocks or blocks or DEFAULT_SYM_BLOCKS, source)

    def _direct_possible(self):
        """Whether every rank can map every other rank's memory (the one-shot and two-shot
        algorithms write into all of them); the same answer on every rank."""
        n, r = self.world_size, self.rank
        sms = usable_sms(torch.cuda.get_device_properties(self.device).multi_processor_count,
                         mps_sm_share(self.device.index),
                         len(REGISTRY.live(("cuda", self.device.index))))
        me = device_record(host_id(), _lifecycle.machine_id(), _C.cuda_bus_id(self.device.index),
                           sms, mps_active())
        self._setup.set(f"bus/{r}", me)
        # self._where: each rank's host (plans), self._devices: its GPU (resident_blocks(),
        # time_sliced(), ranks per device in _tune)
        self._where, self._devices = parse_device_records(
            self._setup.all("bus", n, "host and device"))
        self._bus_ids = [f"{mach}|{b}" for mach, b, _, _ in self._devices]
        where = self._where
        ok = n <= MAX_DIRECT_RANKS and len({h for h, _, _, _ in where}) == 1
        for q in range(n):
            if ok and q != r:
                ok = bool(_C.cuda_can_map(self.device.index, where[q][1])[0])
        self._setup.set(f"direct/{r}", b"1" if ok else b"0")
        verdicts = self._setup.all("direct", n, "peer-access check of every pair")
        return all(v == b"1" for v in verdicts)

    def _bootstrap_nccl(self):
        lib = _nccl_lib()
        staging = staging_bytes()
        if self.rank == 0:
            self._setup.set("id", _C.nccl_unique_id(lib))
        uid = self._setup.get("id", "rank 0 of the group to create the NCCL id")
        native = _C.NcclComm(self.device.index, self.rank, self.world_size, self.timeout, staging,
                             lib, uid)
        log.debug("rank %d/%d: nccl ring ready on %s (NCCL %d, staging %d B, timeout %g s)",
                  self.rank, self.world_size, self.device, _C.nccl_version(lib), staging,
                  self.timeout)
        return native

    def _bootstrap_hier(self):
        """The two-level plan (ranks on several hosts): this host's ring over p2p, connected as
        _bootstrap_p2p connects a group's, and local rank j's ring over the hosts over nccl."""
        setup, n, r = self._setup, self.world_size, self.rank
        self._direct_possible()  # every rank's host, device, SMs and MPS (self._where)
        hosts = [h for h, _, _, _ in self._where]
        order = list(dict.fromkeys(hosts))
        by_host = [[q for q in range(n) if hosts[q] == h] for h in order]
        host = order.index(hosts[r])
        local = by_host[host].index(r)
        if len({len(rs) for rs in by_host}) != 1:
            raise ValueError(f"ringreduce: the hier transport needs the same number of ranks on every "
                             f"host; ranks by host: {by_host} (RINGREDUCE_TRANSPORT=nccl runs any layout)")
        k = p2p_knobs()
        kb = _env.get("RINGREDUCE_HIER_PIECE_KB")
        piece = kb << 10 if kb else _C.HIER_PIECE_BYTES
        # Every rank's plan of a call must be the same: its knobs and the piece size.
        config = f"{k['config']}/{piece}".encode()
        setup.set(f"config/{r}", config)
        for peer, theirs in enumerate(setup.all("config", n, "knobs")):
            if theirs != config:
                raise ValueError(f"ringreduce: rank {r} has p2p {'/'.join(P2P_KNOBS)}/piece "
                                 f"{config.decode()} but rank {peer} has {theirs.decode()}; set the "
                                 f"RINGREDUCE_CUDA_* knobs and RINGREDUCE_HIER_PIECE_KB alike on "
                                 f"every rank")
        lib = _nccl_lib()
        if host == 0:  # the id of local rank j's ring over the hosts
            setup.set(f"cross-id/{local}", _C.nccl_unique_id(lib))
        uid = setup.get(f"cross-id/{local}", f"the NCCL id of local rank {local}'s ring")
        max_blocks = resident_blocks(self._devices)  # emulated hosts may share one GPU
        if k["blocks_cap"]:
            max_blocks = min(max_blocks, k["blocks_cap"])
        # The host's waits outlast the waits between hosts (as the CPU's hierarchy): a rank waiting
        # on its host for one that waits on a lost host reports the host, not the local rank.
        grace = max(5.0, 0.05 * self.timeout)
        native = _C.HierComm(self.device.index, r, by_host, piece, self.timeout, self.timeout + grace,
                             k["chunk_bytes"], max_blocks, k["sym_blocks_set"] or DEFAULT_SYM_BLOCKS,
                             staging_bytes(), lib, uid)
        try:
            setup.set(f"handle/{r}", native.handle())
            self._warn_if_sharing()
            native.connect([b"" if q == r else setup.get(f"handle/{q}", f"rank {q}'s IPC handle")
                            for q in by_host[host]])
        except BaseException:
            native.close(False)
            raise
        log.debug("rank %d/%d: hier ready on %s: host %d of %d (local rank %d of %d; ranks by host "
                  "%s), pieces of %d B, at most %d blocks a call inside the host, timeout %g s",
                  r, n, self.device, host, len(by_host), local, len(by_host[host]), by_host, piece,
                  max_blocks, self.timeout)
        return native

    def _watch_peers(self, native):
        """The native watcher checks the pids of the ranks on this host (others cannot be seen)."""
        me = host_id()
        self._setup.set(f"pid/{self.rank}", f"{me}|{os.getpid()}")
        peers = []
        for r, value in enumerate(self._setup.all("pid", self.world_size, "process id")):
            host, pid = value.decode().rsplit("|", 1)
            if r != self.rank and host == me:
                peers.append((r, int(pid)))
        native.watch_peers(peers)

    # -- collectives (arguments already checked by ringreduce.collectives) --------------------
    def _enqueue(self, coll, fn, *args):
        """fn(*args) (the launch) inside an NVTX range and, while torch.profiler listens, a
        profiler range, both named ringreduce::<coll>."""
        name = f"ringreduce::{coll}"
        torch.cuda.nvtx.range_push(name)
        try:
            if torch._C._autograd._profiler_enabled():
                with torch.autograd.profiler.record_function(name):
                    return fn(*args)
            return fn(*args)
        finally:
            torch.cuda.nvtx.range_pop()

    def can_share(self):
        """Whether shared_empty can make buffers here (the same answer on every rank)."""
        return self.transport == "p2p" and self._native is not None and (
            self.world_size == 1 or self._native.direct())

    def shared_empty(self, shape, dtype):
        """A tensor on this device in a new buffer that every rank maps (ringreduce.shared_empty):
        all_reduce of it reads the peers' copies and writes the results into them, with no
        staging. Collective. When the tensor goes, this rank unmaps the peers' copies and frees
        its own (a peer's copy stays until that peer's tensor goes)."""
        if not self.can_share():
            raise ValueError(
                "ringreduce.shared_empty: CUDA shared buffers need the p2p transport with every "
                "rank mapping every other rank's memory (at most 16 ranks, peer access between "
                f"all their GPUs); this group runs {self.transport}"
                + ("" if self.transport != "p2p" else " without it"))
        numel = 1
        for d in shape:
            numel *= d
        nbytes = max(numel * torch.empty(0, dtype=dtype).element_size(), 1)
        setup, n, r = self._setup, self.world_size, self.rank
        # The n-th shared_empty of this communicator on every rank (the native index may differ
        # on a rank whose allocation failed): its store keys. Each rank publishes its handle or
        # its error, so that a failure on one rank fails every rank at once, not at the timeout.
        call = self._shared_calls = getattr(self, "_shared_calls", 0) + 1
        mine = f"{nbytes} {str(dtype).split('.')[-1]}"
        ident, handle, error = None, b"", None
        try:
            with self._lock:
                self._check_open()
                ident, handle = self._native.reg_alloc(nbytes)
        except Exception as e:  # noqa: BLE001 (CUDA out of memory, closed): told to every rank
            error = f"{type(e).__name__}: {e}"
        setup.set(f"reg/{call}/{r}", (b"! " + error.encode()) if error else
                  mine.encode() + b" " + handle)
        entries = setup.all(f"reg/{call}", n, "shared buffer (ringreduce.shared_empty)")
        for q, v in enumerate(entries):
            if v.startswith(b"! "):
                raise RingReduceError(f"ringreduce.shared_empty: rank {q} could not allocate "
                                      f"{nbytes} bytes on its GPU: {v[2:].decode()}")
        asked = [b" ".join(v.split(b" ", 2)[:2]).decode() for v in entries]
        if len(set(asked)) != 1:
            raise ValueError(f"ringreduce.shared_empty: every rank must ask for the same size and "
                             f"dtype; bytes and dtype asked by rank: {asked}")
        try:
            with self._lock:
                self._check_open()
                self._native.reg_connect(ident, [b"" if q == r else v.split(b" ", 2)[2]
                                                 for q, v in enumerate(entries)])
                tensor = self._native.reg_tensor(ident, numel, torch.empty(0, dtype=dtype))
            setup.set(f"reg-mapped/{call}/{r}", b"ok")
        except Exception as e:
            setup.set(f"reg-mapped/{call}/{r}", f"{type(e).__name__}: {e}".encode())
            raise
        for q, v in enumerate(setup.all(f"reg-mapped/{call}", n, "mapping of the shared buffers")):
            if v != b"ok":
                raise RingReduceError(f"ringreduce.shared_empty: rank {q} could not map the "
                                      f"shared buffers: {v.decode()}")
        return tensor.view(shape)

    def all_reduce(self, tensor, op_code, async_op, wire=0):
        with self._lock:
            self._check_open()
            self._check_wire(wire, "all_reduce")
            if tensor.is_contiguous():
                native = self._enqueue("all_reduce", self._native.all_reduce, tensor,
                                       op_code, async_op, wire)
                return self._finish(native, [tensor], check=self._wire_check(wire, "all_reduce"))
            buf = tensor.contiguous()  # reduce a contiguous copy, then write back through the view
            native = self._enqueue("all_reduce", self._native.all_reduce, buf, op_code,
                                   async_op, wire)
            return self._copy_back(native, buf, tensor, self._wire_check(wire, "all_reduce"))

    def reduce_scatter(self, output, input, op_code, async_op, wire=0):
        fn = "reduce_scatter_tensor"
        with self._lock:
            self._check_open()
            self._check_wire(wire, fn)
            src = input.contiguous()
            dst = output if output.is_contiguous() else torch.empty_like(
                output, memory_format=torch.contiguous_format)
            native = self._enqueue("reduce_scatter", self._native.reduce_scatter, dst, src,
                                   op_code, async_op, wire)
            if dst is output:
                return self._finish(native, [output], check=self._wire_check(wire, fn))
            return self._copy_back(native, dst, output, self._wire_check(wire, fn))

    # -- the narrow wire (csrc/cuda/p2p/sym_wire.cu) ---------------------------------------------
    def _check_wire(self, wire, fn):
        if not wire:
            return
        # Which transport's wire runs which call: the binding's one wire check (Caps).
        if wire == _WIRE_F16 and torch.cuda.is_current_stream_capturing():
            raise NotImplementedError(
                f"ringreduce.{fn}: wire_dtype=torch.float16 cannot be captured in a CUDA graph "
                f"(its overflow check waits for the device); use torch.bfloat16")

    def _wire_check(self, wire, fn):
        """What _finish checks after a float16 wire call: its op_seq and name; else None."""
        return (self._native.op_seq(), fn) if wire == _WIRE_F16 else None

    def _overflow(self, check):
        """The message of a float16 wire call (finished on the device) that overflowed, or None."""
        seq, fn = check
        native = self._native
        if native is None or native.closed() or not native.wire_overflowed(seq):
            return None  # closed before the Work was waited for: the record went with it
        return (f"ringreduce: {fn}(wire_dtype=float16): a finite value beyond float16's range "
                f"(65504) on the wire (an input, or a sum) of some rank; the result holds inf "
                f"there. Divide first (op=AVG), or use wire_dtype=torch.bfloat16 (float32's range)")

    def all_gather(self, output, input, async_op):
        with self._lock:
            self._check_open()
            src = input.contiguous()
            dst = output if output.is_contiguous() else torch.empty_like(
                output, memory_format=torch.contiguous_format)
            native = self._enqueue("all_gather", self._native.all_gather, dst, src, async_op)
            if dst is output:
                return self._finish(native, [output])
            return self._copy_back(native, dst, output)

    def _copy_back(self, native, buf, target, check=None):
        if native is None:  # sync: the current stream already waits for the collective
            target.copy_(buf)
            return self._finish(None, [target], check=check)
        # async: the copy runs on our stream after the collective; the Work follows the copy.
        if self.world_size == 1:  # nothing ran on our stream: copy where the caller is
            target.copy_(buf)
            return self._finish(native, [target], check=check)
        with torch.cuda.stream(self._stream):
            target.copy_(buf)
        # buf and target stay referenced (by the job) until the device has finished the copy.
        return self._finish(self._native.marker(), [target], keep=(buf,), check=check)

    def _finish(self, native_work, result, keep=(), check=None):
        """None for a sync call (after waiting for the device in blocking mode); else the Work of
        native_work, completed by the worker once the device is done. A failure seen here writes
        the flight recorder's dump (the native side records the calls). check (a float16 wire
        call, _wire_check): the call is waited for and its overflow raised, as on the CPU:
        OverflowError from a sync call, RingReduceError from the Work's wait()."""
        if native_work is not None and self.world_size == 1:
            fut = torch.futures.Future(devices=[self.device])
            with torch.cuda.device(self.device):
                if check:  # the kernel ran on the caller's stream
                    torch.cuda.current_stream(self.device).synchronize()
                    why = self._overflow(check)
                    if why:
                        fut.set_exception(RingReduceError(why))
                        return Work(fut, self._interrupted)
                fut.set_result(result)  # the result is ready on the caller's stream
            return Work(fut, self._interrupted)
        if native_work is None:
            if (self._blocking or check) and self.world_size > 1 and \
                    not torch.cuda.is_current_stream_capturing():
                try:
                    self._native.marker().synchronize()  # raises this call's failure
                except Exception:
                    self.recorder.dump_on_failure()
                    raise
            if check:
                if self.world_size == 1:
                    torch.cuda.current_stream(self.device).synchronize()
                why = self._overflow(check)
                if why:
                    raise OverflowError(why)
            return None

        def job():
            try:
                native_work.synchronize()
                del keep[:]  # the device is done with them
                native = self._native
                if native is not None and not native.closed():
                    native.release_finished()  # and with the tensors the native side held
            except BaseException:
                self.recorder.dump_on_failure()
                raise
            why = check and self._overflow(check)
            if why:  # the call completed; its result holds inf (not a communicator failure)
                raise RingReduceError(why)
        keep = list(keep)
        fut = self._submit(job, result, lambda: torch.futures.Future(devices=[self.device]),
                           inline=False)
        return Work(fut, self._interrupted)

    def _complete(self, fut, result):
        # The result is ready: events recorded on our (idle) stream cost its consumers nothing.
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            fut.set_result(result)

    # -- lifetime ----------------------------------------------------------------------------
    @property
    def broken(self):
        return self._native is not None and bool(self._native.failure())

    def synchronize(self):
        """Blocks until every collective enqueued so far is done; raises the first failure."""
        self._check_open()
        super().synchronize()
        self._native.synchronize()

    def abort(self, reason="aborted by the user"):
        """Stops this rank's collectives; the neighbours stop when they next wait on this rank."""
        self._native.abort(f"rank {self.rank}: {reason}")

    def _close_native(self):
        """Waits for our stream (collectives end by their deadline, or at once when aborted or a
        peer died), then tells the other ranks; frees our memory only once every rank has said so
        (within CLOSE_BARRIER_S): until then a neighbour may still read it. A broken communicator
        does not wait for the others (they may be dead) and keeps its memory until exit."""
        if self._native is None:  # __init__ failed before the bootstrap finished
            return
        # Under the lock the calls enqueue with: a thread that passed _check_open before close()
        # set _closed finishes its launch first, and none launches on a ring being freed (the
        # native run reads the peers' mappings without a lock of its own).
        with self._lock:
            self._close_native_locked()

    def _close_native_locked(self):
        try:
            self._native.synchronize()
        except Exception:  # the failure was raised before, or no longer matters
            pass
        broken = bool(self._native.failure())
        peers_done = False
        try:
            limit = 0.0 if broken else min(self.timeout, CLOSE_BARRIER_S)
            peers_done = self._setup.count("closed", self.world_size, limit) and not broken
            if peers_done:
                # Two phases: every rank unmaps the others' memory before any frees its own
                # (freeing memory another process maps is undefined in CUDA). A rank whose ring a
                # CUDA graph pins keeps its mappings: then every rank keeps its memory until exit.
                peers_done = False  # until the second barrier passes (the store may fail)
                if not self._native.unmap_peers():
                    self._setup.add("mapped", 1)
                peers_done = (self._setup.count("unmapped", self.world_size, limit)
                              and self._setup.add("mapped", 0) == 0)
            if not peers_done:
                log.debug("rank %d: closing %s without every rank of the group; its memory is "
                          "kept until exit", self.rank, "a broken ring" if broken else "a ring")
        except Exception:  # the store is gone (process group destroyed first)
            pass
        self._native.close(peers_done)


def get_communicator(group, device, transport="auto", **options):
    """The cached communicator of (group, device, transport), created on first use (collective)."""
    _require_cuda()
    index = device.index if device.index is not None else torch.cuda.current_device()
    dev = torch.device("cuda", index)

    def create(g):
        member = _lifecycle.Member.of_group(g)
        return Communicator(member, dev, choose_transport(member, transport, dev), **options)
    return REGISTRY.get(group, ("cuda", index, transport), create)
