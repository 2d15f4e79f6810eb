"""The backends under test, each with the same three calls on this rank's tensors.

  all_reduce(t)               in place
  reduce_scatter(out, inp)    out may be inp's chunk of this rank (in-place form)
  all_gather(out, inp)        inp may be out's chunk of this rank (in-place form)
"""
import contextlib
import os
import sys

import torch
import torch.distributed as dist

import ringreduce as rr

REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
              "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.AVG}

# torch 2.14 renamed the tensor forms (the old names warn); older torch has only the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _is_chunk_of(small, big, rank):
    """True when small is big's chunk number rank (the in-place form)."""
    return small.data_ptr() == big.data_ptr() + rank * small.numel() * small.element_size()


# ringreduce/<algo>: the shm transport with RINGREDUCE_ALGO=<algo> (csrc/shm/protocol.h's names)
ALGOS = tuple(a for a in rr._C.SHM_ALGOS if a != "auto")
HOSTS = 1  # --hosts: ringreduce/hier's group is split into this many simulated hosts
REAL_HOSTS = False  # --link: the ranks are on emulated hosts; the group's own host ids count
DEVICE = "cpu"  # the run's device; on "cuda" every rank is on its emulated host when HOSTS > 1


def simulated_hosts(world, hosts):
    """Host id of every rank: blocks of consecutive ranks, sizes differing by at most one."""
    return [f"sim{r * hosts // world}" for r in range(world)]


class RingReduce:
    """ringreduce with one transport (RINGREDUCE_TRANSPORT, set before a call when it changes), or
    on the CPU with one algorithm forced (ringreduce/ring, /oneshot, /twoshot: a group of its own
    whose communicator is made with that algorithm)."""

    _transport = None  # the RINGREDUCE_TRANSPORT this process last set

    def __init__(self, label, op, rank, world):
        self.label = label
        variant = label.split("/", 1)[1]
        self.algo = variant if variant in ALGOS else None
        # all_reduce of a ringreduce.shared_empty tensor: CPU (pool) or CUDA (p2p-shared: the
        # registered algorithm of the p2p transport)
        self.pool = variant in ("pool", "p2p-shared")
        self.transport = ("p2p" if variant == "p2p-shared" else
                          "shm" if self.algo or self.pool or variant == "hier" else variant)
        self.op = REDUCE_OPS[op]
        self.group = None
        self._pooled = None
        if variant == "hier" and DEVICE == "cuda":
            # The CUDA transport of that name on the default group: the ranks' host ids (set by
            # the launcher) are the hosts; made at the first call.
            self.transport = "hier"
        elif variant == "pool":
            self.group = dist.new_group(backend="gloo")
        elif self.algo or variant == "hier":
            self.group = dist.new_group(backend="gloo")
            options = {"algo": self.algo} if self.algo else \
                {} if REAL_HOSTS else {"hosts": simulated_hosts(world, HOSTS)}
            rr.get_communicator(self.group, **options)  # collective: every rank is here

    def supports(self, collective, dtype):
        if self.pool and collective != "all_reduce":
            return "shared buffers serve all_reduce only"
        if self.algo in ("twoshot", "cma") and collective == "all_gather":
            return "all_gather always runs the ring"
        if self.algo and self.algo not in ("twoshot", "cma") and collective != "all_reduce":
            return "reduce_scatter and all_gather always run the ring"
        return None  # every collective, dtype and op

    def own_tensor(self, like):
        """ringreduce/pool, ringreduce/p2p-shared: a shared_empty tensor shaped like `like`
        (collective; one kept; on CUDA the peers' mappings of the earlier ones last until the
        communicator closes)."""
        if not self.pool:
            return like
        t = self._pooled
        if t is None or t.shape != like.shape or t.dtype != like.dtype:
            self._pooled = None  # the previous size's buffer goes first
            self._select()
            t = self._pooled = rr.shared_empty(like.shape, dtype=like.dtype, group=self.group,
                                               device=like.device)
        return t

    def _select(self):
        if RingReduce._transport != self.transport:
            os.environ["RINGREDUCE_TRANSPORT"] = RingReduce._transport = self.transport

    def all_reduce(self, t):
        self._select()
        rr.all_reduce(t, op=self.op, group=self.group)

    def reduce_scatter(self, out, inp):
        self._select()
        rr.reduce_scatter_tensor(out, inp, op=self.op, group=self.group)

    def all_gather(self, out, inp):
        self._select()
        rr.all_gather_into_tensor(out, inp, group=self.group)


