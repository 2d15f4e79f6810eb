"""The torch.distributed backend "ringreduce", registered when ringreduce is imported:

    dist.init_process_group("ringreduce")                 # cpu (and cuda, in a CUDA build)
    dist.init_process_group("cpu:ringreduce,cuda:nccl")   # per device

All-reduce (one tensor, or several of one dtype and device coalesced into one ring pass),
reduce-scatter and all-gather (tensor and list forms) run on the ring, over the same communicators
as the direct API. Everything else — broadcast, barrier, send/recv, gather, scatter, reduce,
all-to-all, the coalesced list forms, and dtypes or ops the ring does not serve — goes to a delegate
that this backend creates lazily on the same store under its own prefix: Gloo for CPU tensors,
NCCL for CUDA tensors. The group's timeout (init_process_group(timeout=...)) is the ring's timeout
unless RINGREDUCE_TIMEOUT is set.

torch calls the C++ half (csrc/binding/backend.cpp). Once this object has created a group's shared-memory
communicator (on the first ring call, collectively), the C++ half runs the ring operations on CPU
tensors itself, without Python: a synchronous call (async_op=False) on the calling thread, raising
RingReduceError itself, an asynchronous one (DDP's buckets) queued on the communicator's executor,
whose Work completes from C++ (a failure surfaces from Work.wait() as a RuntimeError carrying the
ring's message). Everything else is forwarded here: the first call, CUDA tensors, multi-host
(hierarchical) plans, and what is delegated.
"""
import collections
import datetime
import logging
import threading
import warnings
import weakref

import torch
import torch.distributed as dist

from . import _C, _env, _lifecycle, _shrink
from .collectives import _OP_CODES, SUPPORTED_DTYPES, cpu_communicator

log = logging.getLogger("ringreduce")
ReduceOp = dist.ReduceOp

NAME = "ringreduce"


def _op_code(op):
    """The ring's code of a ReduceOp, or None (PREMUL_SUM, BAND, ...: delegated)."""
    for known, code in _OP_CODES:
        try:
            if op == known:
                return code
        except TypeError:  # PREMUL_SUM carries a factor and compares to nothing
            return None
    return None


def _seconds(timeout):
    if timeout is None:
        return None
    return timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)


