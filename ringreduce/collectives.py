"""The torch.distributed-shaped API: all_reduce, reduce_scatter_tensor, all_gather_into_tensor; and
which transport's communicator serves a group (the bottom of the API layer: ops, functional, ddp,
bucketing, nn and the backend build on it)."""
import logging

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as _c10d

from . import _C, _env, _hier, _lifecycle, _shm
from ._lifecycle import REGISTRY, default_timeout

log = logging.getLogger("ringreduce")

ReduceOp = dist.ReduceOp

# Codes understood by the native core (csrc/ring/types.h, RedOp), by ReduceOp.
_OP_CODES = tuple((getattr(ReduceOp, name), code) for name, code in _C.OP_CODES.items())
# The dtypes the core reduces, and those a wire takes (csrc/ring/types.h), as torch dtypes.
SUPPORTED_DTYPES = tuple(getattr(torch, name) for name in _C.DTYPES)
TRANSPORTS = ("auto", "shm", "p2p", "hier", "nccl")
# wire_dtype= codes (csrc/ring/types.h, Wire), by torch dtype.
_WIRE_CODES = tuple((getattr(torch, name), code) for name, code in _C.WIRE_CODES.items())
WIRE_DTYPES = tuple(d for d, _ in _WIRE_CODES)
WIRE_BLOCK = _C.WIRE_BLOCK  # elements per fp8 scale
WIRE_TENSOR_DTYPES = tuple(getattr(torch, name) for name in _C.WIRE_TENSOR_DTYPES)
_WIRE_OP_CODES = tuple(_C.OP_CODES[name] for name in _C.WIRE_OPS)  # what a wire reduces by


def _names(items, last="or"):
    """'a, b or c'."""
    items = [str(i) for i in items]
    return ", ".join(items[:-1]) + f" {last} " + items[-1] if len(items) > 1 else "".join(items)


def set_deterministic(on=True):
    """Every later all_reduce and reduce_scatter (any entry point, transport, size or plan) gives each
    element the bits of the rank-order fold ((x0 op x1) op x2) ... in the dtype's accumulation type
    (fp16/bf16: fp32), rounded once: results that do not move with bucket_cap_mb, slicing or
    algorithm. Process-wide, like torch.use_deterministic_algorithms; set it the same on every rank
    (a rank that differs gets a mismatch error). RINGREDUCE_DETERMINISTIC=1 sets it at import."""
    _C.set_deterministic(bool(on))


def is_deterministic():
    """Whether set_deterministic (or RINGREDUCE_DETERMINISTIC=1) is on."""
    return _C.deterministic()


def _deterministic_from_env():
    return _env.get("RINGREDUCE_DETERMINISTIC", False)


set_deterministic(_deterministic_from_env())


def _op_code(op, fn):
    for known, code in _OP_CODES:
        try:
            if op == known:
                return code
        except TypeError:
            break
    raise ValueError(f"ringreduce.{fn}: op must be ReduceOp.{_names(_C.OP_CODES)}, "
                     f"got {_op_name(op)}")


def _op_name(op):
    """ReduceOp.<NAME> for any ReduceOp (a premul-sum op's repr is an object address), else repr."""
    if not isinstance(op, (ReduceOp, ReduceOp.RedOpType)):
        return repr(op)
    for name, member in ReduceOp.RedOpType.__members__.items():
        try:
            if op == member:
                return f"ReduceOp.{name}"
        except TypeError:
            break
    return repr(op)


def _wire_code(wire_dtype, t, arg, op_code, fn):
    """The native code of wire_dtype (0: None) for tensor t reduced with op_code."""
    if wire_dtype is None:
        return 0
    for known, code in _WIRE_CODES:
        if wire_dtype == known:
            break
    else:
        raise ValueError(f"ringreduce.{fn}: wire_dtype must be None, "
                         f"{_names(str(d) for d in WIRE_DTYPES)}, got {wire_dtype!r}")
    # What a wire takes (the tensor's dtype, the op) is checked once, by the binding (to_wire),
    # and what the transport's wire runs by its capabilities (runtime::wire_refusal); a traced
    # call checks here, where the operator's fake kernel would not.
    if t.dtype not in WIRE_TENSOR_DTYPES:
        raise TypeError(f"ringreduce.{fn}: wire_dtype={wire_dtype} takes "
                        f"{_names(_C.WIRE_TENSOR_DTYPES)} tensors; {arg} is {t.dtype}")
    if op_code not in _WIRE_OP_CODES:
        name = next(str(o) for o, c in _OP_CODES if c == op_code)
        raise ValueError(f"ringreduce.{fn}: wire_dtype={wire_dtype} takes op {_names(_C.WIRE_OPS)}, "
                         f"got {name}")
    return code