# --wire names -> (wire dtype, relative half-ulp of the largest value a block holds: the error
# bound's unit for the result check). fp8 e4m3: 3 mantissa bits, values up to 448 = 1.75 x 2^8,
# so its coarsest step is 32 of 448; e5m2: 8192 of 57344.
WIRES = {"bf16": (torch.bfloat16, 2.0 ** -9), "fp16": (torch.float16, 2.0 ** -12),
         "fp8": (torch.float8_e4m3fn, 16 / 448), "fp8e5m2": (torch.float8_e5m2, 4096 / 57344)}


class Wire(RingReduce):
    """ringreduce/wire-<bf16|fp16|fp8|fp8e5m2>: all_reduce / reduce_scatter_tensor with
    wire_dtype=, on the shm transport (CUDA tensors: p2p): each rank rounded once, an exact float32
    sum, rounded again for the gather."""

    def __init__(self, label, op, rank, world):
        # With simulated hosts (--hosts) on the hierarchical communicator, as ringreduce/hier.
        super().__init__("ringreduce/hier" if HOSTS > 1 else "ringreduce/shm", op, rank, world)
        self.label = label
        self.wire, self.step = WIRES[label.split("wire-", 1)[1]]
        self.world = world

    def supports(self, collective, dtype):
        if collective == "all_gather":
            return "a wire carries reductions only"
        if self.transport == "hier" and DEVICE == "cuda":
            if collective != "all_reduce":
                return "across hosts the CUDA wire carries all_reduce only"
            if self.wire == torch.float16:
                return "float16's wire does not cross hosts on CUDA (its overflow check)"
        if dtype not in rr.collectives.WIRE_TENSOR_DTYPES:
            return f"a wire takes {', '.join(rr._C.WIRE_TENSOR_DTYPES)} tensors"
        if self.op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            return "a wire takes sum and avg"
        if self.wire == torch.float16 and self.op == dist.ReduceOp.SUM:
            # A timing batch repeats the call in place: the values grow N-fold per call and leave
            # float16's range (an OverflowError, by design) within 16 calls at N = 2.
            return "float16's range: repeated in-place sums overflow it (run -o avg)"
        return None

    def tolerance(self, magnitude):
        """Largest |result - exact| the two roundings allow: each of N inputs off by half a step
        of its block's largest value (<= magnitude), the sum (<= N x that) by half a step more."""
        return self.step * magnitude * 2 * self.world

    def _on(self, t):
        if t.is_cuda and self.transport != "hier":  # one host: p2p's wire (cuda/p2p/sym_wire.cu)
            self.transport = "p2p"
        self._select()

    def all_reduce(self, t):
        self._on(t)
        rr.all_reduce(t, op=self.op, group=self.group, wire_dtype=self.wire)

    def reduce_scatter(self, out, inp):
        self._on(inp)
        rr.reduce_scatter_tensor(out, inp, op=self.op, group=self.group, wire_dtype=self.wire)


class Torch:
    """torch.distributed's own collectives (Gloo for CPU tensors, NCCL for CUDA tensors)."""

    def __init__(self, label, op, rank, world):
        self.label = label
        self.op_name = op
        self.op = REDUCE_OPS[op]
        self.rank = rank
        self.world = world

    def supports(self, collective, dtype):
        """None if this backend can run collective on dtype, else the reason it cannot."""
        if collective != "all_gather" and self.op_name == "avg" and not dtype.is_floating_point:
            return "torch.distributed has no integer avg"
        return None

    def all_reduce(self, t):
        dist.all_reduce(t, op=self.op)

    def reduce_scatter(self, out, inp):
        _reduce_scatter(out, inp, op=self.op)

    def all_gather(self, out, inp):
        _all_gather(out, inp)


class TorchOnRingreduce(Torch):
    """torch.distributed's calls on a group of ringreduce's torch.distributed backend: what a user
    of init_process_group("ringreduce") pays (torch's dispatch, the backend's, then the ring)."""

    def __init__(self, label, op, rank, world):
        super().__init__(label, op, rank, world)
        self.group = dist.new_group(backend="ringreduce")  # every rank builds every backend

    def supports(self, collective, dtype):
        return None  # the ring does integer avg too

    def all_reduce(self, t):
        dist.all_reduce(t, op=self.op, group=self.group)

    def reduce_scatter(self, out, inp):
        _reduce_scatter(out, inp, op=self.op, group=self.group)

    def all_gather(self, out, inp):
        _all_gather(out, inp, group=self.group)