class RingBackend:
    """One process group's backend (all its device types): ring communicators and delegates, both
    created on first use. Creation is collective, like every first call on a group."""

    def __init__(self, store, rank, size, timeout, group_name, slot=None):
        self.store, self.rank, self.size = store, rank, size
        self.slot = slot  # _C.BackendSlot: what the C++ half runs without Python
        self.group_name = group_name
        self.timeout = (None if _env.is_set("RINGREDUCE_TIMEOUT") else _seconds(timeout))
        self._torch_timeout = timeout
        self._lock = threading.Lock()  # creations; a DDP thread and the main thread may race
        self._comms = {}
        self._delegates = {}
        self._calls = collections.Counter()  # "ring <op>" / "delegate <op>": for tests and debugging
        self._shrinks = 0  # shrink_group attempts on this group

    @property
    def calls(self):
        """Calls by "ring <op>" / "delegate <op>", from Python and from the C++ half."""
        merged = collections.Counter(self._calls)
        if self.slot is not None:
            merged.update(self.slot.counts())
        return merged

    # -- what serves a call ------------------------------------------------------------------
    def _comm(self, device):
        key = device.type
        comm = self._comms.get(key)
        if comm is not None and not comm.closed:
            return comm
        with self._lock:
            comm = self._comms.get(key)
            if comm is None or comm.closed:
                member = _lifecycle.Member(self.store, self.rank, self.size,
                                           f"pg-{self.group_name}-{key}")
                if device.type == "cuda":
                    from . import _cuda
                    index = device.index if device.index is not None else torch.cuda.current_device()
                    dev = torch.device("cuda", index)
                    requested = _env.get("RINGREDUCE_TRANSPORT", "auto")
                    transport = _cuda.policy.choose_transport(member, requested, dev, self.timeout)
                    comm = _cuda.Communicator(member, dev, transport, self.timeout)
                else:
                    comm = cpu_communicator(member, timeout=self.timeout)
                    if comm.transport == "shm" and self.slot is not None:
                        self.slot.set_cpu(comm._native)  # from now on the C++ half runs it
                self._comms[key] = comm
        return comm

    def _delegate(self, device_type):
        backend = self._delegates.get(device_type)
        if backend is not None:
            return backend
        with self._lock:
            backend = self._delegates.get(device_type)
            if backend is None:
                store = dist.PrefixStore(f"ringreduce-delegate/{device_type}/", self.store)
                timeout = self._torch_timeout or datetime.timedelta(seconds=_lifecycle.default_timeout())
                if device_type == "cuda":
                    opts = dist.ProcessGroupNCCL.Options()
                    opts._timeout = timeout
                    backend = dist.ProcessGroupNCCL(store, self.rank, self.size, opts)
                else:
                    backend = dist.ProcessGroupGloo(store, self.rank, self.size, timeout)
                log.debug("rank %d: backend %s delegates to %s for %s tensors", self.rank, NAME,
                          type(backend).__name__, device_type)
                self._delegates[device_type] = backend
        return backend

    def _delegated(self, device_type, name, *args):
        self._calls["delegate " + name] += 1
        return getattr(self._delegate(device_type), name)(*args)

    def _fallback(self, device_type, name, outputs, *args):
        """A ring operation the ring does not serve (dtype, op, layout): the delegate's, with an
        error that says so when the delegate refuses too (at the call or later, in its Work)."""
        delegate = self._delegate(device_type)
        tensors = [t for t in outputs if isinstance(t, torch.Tensor)]
        dtypes = "/".join(sorted({str(t.dtype).replace("torch.", "") for t in tensors}))
        served = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
        prefix = (f"ringreduce backend: {name} of {dtypes} {device_type} tensors is not done by the "
                  f"ring (it serves {served} with {', '.join(_C.OP_CODES)}) and the "
                  f"{type(delegate).__name__} delegate refused it: ")
        self._calls["delegate " + name] += 1
        try:
            work = getattr(delegate, name)(*args)
        except RuntimeError as e:
            raise RuntimeError(prefix + str(e)) from e
        return self._all_of(name, [work.get_future()], tensors, error_prefix=prefix)

    @staticmethod
    def _ring_can(tensors):
        """The ring serves dense strided tensors of its dtypes on one device type."""
        return (tensors and all(t.dtype in SUPPORTED_DTYPES and t.layout == torch.strided
                                and not t.is_sparse and t.device.type in ("cpu", "cuda")
                                for t in tensors)
                and len({t.device for t in tensors}) == 1)

    def _ring(self, op, opts, device, run, outputs, after=None):
        """A ring Work. run(comm, async_op) starts the collective. When the caller waits at once
        (torch's async_op=False: opts.asyncOp), it runs on this thread, as the direct API's sync
        call does, and its error is raised here; else it runs on the communicator's worker
        (DDP's buckets: overlap with backward) and completes the Work when done. after() copies
        results out, once the collective is done."""
        comm = self._comm(device)
        self._calls["ring " + op] += 1
        if not getattr(opts, "asyncOp", True):
            run(comm, False)
            if after is not None:
                after()
            return self._all_of(op, [], outputs)
        return self._all_of(op, [run(comm, True).get_future()], outputs, after)

    @staticmethod
    def _all_of(op, futures, outputs, after=None, error_prefix=""):
        """A Work that completes when every future has: with the first error, or after()."""
        work = _C.ring_work(op, outputs)
        left, errors, lock = [len(futures)], [], threading.Lock()

        def one_done(fut):
            try:
                fut.value()
            except Exception as e:  # noqa: BLE001 (the message travels to Work.wait)
                errors.append(str(e) or type(e).__name__)
            with lock:
                left[0] -= 1
                if left[0]:
                    return
            if not errors and after is not None:
                try:
                    after()
                except Exception as e:  # noqa: BLE001
                    errors.append(str(e))
            _C.ring_work_complete(work, error_prefix + errors[0] if errors else "")
        if not futures:
            _C.ring_work_complete(work, "")
        for fut in futures:
            fut.add_done_callback(one_done)
        return work

    # -- ring operations ---------------------------------------------------------------------------
    def allreduce(self, tensors, opts):
        code = _op_code(opts.reduceOp)
        if code is None or not self._ring_can(tensors):
            return self._fallback(tensors[0].device.type, "allreduce", tensors, tensors, opts)
        if len(tensors) == 1:
            t = tensors[0]
            return self._ring("allreduce", opts, t.device,
                              lambda c, a: c.all_reduce(t, code, a), tensors)
        return self._coalesced("allreduce", opts, tensors, code)

    def allreduce_coalesced(self, tensors, opts):
        code = _op_code(opts.reduceOp)
        if code is None or not self._ring_can(tensors) or len({t.dtype for t in tensors}) != 1:
            return self._fallback(tensors[0].device.type, "allreduce_coalesced", tensors, tensors,
                                  opts)
        return self._coalesced("allreduce_coalesced", opts, tensors, code)

    def _coalesced(self, op, opts, tensors, code):
        """Several tensors of one dtype and device in one ring pass, through one flat buffer."""
        flat = torch.cat([t.reshape(-1) for t in tensors])

        def copy_out():
            offset = 0
            for t in tensors:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
        return self._ring(op, opts, flat.device, lambda c, a: c.all_reduce(flat, code, a), tensors,
                          copy_out)

    def _reduce_scatter_base(self, output, input, opts):
        code = _op_code(opts.reduceOp)
        if code is None or not self._ring_can([output, input]) or output.dtype != input.dtype:
            return self._fallback(input.device.type, "_reduce_scatter_base", [output], output, input,
                                  opts)
        self._check_sizes("reduce_scatter_tensor", "input", input, "output", output)
        return self._ring("_reduce_scatter_base", opts, input.device,
                          lambda c, a: c.reduce_scatter(output, input, code, a), [output])

    def _allgather_base(self, output, input, opts):
        if not self._ring_can([output, input]) or output.dtype != input.dtype:
            return self._fallback(input.device.type, "_allgather_base", [output], output, input, opts)
        self._check_sizes("all_gather_into_tensor", "output_tensor", output, "input_tensor", input)
        return self._ring("_allgather_base", opts, input.device,
                          lambda c, a: c.all_gather(output, input, a), [output])

    def allgather(self, output_lists, input_list, opts):
        """The list form with one input: gathered into one buffer by the ring, then split."""
        if len(input_list) != 1 or len(output_lists) != 1:
            return self._fallback(input_list[0].device.type, "allgather", output_lists[0],
                                  output_lists, input_list, opts)
        inp, outs = input_list[0], output_lists[0]
        if not self._ring_can([inp, *outs]) or len(outs) != self.size or any(
                o.shape != inp.shape or o.dtype != inp.dtype for o in outs):
            return self._fallback(inp.device.type, "allgather", outs, output_lists, input_list, opts)
        flat = torch.empty((self.size, inp.numel()), dtype=inp.dtype, device=inp.device)

        def copy_out():
            for r, o in enumerate(outs):
                o.copy_(flat[r].view_as(o))
        return self._ring("allgather", opts, inp.device,
                          lambda c, a: c.all_gather(flat.view(-1), inp.contiguous().view(-1), a),
                          outs, copy_out)

    def reduce_scatter(self, output_list, input_lists, opts):
        """The list form with one output: the inputs concatenated, reduce-scattered by the ring."""
        code = _op_code(opts.reduceOp)
        if code is None or len(output_list) != 1 or len(input_lists) != 1:
            return self._fallback(output_list[0].device.type, "reduce_scatter", output_list,
                                  output_list, input_lists, opts)
        out, ins = output_list[0], input_lists[0]
        if not self._ring_can([out, *ins]) or len(ins) != self.size or any(
                i.shape != out.shape or i.dtype != out.dtype for i in ins):
            return self._fallback(out.device.type, "reduce_scatter", output_list, output_list,
                                  input_lists, opts)
        flat = torch.cat([i.reshape(-1) for i in ins])
        return self._ring("reduce_scatter", opts, out.device,
                          lambda c, a: c.reduce_scatter(out, flat, code, a), [out])

    def _check_sizes(self, fn, big_name, big, small_name, small):
        _C.check_sizes(fn, big_name, big, small_name, small, self.size)  # binding/torch_types.h

    # -- delegated ----------------------------------------------------------------------------------
    def broadcast(self, tensors, opts):
        return self._delegated(tensors[0].device.type, "broadcast", tensors, opts)

    def allreduce_sparse(self, tensors, opts):
        return self._delegated(tensors[0].device.type, "allreduce_sparse", tensors, opts)

    def reduce(self, tensors, opts):
        return self._delegated(tensors[0].device.type, "reduce", tensors, opts)

    def allgather_coalesced(self, output_lists, input_list, opts):
        return self._delegated(input_list[0].device.type, "allgather_coalesced", output_lists,
                               input_list, opts)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts):
        """Several all_gather_into_tensor calls as one Work (functional collectives, FSDP2)."""
        for o, i in zip(outputs, inputs):
            self._check_sizes("all_gather_into_tensor", "output_tensor", o, "input_tensor", i)
        if self._ring_can([*outputs, *inputs]):
            comm = self._comm(inputs[0].device)
            self._calls["ring allgather_into_tensor_coalesced"] += 1
            if not getattr(opts, "asyncOp", True):
                for o, i in zip(outputs, inputs):
                    comm.all_gather(o, i, False)
                return self._all_of("_allgather_base", [], list(outputs))
            futures = [comm.all_gather(o, i, True).get_future() for o, i in zip(outputs, inputs)]
        else:
            delegate = self._delegate(inputs[0].device.type)
            self._calls["delegate allgather_into_tensor_coalesced"] += 1
            futures = [delegate._allgather_base(o, i, opts).get_future()
                       for o, i in zip(outputs, inputs)]
        return self._all_of("_allgather_base", futures, list(outputs))

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts):
        """Several reduce_scatter_tensor calls as one Work (functional collectives, FSDP2)."""
        for o, i in zip(outputs, inputs):
            self._check_sizes("reduce_scatter_tensor", "input", i, "output", o)
        code = _op_code(opts.reduceOp)
        if code is not None and self._ring_can([*outputs, *inputs]):
            comm = self._comm(inputs[0].device)
            self._calls["ring reduce_scatter_tensor_coalesced"] += 1
            if not getattr(opts, "asyncOp", True):
                for o, i in zip(outputs, inputs):
                    comm.reduce_scatter(o, i, code, False)
                return self._all_of("_reduce_scatter_base", [], list(outputs))
            futures = [comm.reduce_scatter(o, i, code, True).get_future()
                       for o, i in zip(outputs, inputs)]
        else:
            delegate = self._delegate(inputs[0].device.type)
            self._calls["delegate reduce_scatter_tensor_coalesced"] += 1
            futures = [delegate._reduce_scatter_base(o, i, opts).get_future()
                       for o, i in zip(outputs, inputs)]
        return self._all_of("_reduce_scatter_base", futures, list(outputs))

    def gather(self, output_lists, input_list, opts):
        return self._delegated(input_list[0].device.type, "gather", output_lists, input_list, opts)

    def scatter(self, output_list, input_lists, opts):
        return self._delegated(output_list[0].device.type, "scatter", output_list, input_lists, opts)

    def alltoall_base(self, output, input, output_splits, input_splits, opts):
        return self._delegated(input.device.type, "alltoall_base", output, input, output_splits,
                               input_splits, opts)

    def alltoall(self, outputs, inputs, opts):
        return self._delegated(inputs[0].device.type, "alltoall", outputs, inputs, opts)

    def send(self, tensors, dst, tag):
        return self._delegated(tensors[0].device.type, "send", tensors, dst, tag)

    def recv(self, tensors, src, tag):
        return self._delegated(tensors[0].device.type, "recv", tensors, src, tag)

    def recv_anysource(self, tensors, tag):
        return self._delegated(tensors[0].device.type, "recv_anysource", tensors, tag)

    def barrier(self, opts):
        # On the CPU delegate: a barrier orders the processes, not the devices' streams (as Gloo).
        return self._delegated("cpu", "barrier", opts)

    # -- dist.shrink_group ---------------------------------------------------------------------------
    def shrink(self, excluded, flags):
        """The survivors' new backend (ringreduce/_shrink.py); called by torch on every survivor."""
        excluded = sorted(int(r) for r in excluded)
        timeout = self.timeout if self.timeout is not None else _lifecycle.default_timeout()
        # The keys of this attempt: the same on every survivor whatever list it was given (a
        # refused attempt leaves its keys; the survivors' next attempt meets under the next number).
        self._shrinks += 1
        prefix = f"ringreduce-shrink/{self.group_name}/{self._shrinks}"
        name = f"{self.group_name}~{self._shrinks}"
        with self._lock:
            comms = list(self._comms.values())
        # The direct API's communicators of the same group (rr.all_reduce(t, group=...)) end too.
        pg = _lifecycle.group_named(self.group_name)
        direct = [c for c in _lifecycle.REGISTRY.of_group(pg) if all(c is not d for d in comms)] \
            if pg is not None else []
        comms += direct
        if flags & _shrink.SHRINK_ABORT:
            _shrink.abort_parent(comms, excluded)
        survivors = _shrink.agree(self.store, prefix, self.rank, excluded, self.size, timeout)
        _lifecycle.note_shrunk(self.group_name, excluded)
        _shrink.close_parent(comms, timeout)
        self.close()
        if pg is not None:
            _lifecycle.REGISTRY.destroy(pg)  # their entries (closed above)
        for delegate in self._delegates.values():
            _shrink.abort_delegate(delegate)
        log.debug("rank %d: group %s shrunk to ranks %s of it", self.rank, self.group_name, survivors)
        return _make(dist.PrefixStore(prefix + "/group/", self.store), survivors.index(self.rank),
                     len(survivors), self._torch_timeout, name)

    def close(self):
        if self.slot is not None:
            self.slot.set_cpu(None)
        for comm in list(self._comms.values()):
            comm.close()
        self._comms.clear()