def _check_tensor(t, arg, fn):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"ringreduce.{fn}: {arg} must be a torch.Tensor, got {type(t).__name__}")
    # The dtype: the binding's one check (binding/torch_types.h: to_dtype), asked here before any
    # communicator exists (creating one is collective: a rank refused later would leave its peers
    # waiting in setup). Compiling: the operator's kernel meets it in the binding at run time.
    if not torch.compiler.is_compiling():
        _C.check_dtype(t, arg, fn)
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"ringreduce.{fn}: {arg} is on device {t.device}; expected a CPU or CUDA "
                         f"tensor")
    if t.is_sparse or t.layout != torch.strided:
        raise ValueError(f"ringreduce.{fn}: {arg} must be a dense (strided) tensor")


def _transport(device):
    choice = _env.get("RINGREDUCE_TRANSPORT", "auto")
    if device.type == "cpu" and choice not in ("auto", "shm"):
        raise ValueError(f"RINGREDUCE_TRANSPORT={choice} cannot move CPU tensors; use shm or auto")
    return choice


def _comm_for(group, device, fn):
    """The communicator that moves tensors on device for group; None if this rank is not in it."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"ringreduce.{fn}: torch.distributed is not initialized; call "
                           f"torch.distributed.init_process_group(...) first")
    g = group if group is not None else dist.group.WORLD
    _lifecycle.check_not_shrunk(g, fn)
    if dist.get_rank(g) < 0:
        return None  # like torch.distributed: a rank outside the group does nothing
    choice = _transport(device)
    if device.type == "cuda":
        from . import _cuda  # the CUDA transports (p2p, nccl); raises if this build has no CUDA
        return _cuda.get_communicator(g, device, choice)
    return get_communicator(g)


def group_name(group):
    return (group if group is not None else dist.group.WORLD).group_name


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def traced(*tensors):
    """Whether a call is being traced (then it must go through the operators): compiling, or a
    tensor subclass (fake, functional, ...) that only the dispatcher knows how to handle.
    Costs ~0.5 us; going through the dispatcher in eager mode would cost ~12 us per call."""
    if torch.compiler.is_compiling():
        return True
    for t in tensors:
        if type(t) not in _PLAIN:
            return True
    return False


def cpu_communicator(member, timeout=None, hosts=None, **options):
    """A new communicator for member's CPU ranks: the shared-memory ring when they are on one host,
    else the hierarchical one (_hier/). Collective: every rank of member must reach it. hosts:
    every rank's host id, in rank order, instead of discovering them (the benchmark's simulated
    hosts)."""
    timeout = float(timeout) if timeout is not None else default_timeout()
    if hosts is None:
        hosts, machines = _hier.discover_hosts(member, timeout)
    elif len(hosts) != member.size:
        raise ValueError(f"ringreduce: hosts has {len(hosts)} entries; expected one per rank "
                         f"({member.size})")
    else:  # simulated hosts on this machine
        machines = [_lifecycle.machine_id()] * member.size
    plan, by_host, reason = _hier.plan_for(list(hosts))
    log.debug("rank %d/%d of %s: CPU plan %s (%s)", member.rank, member.size, member.name, plan,
              reason)
    if plan == "flat":
        return _shm.Communicator(member=member, timeout=timeout, **options)
    return _hier.HierCommunicator(member, timeout, plan, by_host, _shm.Communicator,
                                  machine_ranks=machines.count(machines[member.rank]))


def get_communicator(group=None, **options):
    """The cached CPU communicator of group (None: the default group), created on first use.

    Creation is collective: every rank of the group must reach it. options (timeout, slice_bytes,
    algo) apply only when this call creates it (slice_bytes and algo to a one-host group only).
    """
    def create(g):
        _lifecycle.require_initialized()
        return cpu_communicator(_lifecycle.Member.of_group(g), **options)
    return REGISTRY.get(group, ("shm",), create)


def destroy(group=None):
    """Closes the communicators of group (None: the default group), CPU and CUDA; idempotent."""
    REGISTRY.destroy(group)


def _span(t):
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def _overlap(a, b):
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1


# The fast path of a synchronous all_reduce (_lifecycle.FAST: group -> (process group, communicator,
# fast function)), filled by the first full call on the CPU or on CUDA's p2p transport (there
# synchronous calls without a wire only: P2pComm.fast_all_reduce), emptied of a communicator's entries
# when it closes. A hit costs a dictionary lookup, a few attribute reads and one C function
# (ShmComm.fast_all_reduce) that matches op by identity and checks the tensor itself: ~0.4 us at
# world 1 (python -m ringreduce.bench --overhead). An async call takes it too (the C function queues the call and returns
# its Work). Anything else (CUDA, views, subclasses, other op objects, tracing, a sync call with
# calls in flight, bad arguments) takes the full path, which checks everything and raises the
# API's errors. is_compiling() comes before the C call: torch.compile folds it and never sees the call.
_fast = _lifecycle.FAST
_Work = _lifecycle.Work
_FAST_OPS = [known for known, _ in sorted(_OP_CODES, key=lambda kc: kc[1])]  # index = op code
_FAST_WIRES = [None] + [known for known, _ in sorted(_WIRE_CODES, key=lambda kc: kc[1])]
_is_compiling = torch.compiler.is_compiling
_world = _c10d._world  # one object for the process's life; its default_pg changes


def shared_empty(*size, dtype=None, group=None, device=None):
    """An uninitialised tensor in memory that every rank of group maps (like torch.empty).

    all_reduce of this tensor (or of a contiguous part of it) on the same group reads the peers'
    copies in place (one pass, rank order), where an ordinary tensor is copied through shared
    slots. Collective: every rank of the group calls it, in the same order, with the same size and
    dtype. device: "cpu" (default) or a CUDA device.
    CPU: the memory is freed with the tensor; nothing is left in /dev/shm. One host only (the
    shared-memory transport).
    CUDA: the p2p transport with every rank mapping every other's GPU memory (CUDA IPC); the
    all_reduce (any op, the default algorithm choice) reads every rank's copy and writes the
    result into all of them, with two handshakes and no staging copy. The peers' mappings last
    until the communicator closes; this rank's copy lives on with the tensor."""
    fn = "shared_empty"
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in size):
        raise ValueError(f"ringreduce.{fn}: size must be non-negative ints, got {size}")
    dtype = dtype if dtype is not None else torch.get_default_dtype()
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"ringreduce.{fn}: dtype {dtype} is not supported; supported: "
                        f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}")
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"ringreduce.{fn}: device must be cpu or cuda, got {device}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"ringreduce.{fn}: device {device} asked for, but torch sees no CUDA "
                           f"device here")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    comm = _comm_for(group, device, fn)
    if comm is None:
        return None
    if device.type == "cuda":
        return comm.shared_empty(size, dtype)
    if not isinstance(comm, _shm.Communicator) or getattr(comm, "transport", None) != "shm":
        raise ValueError(f"ringreduce.{fn}: the group spans more than one host; shared buffers "
                         f"need every rank on one host (the shared-memory transport)")
    return comm.shared_empty(size, dtype)


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False, wire_dtype=None):
    """Reduces tensor across the group in place; every rank ends with the same result.

    wire_dtype (torch.bfloat16, float16, float8_e4m3fn or float8_e5m2; float32/float16/bfloat16
    tensors, SUM or AVG): each rank's tensor is rounded once to wire_dtype for the transfer (fp8:
    with one float32 scale per block of 128 elements), every element is summed in float32 in rank
    order, and the sum is rounded once more to wire_dtype: every rank gets the same bits, those of
    tests/reference.py's wire_reference."""
    entry = _fast.get(group)
    if wire_dtype is not None:
        # The fast path takes a synchronous wire call as it takes a plain one (~5 us less at 4 KiB)
        if entry is not None and not async_op and not _is_compiling() and \
                (group is not None or entry[0] is _world.default_pg) and \
                entry[2](tensor, op, False, wire_dtype):
            return None
        return _all_reduce_wire(tensor, op, group, async_op, wire_dtype)
    if entry is not None and not _is_compiling() and \
            (group is not None or entry[0] is _world.default_pg):
        if not async_op:
            if entry[2](tensor, op):
                return None
        else:
            native = entry[2](tensor, op, True)
            if native is not False:
                return _Work(None, entry[1]._interrupted, native)
    fn = "all_reduce"
    _check_tensor(tensor, "tensor", fn)
    code = _op_code(op, fn)
    if not async_op and traced(tensor):  # torch.compile / export: the registered operator
        torch.ops.ringreduce.all_reduce_(tensor, code, group_name(group))
        return None
    comm = _comm_for(group, tensor.device, fn)
    if comm is None:
        return None
    work = comm.all_reduce(tensor, code, async_op)  # checks the tensor (the binding)
    _remember_fast(group, comm)  # after: a refused call leaves no fast path behind
    return work