def _symm_mem():
    import torch.distributed._symmetric_memory as symm_mem  # a test replaces this function
    return symm_mem


class TorchSymm:
    """torch's SymmetricMemory all-reduces (torch.ops.symm_mem), the peer that, unlike NCCL 2.28,
    runs two ranks on one GPU (TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1, set by the launcher).

      torch/symm-oneshot, -twoshot          an ordinary tensor, as vLLM calls it: copied into a
                                            symmetric buffer (one per size, kept until release),
                                            then one_shot_all_reduce_out into the tensor, or
                                            two_shot_all_reduce_ and a copy back
      torch/symm-oneshot-sym, -twoshot-sym  the symmetric buffer itself (own_tensor), beside
                                            ringreduce/p2p-shared: two_shot_all_reduce_ in place;
                                            one-shot writes another tensor (result_tensor), as its
                                            kernel reads every rank's input while it writes

    Schemas and API checked on torch 2.11.0+cu130 and 2.14.1+cu130 (same in both):
    symm_mem.empty(n, dtype=, device=), symm_mem.rendezvous(tensor, group_name),
    one_shot_all_reduce_out(Tensor input, str reduce_op, str group_name, Tensor(a!) out),
    two_shot_all_reduce_(Tensor(a!) input, str reduce_op, str group_name). Their kernels take
    reduce_op "sum", are built for float and bfloat16 only, and need sizes in multiples of 4 B."""

    DTYPES = (torch.float32, torch.bfloat16)

    def __init__(self, label, op, rank, world):
        self.label, self.op_name, self.symm_mem = label, op, _symm_mem()
        variant = label.split("/", 1)[1]
        self.oneshot = variant.startswith("symm-oneshot")
        self.symmetric = variant.endswith("-sym")
        self.group_name = dist.group.WORLD.group_name
        self.ops = torch.ops.symm_mem
        self._buffers = {}  # (numel, dtype) -> rendezvoused symmetric tensor
        self._out = None    # one-shot -sym: where the result goes

    def supports(self, collective, dtype):
        if collective != "all_reduce":
            return "torch.ops.symm_mem's one-/two-shot ops are all-reduces"
        if self.op_name != "sum":
            return "torch.ops.symm_mem's all-reduces sum only"
        if dtype not in self.DTYPES:
            return f"torch.ops.symm_mem's kernels are built for float and bfloat16, not " \
                   f"{str(dtype).replace('torch.', '')}"
        return None

    def _buffer(self, numel, dtype, device):
        """A symmetric tensor of numel elements (collective the first time: every rank asks for the
        same sizes in the same order, as the sweep does)."""
        key = (numel, dtype)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self.symm_mem.empty(numel, dtype=dtype, device=device)
            self.symm_mem.rendezvous(buf, self.group_name)
            self._buffers[key] = buf
        return buf

    def own_tensor(self, like):
        """The tensor the sweep reduces: the symmetric one (-sym) or like, whose staging buffer is
        made here, outside the timed calls."""
        buf = self._buffer(like.numel(), like.dtype, like.device)
        return buf.view(like.shape) if self.symmetric else like

    def result_tensor(self, t):
        """Where all_reduce(t) leaves the result."""
        if not (self.symmetric and self.oneshot):
            return t
        if self._out is None or self._out.shape != t.shape or self._out.dtype != t.dtype:
            self._out = torch.empty_like(t)
        return self._out

    def all_reduce(self, t):
        if self.symmetric:
            if self.oneshot:
                self.ops.one_shot_all_reduce_out(t, "sum", self.group_name, self.result_tensor(t))
            else:
                self.ops.two_shot_all_reduce_(t, "sum", self.group_name)
            return
        flat = t.view(-1)
        buf = self._buffer(flat.numel(), t.dtype, t.device)
        buf.copy_(flat)
        if self.oneshot:
            self.ops.one_shot_all_reduce_out(buf, "sum", self.group_name, flat)
        else:
            self.ops.two_shot_all_reduce_(buf, "sum", self.group_name)
            flat.copy_(buf)

    def release(self):
        """After a size (every rank's kernels are done: each op ends with a barrier across ranks
        and the sweep synchronized the device): its buffers go."""
        self._buffers.clear()
        self._out = None

    close = release


