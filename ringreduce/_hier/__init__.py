"""Groups whose CPU ranks sit on several hosts: shared memory inside a host, Gloo between hosts.

Host discovery: at setup every rank publishes its host identity (RINGREDUCE_HOST_ID, else host name
and boot id) through the group's store; one host -> the flat shared-memory ring (_shm.py), more ->
a HierCommunicator with one of two plans, logged at debug level with the reason (the choice:
collectives.cpu_communicator, which also hands it the host's ring; transports do not import
each other):

- "two-level" (every host has the same number L of the group's ranks): reduce-scatter inside the
  host over shared memory (local rank j then holds the host's partial sum of chunk j), all-reduce of
  chunk j among the H ranks of local rank j over a Gloo group of their own, all-gather inside the
  host. Per rank 2(H-1)/H of 1/L of the tensor crosses the network: the optimum.
- "leaders" (any other layout): all-reduce inside each host, all-reduce among the hosts' first
  ranks over Gloo, broadcast from the first rank inside each host (Gloo on the host). Correct for any
  layout; the whole tensor crosses the network once per host, not 1/L of it.

Deterministic mode (ringreduce.set_deterministic): neither plan reduces in rank order (each sums
its host's partial first), so every all_reduce and reduce_scatter instead sends chunk k of every
rank to rank k over a Gloo group of all the ranks (made at the first such call), rank k folds the N
pieces in rank order with the native kernel, and an all_reduce all-gathers the results: 2(N-1)/N of
the tensor per rank over Gloo, where the two-level plan sends 2(H-1)/H of 1/L of it.

reduce_scatter_tensor and all_gather_into_tensor keep torch.distributed's rank order of chunks:
their inputs are permuted into a (local rank, host) order first and the result back. AVG reduces as
SUM and divides once, by the group's size, on the rank that owns the reduced element, so every rank
ends with the same bits. The Gloo groups are built on the group's store with the communicator's
timeout; a Gloo error is raised as a RingReduceError naming the call, the phase and the group.
"""
import datetime
import logging
import time

import torch
import torch.distributed as dist

from .. import _C, _env, _lifecycle
from .._lifecycle import Bootstrap, RingReduceError, host_id, machine_id
from . import two_level

log = logging.getLogger("ringreduce")

SUM, AVG, MIN, MAX, PROD = sorted(_C.OP_CODES.values())  # in RedOp's order (csrc/ring/types.h)
WIRE_BLOCK = _C.WIRE_BLOCK  # elements per fp8 scale
# How often a rank waiting for a Gloo call looks for another rank's failure (a store round trip).
BROKEN_POLL = datetime.timedelta(milliseconds=50)
WIRE_F16 = _C.WIRE_CODES["float16"]  # the only wire that can overflow
_GLOO_OPS = {SUM: dist.ReduceOp.SUM, MIN: dist.ReduceOp.MIN, MAX: dist.ReduceOp.MAX,
             PROD: dist.ReduceOp.PRODUCT}


def discover_hosts(member, timeout):
    """(host id, machine id) of every rank, in group rank order (collective over member's ranks)."""
    if member.size == 1:
        return [host_id()], [machine_id()]
    setup = Bootstrap(member, "hosts", timeout)
    setup.set(f"host/{member.rank}", f"{host_id()}\n{machine_id()}")
    pairs = [v.decode().split("\n") for v in setup.all("host", member.size, "host id")]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def plan_for(hosts):
    """(plan, ranks of each host in group order, reason) for a list of host ids by group rank."""
    order = list(dict.fromkeys(hosts))
    by_host = [[r for r, h in enumerate(hosts) if h == name] for name in order]
    sizes = [len(rs) for rs in by_host]
    if len(order) == 1:
        return "flat", by_host, f"all {len(hosts)} ranks on one host"
    forced = _env.get("RINGREDUCE_HIER_PLAN", "auto")
    if forced == "leaders":  # measurements: the leaders plan on a layout two-level would take
        return "leaders", by_host, f"{len(order)} hosts of {sizes} ranks (RINGREDUCE_HIER_PLAN)"
    if len(set(sizes)) == 1:
        return "two-level", by_host, f"{len(order)} hosts x {sizes[0]} ranks"
    return "leaders", by_host, f"{len(order)} hosts with unequal rank counts {sizes}"