def _remember_fast(group, comm):
    """The fast path's entry for group: comm's fast function, made once per communicator (a call
    the function declined, an async one on CUDA or a view, comes here again)."""
    entry = _fast.get(group)
    if comm.closed or (entry is not None and entry[1] is comm):
        return
    if comm.transport == "shm":
        fast = comm._native.fast_all_reduce(_FAST_OPS, _FAST_WIRES)
    elif comm.transport == "p2p" and not comm._blocking:
        # CUDA: synchronous plain calls only (the function declines the rest), none in blocking
        # mode (RINGREDUCE_BLOCKING_WAIT: the full path waits for the device).
        fast = comm._native.fast_all_reduce(_FAST_OPS)
    else:
        return
    entry = (group if group is not None else dist.group.WORLD, comm, fast)
    _fast[group] = entry
    if comm.closed and _fast.get(group) is entry:  # closed meanwhile (another thread): not kept
        _fast.pop(group, None)


def _all_reduce_wire(tensor, op, group, async_op, wire_dtype):
    fn = "all_reduce"
    _check_tensor(tensor, "tensor", fn)
    code = _op_code(op, fn)
    wire = _wire_code(wire_dtype, tensor, "tensor", code, fn)
    if traced(tensor):  # torch.compile / export: the registered operator
        if async_op:
            raise NotImplementedError(f"ringreduce.{fn}: wire_dtype with async_op=True is not "
                                      f"supported under torch.compile or on tensor subclasses")
        torch.ops.ringreduce.all_reduce_(tensor, code, group_name(group), wire)
        return None
    # The plain path's cache of the group's shm communicator: _comm_for costs more than a small
    # call (~6 us of 8 at 4 KiB, world 1).
    entry = _fast.get(group)
    if entry is not None and tensor.device.type == "cpu" and entry[1].transport == "shm" and \
            (group is not None or entry[0] is _world.default_pg):
        return entry[1].all_reduce(tensor, code, async_op, wire)
    comm = _comm_for(group, tensor.device, fn)
    if comm is None:
        return None
    work = comm.all_reduce(tensor, code, async_op, wire)
    if comm.transport == "shm":
        _remember_fast(group, comm)
    return work


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False,
                          wire_dtype=None):
    """Reduces input across the group; rank r gets chunk r of the result in output.

    wire_dtype: as all_reduce's; the float32 sum is the result (one rounding, the inputs')."""
    fn = "reduce_scatter_tensor"
    _check_tensor(output, "output", fn)
    _check_tensor(input, "input", fn)
    code = _op_code(op, fn)
    wire = _wire_code(wire_dtype, input, "input", code, fn)
    if output.dtype != input.dtype:
        raise TypeError(f"ringreduce.{fn}: output dtype {output.dtype} differs from input dtype "
                        f"{input.dtype}")
    if wire and async_op and traced(output, input):
        raise NotImplementedError(f"ringreduce.{fn}: wire_dtype with async_op=True is not "
                                  f"supported under torch.compile or on tensor subclasses")
    if not async_op and traced(output, input):
        torch.ops.ringreduce.reduce_scatter_tensor_(output, input, code, group_name(group), wire)
        return None
    comm = _comm_for(group, input.device, fn)
    if comm is None:
        return None
    # (the sizes, a multiple of the world: checked by the communicator, binding/torch_types.h)
    if output.device != input.device:
        raise ValueError(f"ringreduce.{fn}: output is on {output.device}, input on {input.device}")
    if output.numel() and _overlap(output, input) and not (
            output.is_contiguous() and input.is_contiguous() and output.data_ptr() ==
            input.data_ptr() + comm.rank * output.numel() * output.element_size()):
        raise ValueError(f"ringreduce.{fn}: output overlaps input other than as input's chunk "
                         f"{comm.rank} (this rank's)")
    if wire:
        return comm.reduce_scatter(output, input, code, async_op, wire)
    return comm.reduce_scatter(output, input, code, async_op)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    """Concatenates every rank's input_tensor (in rank order) into output_tensor."""
    fn = "all_gather_into_tensor"
    _check_tensor(output_tensor, "output_tensor", fn)
    _check_tensor(input_tensor, "input_tensor", fn)
    if output_tensor.dtype != input_tensor.dtype:
        raise TypeError(f"ringreduce.{fn}: output_tensor dtype {output_tensor.dtype} differs from "
                        f"input_tensor dtype {input_tensor.dtype}")
    if not async_op and traced(output_tensor, input_tensor):
        torch.ops.ringreduce.all_gather_into_tensor_(output_tensor, input_tensor,
                                                     group_name(group))
        return None
    comm = _comm_for(group, input_tensor.device, fn)
    if comm is None:
        return None
    # (the sizes, a multiple of the world: checked by the communicator, binding/torch_types.h)
    if output_tensor.device != input_tensor.device:
        raise ValueError(f"ringreduce.{fn}: output_tensor is on {output_tensor.device}, "
                         f"input_tensor on {input_tensor.device}")
    if input_tensor.numel() and _overlap(output_tensor, input_tensor) and not (
            output_tensor.is_contiguous() and input_tensor.is_contiguous() and
            input_tensor.data_ptr() == output_tensor.data_ptr() +
            comm.rank * input_tensor.numel() * input_tensor.element_size()):
        raise ValueError(f"ringreduce.{fn}: input_tensor overlaps output_tensor other than as its "
                         f"chunk {comm.rank} (this rank's)")
    return comm.all_gather(output_tensor, input_tensor, async_op)