class TorchCompress(Torch):
    """torch/<bf16|fp16>-compress: what torch's bf16_compress_hook / fp16_compress_hook do with a
    float32 bucket (cast, all_reduce in the narrow type on Gloo or NCCL, cast back), timed
    including both casts."""

    def __init__(self, label, op, rank, world):
        super().__init__(label, op, rank, world)
        self.narrow = torch.bfloat16 if label.startswith("torch/bf16") else torch.float16
        self.step = WIRES["bf16" if self.narrow == torch.bfloat16 else "fp16"][1]

    def supports(self, collective, dtype):
        if collective != "all_reduce":
            return "the compress hooks all-reduce"
        if self.narrow == torch.float16 and self.op == dist.ReduceOp.SUM:
            return "float16's range: repeated in-place sums overflow it (run -o avg)"
        if dtype != torch.float32 or self.op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            return "the compress hooks take float32 buckets, sum and avg"
        return None

    def tolerance(self, magnitude):
        """Each of the ring's N-1 steps rounds a partial sum (<= N x magnitude), plus the inputs."""
        return self.step * magnitude * 2 * self.world * self.world

    def all_reduce(self, t):
        narrow = t.to(self.narrow)
        dist.all_reduce(narrow, op=self.op)
        t.copy_(narrow)


class ParameterServer(Torch):
    """Rank 0 as a parameter server, from torch.distributed point-to-root ops."""

    def __init__(self, label, op, rank, world):
        super().__init__(label, op, rank, world)
        self._scratch = None

    def all_reduce(self, t):
        dist.reduce(t, dst=0, op=self.op)
        dist.broadcast(t, src=0)

    def reduce_scatter(self, out, inp):
        if _is_chunk_of(out, inp, self.rank):
            full = inp  # in place: reducing into inp is allowed
        else:  # reduce works in place, so keeping inp intact costs a copy (timed, as a user pays)
            if self._scratch is None or self._scratch.shape != inp.shape or \
                    self._scratch.dtype != inp.dtype or self._scratch.device != inp.device:
                self._scratch = torch.empty_like(inp)
            full = self._scratch
            full.copy_(inp)
        dist.reduce(full, dst=0, op=self.op)
        dist.scatter(out, list(full.chunk(self.world)) if self.rank == 0 else None, src=0)

    def all_gather(self, out, inp):
        dist.gather(inp, list(out.chunk(self.world)) if self.rank == 0 else None, dst=0)
        dist.broadcast(out, src=0)

    def release(self):
        self._scratch = None


class Mpi:
    """MPI's collectives through mpi4py (whatever MPI it was built against: Open MPI, MPICH), on
    the same tensors (zero-copy NumPy views). The suite starts the ranks with mpirun for it."""

    _DTYPES = {torch.float32: "FLOAT", torch.float64: "DOUBLE", torch.int32: "INT32_T",
               torch.int64: "INT64_T", torch.int8: "INT8_T", torch.uint8: "UINT8_T"}

    def __init__(self, label, op, rank, world):
        from mpi4py import MPI
        self.label, self.op_name, self.rank, self.MPI = label, op, rank, MPI
        self.comm = MPI.COMM_WORLD
        if self.comm.Get_size() != world or self.comm.Get_rank() != rank:
            raise RuntimeError(f"{label}: MPI sees rank {self.comm.Get_rank()} of "
                               f"{self.comm.Get_size()}, torch.distributed rank {rank} of {world}: "
                               f"the ranks were not started by mpirun")
        self.library = " ".join(MPI.Get_library_version().splitlines()[0].split(",")[0].split())
        want = {"openmpi": "Open MPI", "mpich": "MPICH"}.get(label.split("/", 1)[1])
        if want and want not in self.library:  # launched by one MPI, mpi4py loaded another
            raise RuntimeError(f"{label}: mpi4py loaded {self.library!r}, not {want} "
                               f"(MPI4PY_LIBMPI={os.environ.get('MPI4PY_LIBMPI')})")
        self.op = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}.get(op)

    def supports(self, collective, dtype):
        if dtype not in self._DTYPES:
            return f"MPI has no {str(dtype).replace('torch.', '')} type"
        if collective != "all_gather" and self.op is None:
            return f"MPI has no {self.op_name} reduction"
        return None

    def _buf(self, t):
        return [t.numpy(), getattr(self.MPI, self._DTYPES[t.dtype])]

    def all_reduce(self, t):
        self.comm.Allreduce(self.MPI.IN_PLACE, self._buf(t), op=self.op)

    def reduce_scatter(self, out, inp):
        if _is_chunk_of(out, inp, self.rank):  # MPI's in-place form leaves chunk 0 in inp
            self.comm.Reduce_scatter_block(self.MPI.IN_PLACE, self._buf(inp), op=self.op)
            if self.rank:
                out.copy_(inp[:out.numel()])
        else:
            self.comm.Reduce_scatter_block(self._buf(inp), self._buf(out), op=self.op)

    def all_gather(self, out, inp):
        if _is_chunk_of(inp, out, self.rank):  # MPI's in-place form is exactly this one
            self.comm.Allgather(self.MPI.IN_PLACE, self._buf(out))
        else:
            self.comm.Allgather(self._buf(inp), self._buf(out))