def _overflow_as_error(fn):
    """A float16 wire's overflow from an async call: RingReduceError at Work.wait(), as the
    shared-memory transport raises it (a synchronous call raises OverflowError)."""
    def run():
        try:
            fn()
        except OverflowError as e:
            raise RingReduceError(str(e)) from e
    return run


def intra_grace(timeout):
    """Seconds a host's ring waits beyond the timeout of the steps between hosts (the ranks of a
    pipelined call start their waits up to a piece apart)."""
    return max(5.0, 0.05 * timeout)


def _gloo(store, prefix, rank, size, timeout):
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size,
                                 datetime.timedelta(seconds=timeout))


class HierCommunicator(_lifecycle.Communicator):
    """One group's ranks on several hosts; see the module docstring for the two plans."""

    transport = "hier"

    def __init__(self, member, timeout, plan, by_host, host_ring, machine_ranks=None):
        """host_ring(member=, timeout=, machine_ranks=): the communicator of this host's ranks
        (the shared-memory ring; passed in by the layer above, as transports do not import each
        other)."""
        super().__init__(member, timeout)
        self.plan, self.by_host = plan, by_host
        self.host = next(h for h, rs in enumerate(by_host) if member.rank in rs)
        self.local_ranks = by_host[self.host]
        self.local_rank = self.local_ranks.index(member.rank)
        self.nhosts = len(by_host)
        self._call = None
        self._scratch = {}  # slot -> uint8 tensor: fresh buffers would page-fault on every call
        setup = Bootstrap(member, "hier", self.timeout)
        local = _lifecycle.Member(member.store, self.local_rank, len(self.local_ranks),
                                  f"{member.name}@{setup.prefix}/host{self.host}")
        # Simulated hosts share one machine: the host's ring waits as the machine's load requires.
        # Its waits last intra_grace(timeout) longer than the waits between hosts: a rank waiting
        # on its host's ring for a rank that waits on a lost host must not time out first, or it
        # would report a timeout where the other reports (and aborts the ring with) the lost host.
        self.intra = host_ring(member=local, timeout=self.timeout + intra_grace(self.timeout),
                               machine_ranks=machine_ranks)
        self.cross = self.host_pg = self._all = None
        self._prefix = setup.prefix
        try:
            if plan == "two-level":  # the ranks of local rank j on every host, in host order
                self.cross = _gloo(member.store, f"{setup.prefix}/cross{self.local_rank}/",
                                   self.host, self.nhosts, self.timeout)
            else:
                if self.local_rank == 0:  # the hosts' first ranks
                    self.cross = _gloo(member.store, f"{setup.prefix}/leaders/", self.host,
                                       self.nhosts, self.timeout)
                if len(self.local_ranks) > 1:
                    self.host_pg = _gloo(member.store, f"{setup.prefix}/host{self.host}/",
                                         self.local_rank, len(self.local_ranks), self.timeout)
            # Nobody leaves setup (and may close its Gloo pairs) before every rank is connected.
            if not setup.count("ready", self.world_size, self.timeout):
                raise RingReduceError(f"ringreduce: rank {self.rank}: hierarchical setup timed out "
                                      f"after {self.timeout:g} s waiting for the other ranks "
                                      f"({_lifecycle.SETUP_HINT})")
        except BaseException:
            self.intra.close()
            raise
        self._setup_trace(setup.prefix)
        log.debug("rank %d/%d: hierarchical plan %s (host %d of %d, local rank %d of %d)",
                  self.rank, self.world_size, plan, self.host, self.nhosts, self.local_rank,
                  len(self.local_ranks))

    def _pids(self):  # this host's ranks' (the others' are on other machines)
        pids = [None] * self.world_size
        for r, pid in zip(self.local_ranks, self.intra._native.pids()):
            pids[r] = pid
        return pids

    # -- steps --------------------------------------------------------------------------------
    def _begin(self, call):
        self._call = call
        if self.intra.broken:  # after a failure every later call raises at once, as the ring does
            raise RingReduceError(f"ringreduce: {self._where()}: group {self.member.name} is broken "
                                  f"by an earlier failure; destroy it (ringreduce.destroy(group)) "
                                  f"and call again to rebuild it")

    def _where(self):
        return (f"rank {self.rank} (host {self.host}, local rank {self.local_rank}): "
                f"{self._call}")

    def _gloo_step(self, what, fn):
        """Runs a Gloo call; its error becomes ours, naming the call, the phase and the group; the
        host's shared-memory ring is aborted so local peers waiting on this rank raise at once."""
        self._gloo_wait(self._gloo_start(what, fn))

    def _gloo_start(self, what, fn):
        """Starts a Gloo call (fn returns its Work); _gloo_wait waits for it, as _gloo_step."""
        try:
            return what, fn()
        except Exception as e:
            self._gloo_failed(what, e)

    def _gloo_wait(self, started):
        what, work = started
        try:
            # Gloo's point-to-point works (_Works) are not watched: a wait of theirs that times
            # out leaves the receive unfinished for good (seen: test_hosts' wire exchange).
            if not isinstance(work, two_level._Works) and not work.is_completed():
                self._watch_broken(work)
            work.wait()
        except Exception as e:
            self._gloo_failed(what, e)

    def _watch_broken(self, work):
        """Waits for a Gloo call while watching the group's broken key: a rank whose call failed
        sets it (_breaking), and a peer on another host waiting for that rank's part would
        otherwise wait until the timeout (Gloo notices a dead process, not a living one that left)."""
        key = f"{self._prefix}/broken"
        deadline = time.monotonic() + self.timeout  # then the plain wait, with its own deadline
        while time.monotonic() < deadline:
            try:  # a Work's wait with a timeout raises at the timeout and leaves the call running
                work.wait(BROKEN_POLL)
                return
            except Exception:
                if work.is_completed():  # done meanwhile: its own outcome, not this timeout
                    work.wait()
                    return
            if self.member.store.check([key]):
                reason = self.member.store.get(key).decode()
                self._abort_gloo()
                raise RingReduceError(f"the group was broken by another rank's failure: {reason}")

    def _gloo_failed(self, what, e):
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        reason = (f"{self._where()}: inter-host step ({what}, Gloo) failed in group "
                  f"{self.member.name}: {first}")
        try:
            self.intra.abort(reason)
        except Exception:
            pass
        raise RingReduceError(f"ringreduce: {reason}") from e

    def _shm(self, what, fn, *args):
        """Runs a call of the host's shared-memory ring; its error (whose ranks are local ranks)
        is raised naming this rank in the group, the call and the phase."""
        try:
            fn(*args)
        except RingReduceError as e:
            raise RingReduceError(f"ringreduce: {self._where()}: intra-host step ({what}) failed "
                                  f"in group {self.member.name}: {e}") from e

    def _finish_avg(self, t, code):
        if code == AVG:
            if t.is_floating_point():
                t.div_(self.world_size)
            else:
                t.copy_(torch.div(t, self.world_size, rounding_mode="trunc"))

    def _all_reduce_buf(self, buf, code):
        """All-reduce of a flat contiguous buffer (its length a multiple of L for two-level)."""
        red = SUM if code == AVG else code
        opts = dist.AllreduceOptions()
        opts.reduceOp = _GLOO_OPS[red]
        if self.plan == "two-level":  # pipelined over pieces (two_level.py)
            two_level.all_reduce(self, buf, code)
            return
        self._shm("all-reduce", self.intra._native.all_reduce, buf, red)
        if self.cross is not None:
            self._gloo_step("all_reduce among the hosts' first ranks",
                            lambda: self.cross.allreduce([buf], opts))
            self._finish_avg(buf, code)
        self._broadcast_from_first(buf)

    def _broadcast_from_first(self, buf):
        if self.host_pg is not None:
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            self._gloo_step("broadcast inside the host", lambda: self.host_pg.broadcast([buf], opts))

    def _algo(self):  # for the flight recorder
        return "ordered" if _C.deterministic() else self.plan

    def _all_group(self):
        """The Gloo group of every rank (deterministic mode, wire calls), made at the first such
        call: every rank reaches it together."""
        if self._all is None:
            try:
                self._all = _gloo(self.member.store, f"{self._prefix}/all/", self.rank,
                                  self.world_size, self.timeout)
            except Exception as e:
                reason = (f"{self._where()}: connecting every rank for deterministic mode or a "
                          f"wire_dtype call failed in group {self.member.name} (is "
                          f"RINGREDUCE_DETERMINISTIC the same on every rank, and wire_dtype the "
                          f"same in every rank's call?): "
                          f"{str(e).splitlines()[0] if str(e) else type(e).__name__}")
                self.intra.abort(reason)
                raise RingReduceError(f"ringreduce: {reason}") from e
        return self._all

    def _wire(self, rows, code, wire, out, round_result, group=None):
        """rows: (n, c), row k this rank's piece for member k of group (default: every rank; c a
        whole number of blocks, or a reduce_scatter's output size: blocks from each piece's start,
        as the shared-memory transport cuts them). Each row goes onto the wire and to its owner,
        which folds the n in member order into out (c,), AVG dividing by n;
        round_result: rounded onto the wire once more, and every member's result gathered back
        (returns the (n, c) gathered values' wire bytes). Every row carries its sender's count of
        fp16 overflows (8 bytes after the wire bytes); returns the total this rank learned."""
        n, c = rows.shape
        wb = _C.wire_bytes(wire, c)
        group = self._all_group() if group is None else group
        send = self._buf("wire_send", n * (wb + 8), torch.uint8).view(n, wb + 8)
        over = sum(_C.wire_encode(send[k, :wb], rows[k], wire) for k in range(n))
        send[:, wb:].copy_(torch.tensor([over], dtype=torch.int64).view(torch.uint8).expand(n, 8))
        got = self._buf("wire_got", n * (wb + 8), torch.uint8).view(n, wb + 8)
        self._gloo_step("all_to_all of the wire chunks to their owners",
                        lambda: group.alltoall_base(got.view(-1), send.view(-1), [], [],
                                                    dist.AllToAllOptions()))
        over = int(got[:, wb:].contiguous().view(torch.int64).sum())
        res = self._buf("wire_res", wb + 8, torch.uint8) if round_result else None
        over += _C.wire_reduce(out, res[:wb] if round_result else None, got[:, :wb], code, wire)
        if not round_result:
            return None, over
        res[wb:].copy_(torch.tensor([over], dtype=torch.int64).view(torch.uint8))
        gathered = self._buf("wire_all", n * (wb + 8), torch.uint8).view(n, wb + 8)
        self._gloo_step("all_gather of the reduced wire chunks",
                        lambda: group._allgather_base(gathered.view(-1), res))
        return gathered, int(gathered[:, wb:].contiguous().view(torch.int64).sum())

    def _overflowed(self, fn, over):
        if over:
            raise OverflowError(
                f"ringreduce: {fn}(wire_dtype=float16): a finite value beyond float16's range "
                f"(65504) on the wire (an input, or a sum) of some rank; the result holds inf "
                f"there. Divide first (op=AVG), or use wire_dtype=torch.bfloat16 (float32's "
                f"range)")

    def _all_reduce_wire(self, flat, code, wire):
        n, numel = self.world_size, flat.numel()
        c = -(-numel // (n * WIRE_BLOCK)) * WIRE_BLOCK  # whole blocks per rank
        padded = self._buf("wire_pad", n * c, flat.dtype)
        padded[:numel].copy_(flat)
        padded[numel:].zero_()  # zeros do not move a block's largest value; dropped after
        rows = padded.view(n, c)
        mine = self._buf("wire_mine", c, flat.dtype)
        gathered, over = self._wire(rows, code, wire, mine, True)
        wb = _C.wire_bytes(wire, c)
        for k in range(n):
            _C.wire_decode(rows[k], gathered[k, :wb], wire)
        flat.copy_(padded[:numel])
        self._overflowed("all_reduce", over)

    def _cross_wire(self, rows, code, wire):
        """rows: (H, c) this rank's host partial sums, row h for host h (c whole blocks); every
        row of every host's rank of this cross group (AVG: divided by the group's size first)
        rounded onto the wire once, folded in host order in float32, rounded once more and
        gathered: rows then hold the result on every member. Returns the fp16 overflows
        learned."""
        c = rows.shape[1]
        mine = self._buf("wire_mine", c, rows.dtype)
        if code == AVG:
            rows.div_(self.world_size)
        gathered, over = self._wire(rows, SUM, wire, mine, True, self.cross)
        wb = _C.wire_bytes(wire, c)
        for k in range(rows.shape[0]):
            _C.wire_decode(rows[k], gathered[k, :wb], wire)
        return over

    def _host_total(self, over, wire):
        """The fp16 overflows every rank of the host learned, summed (the same on every rank of
        the group: each host's ranks together saw every encode once); 0 without an fp16 wire."""
        if wire != WIRE_F16:
            return over
        t = torch.tensor([over], dtype=torch.int64)
        if self.plan == "two-level":
            if len(self.local_ranks) > 1:
                self._shm("overflow count", self.intra._native.all_reduce, t, SUM)
        else:
            self._broadcast_from_first(t)
        return int(t[0])

    def _all_reduce_wire_hosts(self, flat, code, wire):
        """The wire on the inter-host leg: float32 (the tensor's dtype) inside each host, each
        host's partial sum rounded onto the wire once between hosts (docs/usage.md)."""
        H, L, numel = self.nhosts, len(self.local_ranks), flat.numel()
        per_host = self.plan == "two-level"
        cb = -(-numel // ((L if per_host else 1) * H * WIRE_BLOCK)) * WIRE_BLOCK
        m = (L if per_host else 1) * H * cb
        buf = flat
        if m != numel:
            buf = self._buf("wire_pad", m, flat.dtype)
            buf[:numel].copy_(flat)
            buf[numel:].zero_()  # zeros do not move a block's largest value; dropped after
        over = 0
        if per_host:
            over = two_level.all_reduce_wire(self, buf, code, wire)
        else:
            self._shm("all-reduce", self.intra._native.all_reduce, buf, SUM)
            if self.cross is not None:
                over = self._cross_wire(buf.view(H, cb), code, wire)
            self._broadcast_from_first(buf)
        over = self._host_total(over, wire)
        if buf is not flat:
            flat.copy_(buf[:numel])
        self._overflowed("all_reduce", over)

    def _reduce_scatter_wire_hosts(self, src, out, code, wire):
        """Two-level reduce_scatter with the wire between hosts: the host's partial sums of this
        local rank's ranks' chunks, each rounded once onto the wire, folded in host order."""
        H, c = self.nhosts, out.numel()
        buf = self._buf("perm", src.numel(), src.dtype)  # (local rank, host) order
        torch.index_select(src.view(self.world_size, c), 0, self._order_index(),
                           out=buf.view(self.world_size, c))
        mine = buf[self.local_rank * H * c:(self.local_rank + 1) * H * c]
        self._shm("reduce-scatter", self.intra._native.reduce_scatter, mine, buf, SUM)
        if code == AVG:  # as all_reduce's: the average's range on the wire
            mine.div_(self.world_size)
        _, over = self._wire(mine.view(H, c), SUM, wire, out, False, self.cross)
        self._overflowed("reduce_scatter_tensor", self._host_total(over, wire))

    def _ordered(self, rows, code):
        """rows: (N, c), row k this rank's piece for rank k. Returns this rank's (c,) piece of the
        result: every rank's row for this rank, folded in rank order (deterministic mode)."""
        n, c = rows.shape
        self._all_group()
        got = self._buf("det_got", n * c, rows.dtype)
        self._gloo_step("all_to_all of the chunks to their owners (deterministic mode)",
                        lambda: self._all.alltoall_base(got.view(torch.uint8),
                                                        rows.reshape(-1).view(torch.uint8), [], [],
                                                        dist.AllToAllOptions()))
        mine = self._buf("det_mine", c, rows.dtype)
        _C.reduce_rows(mine, got.view(n, c), code)
        return mine

    def _all_reduce_ordered(self, flat, code):
        n, numel = self.world_size, flat.numel()
        c = -(-numel // n)
        rows = self._buf("det_rows", n * c, flat.dtype)
        rows[:numel].copy_(flat)
        rows[numel:].zero_()
        mine = self._ordered(rows.view(n, c), code)
        self._gloo_step("all_gather of the reduced chunks (deterministic mode)",
                        lambda: self._all._allgather_base(rows.view(torch.uint8),
                                                          mine.view(torch.uint8)))
        flat.copy_(rows[:numel])

    def _buf(self, slot, numel, dtype):
        """A reused scratch tensor of numel elements (contents undefined), grown as needed."""
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        raw = self._scratch.get(slot)
        if raw is None or raw.numel() < nbytes:
            raw = self._scratch[slot] = torch.empty(nbytes, dtype=torch.uint8)
        return raw[:nbytes].view(dtype)

    def _padded(self, n):
        """Elements of a buffer holding n that the two-level plan can split in L equal chunks."""
        L = len(self.local_ranks) if self.plan == "two-level" else 1
        return -(-n // L) * L

    # -- collectives (arguments already checked by ringreduce.collectives) --------------------
    def all_reduce(self, tensor, op_code, async_op, wire=0):
        def run():
            self._begin("all_reduce")
            n = tensor.numel()
            if n == 0:
                return
            flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
            if wire:
                if _C.deterministic():  # the flat form: bits that do not depend on the layout
                    self._all_reduce_wire(flat, op_code, wire)
                else:
                    self._all_reduce_wire_hosts(flat, op_code, wire)
                if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
                    tensor.copy_(flat.view(tensor.shape))
                return
            if _C.deterministic():
                self._all_reduce_ordered(flat, op_code)
                if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
                    tensor.copy_(flat.view(tensor.shape))
                return
            m = self._padded(n)
            buf = flat if m == n else self._buf("pad", m, tensor.dtype)
            if buf is not flat:
                buf[:n].copy_(flat)
                buf[n:].zero_()  # reduced, then dropped
            self._all_reduce_buf(buf, op_code)
            if buf is not flat:
                flat.copy_(buf[:n])
            if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
                tensor.copy_(flat.view(tensor.shape))
        return self._run(self._traced(run, "all_reduce", tensor.numel(), tensor.dtype, op_code,
                                      tensor.numel() * tensor.element_size(), self._algo()),
                         [tensor], async_op)

    def _order(self):
        """Group ranks in (local rank, host) order: the two-level plan's layout of chunks."""
        L = len(self.local_ranks)
        return [self.by_host[h][j] for j in range(L) for h in range(self.nhosts)]

    def _order_index(self):
        return torch.tensor(self._order())

    def reduce_scatter(self, output, input, op_code, async_op, wire=0):
        def run():
            self._begin("reduce_scatter_tensor")
            c = output.numel()
            if c == 0:
                return
            src = input.contiguous().view(-1)
            if wire:
                out = self._buf("wire_out", c, output.dtype)
                if self.plan == "two-level" and not _C.deterministic():
                    self._reduce_scatter_wire_hosts(src, out, op_code, wire)
                else:  # the flat form (deterministic mode; uneven layouts)
                    _, over = self._wire(src.view(self.world_size, c), op_code, wire, out, False)
                    self._overflowed("reduce_scatter_tensor", over)
                output.copy_(out.view(output.shape))
                return
            if _C.deterministic():
                output.copy_(self._ordered(src.view(self.world_size, c), op_code).view(output.shape))
                return
            if self.plan != "two-level":  # the whole reduction, then this rank's chunk
                buf = self._buf("perm", src.numel(), src.dtype)
                buf.copy_(src)
                self._all_reduce_buf(buf, op_code)
                output.copy_(buf[self.rank * c:(self.rank + 1) * c].view(output.shape))
                return
            H, L, j = self.nhosts, len(self.local_ranks), self.local_rank
            chunks = src.view(self.world_size, c)
            buf = self._buf("perm", src.numel(), src.dtype)  # (local rank, host) order
            torch.index_select(chunks, 0, self._order_index(), out=buf.view(self.world_size, c))
            red = SUM if op_code == AVG else op_code
            mine = buf[j * H * c:(j + 1) * H * c]  # the chunks of local rank j's ranks
            self._shm("reduce-scatter", self.intra._native.reduce_scatter, mine, buf, red)
            out = self._buf("out", c, output.dtype)
            opts = dist.ReduceScatterOptions()
            opts.reduceOp = _GLOO_OPS[red]
            self._gloo_step("reduce_scatter among the ranks of this local rank",
                            lambda: self.cross._reduce_scatter_base(out, mine, opts))
            self._finish_avg(out, op_code)
            output.copy_(out.view(output.shape))
        return self._run(self._traced(run, "reduce_scatter", input.numel(), input.dtype, op_code,
                                      input.numel() * input.element_size(), self._algo()),
                         [output], async_op)

    def all_gather(self, output, input, async_op):
        def run():
            self._begin("all_gather_into_tensor")
            c = input.numel()
            if c == 0:
                return
            src = input.contiguous().view(-1)
            H, L = self.nhosts, len(self.local_ranks)
            if self.plan == "two-level":
                mine = self._buf("mine", H * c, input.dtype)  # local rank j's ranks, host order
                self._gloo_step("all_gather among the ranks of this local rank",
                                lambda: self.cross._allgather_base(mine, src))
                gathered = self._buf("gathered", L * H * c, input.dtype)
                self._shm("all-gather", self.intra._native.all_gather, gathered, mine)
                order = self._order()
            else:  # inside the host, then among the first ranks (padded to the largest host)
                Lmax = max(len(rs) for rs in self.by_host)
                block = self._buf("mine", Lmax * c, input.dtype)
                self._shm("all-gather", self.intra._native.all_gather, block[:L * c], src)
                gathered = self._buf("gathered", H * Lmax * c, input.dtype)
                if self.cross is not None:
                    self._gloo_step("all_gather among the hosts' first ranks",
                                    lambda: self.cross._allgather_base(gathered, block))
                self._broadcast_from_first(gathered)
                order = [rs[j] if j < len(rs) else -1 for rs in self.by_host for j in range(Lmax)]
            rows = gathered.view(len(order), c)
            where = [0] * self.world_size
            for i, r in enumerate(order):
                if r >= 0:
                    where[r] = i
            where = torch.tensor(where)
            if output.is_contiguous():
                torch.index_select(rows, 0, where, out=output.view(self.world_size, c))
            else:
                output.copy_(rows[where].view(output.shape))
        return self._run(self._traced(run, "all_gather", output.numel(), output.dtype, 0,
                                      output.numel() * output.element_size(), self.plan),
                         [output], async_op)

    def _run(self, fn, result, async_op):
        fn = self._breaking(fn)
        if async_op:
            fn = _overflow_as_error(fn)
        fut = self._submit(fn, result, torch.futures.Future, inline=not async_op)
        if fut is None:
            return None
        if async_op:
            return _lifecycle.Work(fut, self._interrupted)
        _lifecycle.wait_interruptibly(fut, self._interrupted)
        fut.wait()
        return None

    # -- lifetime ----------------------------------------------------------------------------
    @property
    def broken(self):
        return self.intra.broken

    def _breaking(self, fn):
        """A call that broke the host's ring also closes this rank's Gloo groups: the other hosts'
        ranks waiting on this one in an inter-host step then fail at once ("connection closed"),
        not at the timeout, and abort their own hosts' rings in turn."""
        def run():
            try:
                fn()
            except RingReduceError as e:
                if self.intra.broken:
                    try:
                        self.member.store.set(f"{self._prefix}/broken",
                                              str(e).splitlines()[0][:500])
                    except Exception:  # noqa: BLE001  (the store's holder lost: Gloo notices)
                        pass
                    self._abort_gloo()
                raise
        return run

    def _abort_gloo(self):
        for pg in (self.cross, self.host_pg, self._all):
            if pg is not None and hasattr(pg, "abort"):
                try:
                    pg.abort()
                except Exception:
                    pass

    def abort(self, reason="aborted by the user"):
        self.intra.abort(reason)
        self._abort_gloo()

    def _stop_calls(self, busy):
        if busy:
            self.intra.abort(f"rank {self.rank}: communicator closed with calls in flight")

    def _close_native(self):
        self._scratch = {}
        self.intra.close()
        self.cross = self.host_pg = self._all = None