def _warn_if_gpus_unserved():
    """A build without CUDA registers the backend for CPU tensors only; where GPUs are visible, say
    so once, and how to rebuild (a login node without GPUs built it for GPU nodes)."""
    global _warned_no_cuda
    if _warned_no_cuda or getattr(_C, "cuda_compiled", False) or torch.version.cuda is None:
        return
    _warned_no_cuda = True
    if torch.cuda.device_count() > 0:  # NVML: starts no CUDA context, so forks stay safe
        from ._cuda.policy import no_cuda_message
        warnings.warn(no_cuda_message() + " (until then the ringreduce backend moves CPU tensors "
                      "only)", RuntimeWarning, stacklevel=3)


_warned_no_cuda = False


def _create(dist_opts, backend_opts):
    """torch's creator hook (extended API): one RingBackend per process group."""
    _warn_if_gpus_unserved()
    return _make(dist_opts.store, dist_opts.group_rank, dist_opts.group_size, dist_opts.timeout,
                 dist_opts.group_id)


def _make(store, rank, size, timeout, group_name):
    slot = _C.BackendSlot()
    impl = RingBackend(store, rank, size, timeout, group_name, slot)
    _backends.add(impl)
    return _C.make_backend(rank, size, impl, slot)




_backends = weakref.WeakSet()  # a group's backend goes with the group (destroy_process_group)