class DeepSpeed:
    """DeepSpeed's CPU shared-memory all-reduce (deepspeed.comm.inference_all_reduce) on this
    process group. DeepSpeed enables it only when LOCAL_SIZE equals the world size and names its
    /dev/shm segments after MASTER_ADDR and MASTER_PORT (the suite sets a port of its own per run);
    it never removes them: close() removes this rank's, the suite every rank's after the run. Sum only; float32 needs AVX2, bfloat16/float16 AVX-512BW (without
    them DeepSpeed silently calls Gloo instead: such rows are refused here, never mislabelled)."""

    def __init__(self, label, op, rank, world):
        self.label, self.op_name, self.rank = label, op, rank
        if "MASTER_PORT" not in os.environ:  # spawned ranks: a token common to the run names the files
            token = torch.tensor([os.getpid()], dtype=torch.int64)
            dist.broadcast(token, src=0)
            os.environ["MASTER_PORT"] = str(token.item())
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.update(DS_ACCELERATOR="cpu", LOCAL_SIZE=str(world), LOCAL_RANK=str(rank),
                          RANK=str(rank), WORLD_SIZE=str(world))
        with contextlib.redirect_stdout(sys.stderr):  # its messages and logger: not in the table
            import deepspeed
            import deepspeed.comm.comm as ds_comm
            deepspeed.init_distributed(dist_backend="gloo")  # joins the existing process group
        self.cdb = ds_comm.cdb
        self.level = getattr(self.cdb, "shm_vector_kernel_level", 0) if self.cdb.shm_comm_op else 0
        if self.level < 1:
            raise RuntimeError(f"{label}: DeepSpeed's shm all-reduce is not available here (its op "
                               f"did not build or load, or the CPU lacks AVX2)")
        self.prefix = shm_prefix()

    def supports(self, collective, dtype):
        if collective != "all_reduce":
            return "DeepSpeed's shm op is an all-reduce only"
        if self.op_name != "sum":
            return "DeepSpeed's shm all-reduce sums only"
        if dtype == torch.float32 or (dtype in (torch.bfloat16, torch.float16) and self.level >= 2):
            return None
        return f"DeepSpeed's shm all-reduce has no {str(dtype).replace('torch.', '')} kernel on this CPU"

    def all_reduce(self, t):
        torch.ops.deepspeed.inference_all_reduce_(t)

    def close(self):
        remove_shm(self.prefix, rank=self.rank)


def shm_prefix():
    """The start of DeepSpeed's /dev/shm segment names for this run (its shm.cpp's naming)."""
    return (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_")


def remove_shm(prefix, rank=None):
    """Removes DeepSpeed's segments named prefix + rank (every rank's when rank is None)."""
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return
    for name in names:
        if name.startswith(prefix) and (rank is None or name[len(prefix):] == str(rank)):
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except OSError:
                pass


def make(label, op, rank, world):
    if label.startswith("ringreduce/wire-"):
        return Wire(label, op, rank, world)
    if label in ("torch/bf16-compress", "torch/fp16-compress"):
        return TorchCompress(label, op, rank, world)
    if label == "torch/ringreduce":
        return TorchOnRingreduce(label, op, rank, world)
    if label.startswith("torch/symm-"):
        return TorchSymm(label, op, rank, world)
    kind = label.split("/", 1)[0]
    cls = {"ringreduce": RingReduce, "torch": Torch, "ps": ParameterServer, "mpi": Mpi,
           "deepspeed": DeepSpeed}[kind]
    return cls(label, op, rank, world)