def _impls_of(group):
    """The RingBackends behind group's backends (one per device type, or one for all)."""
    impls = []
    try:
        devices = group._device_types
    except (AttributeError, RuntimeError, ValueError):
        return impls
    for device in devices:
        try:
            impl = _C.backend_impl(group._get_backend(device))
        except (RuntimeError, TypeError):
            continue
        if impl is not None and all(impl is not i for i in impls):
            impls.append(impl)
    return impls


def backend_of(group=None):
    """The RingBackend serving a process group (None: the default group), or None if the group
    uses another backend."""
    impls = _impls_of(group if group is not None else dist.group.WORLD)
    return impls[0] if impls else None


def _comms_of(group):
    """The open ring communicators of the backend serving group (for dump_trace)."""
    comms = []
    for impl in _impls_of(group):
        with impl._lock:
            comms.extend(c for c in impl._comms.values() if not c.closed)
    return comms


def _delegates_of(group):
    """The Gloo/NCCL delegates of the backend serving group (rr.lost_ranks gives up their calls)."""
    return [d for impl in _impls_of(group) for d in list(impl._delegates.values())]


def _close_all():
    """At exit (the registry's destroy_all): close every backend's rings."""
    for impl in list(_backends):
        try:
            impl.close()
        except Exception:  # noqa: BLE001
            pass


def register():
    """Registers the backend with torch.distributed (done when ringreduce is imported)."""
    devices = ["cpu", "cuda"] if getattr(_C, "cuda_compiled", False) else ["cpu"]
    if NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(NAME, _create, extended_api=True, devices=devices)
        # The registry (the bottom layer) reaches this backend's rings only through these.
        _lifecycle.REGISTRY.add_owner(_comms_of, _close_all)
        _shrink.set_delegates_of(_delegates_of)
