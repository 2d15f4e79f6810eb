"""The two-level plan's all_reduce (every host has L of the group's ranks: _hier/__init__.py),
pipelined over pieces of the tensor, with or without a narrow wire between hosts.

Each piece goes through these stages: a reduce-scatter inside the host over shared memory (local
rank j then holds the host's partial sum of its shard, in the tensor's dtype); the shard reduced
among the H ranks of local rank j, one per host; an all-gather inside the host. Between hosts
each rank sends 2(H-1)/H of 1/L of the tensor (of its wire-width copy with a wire).

- float (no wire): the shard's all_reduce over Gloo.
- wire: the shard's H rows (AVG: divided by the group's size first, so that the wire carries the
  average's range) rounded onto the wire once, row h sent to host h; the H rows that arrive
  folded in host order in float32 and rounded once more; the results gathered among the same
  ranks (Gloo point-to-point, receives posted first).

The stages of consecutive pieces overlap: while piece p is reduced inside the host, earlier
pieces are on the network (Gloo's own threads), so a slow link, not the host, sets the pace.
Every rank issues the same calls in the same order (shared-memory calls on the caller's thread;
Gloo calls started there, run by Gloo), so the pipeline needs no agreement beyond the call's.
With a wire, pieces are whole numbers of 128-element blocks in every row, so a cut never moves a
block boundary: the bits do not depend on the piece size.
"""
import datetime

import torch
import torch.distributed as dist

from .. import _C, _env

SUM, AVG = _C.OP_CODES["SUM"], _C.OP_CODES["AVG"]  # the native op codes
GLOO_OPS = {code: getattr(dist.ReduceOp, k) for k, code in _C.OP_CODES.items() if k != "AVG"}
WIRE_BLOCK = _C.WIRE_BLOCK  # elements per fp8 scale
# Tensor bytes per piece: a quarter of the tensor, between 4 and 16 MiB. Smaller pieces overlap
# more of the link with the host's work but meet the other ranks more often, and each meeting
# costs a time slice when ranks outnumber cores. Measured on emulated hosts (2 hosts x 2 ranks on
# the 2-core dev machine; float32 / bf16 wire / fp8 wire, ms): 16 MiB at 1 Gbit/s in 4 MiB pieces
# 144 / 77 / 41, in one piece 151 / 82 / 47; at 10 Gbit/s 40 / 43 / 35 and 38-53 / 30 / 24;
# 64 MiB at 1 Gbit/s in 4 MiB pieces 566 / 287 / 160, in 16 MiB 582 / 300 / 164; at 10 Gbit/s
# 161 / 162 / 134 and 134 / 116 / 102. RINGREDUCE_HIER_PIECE_KB fixes it (tests force many).
PIECE_MIN, PIECE_MAX = 4 << 20, 16 << 20
SLOTS = 3  # pieces in flight: one reduced inside the host, one exchanged, one gathered
# More than two hosts: tensors up to this size go in one exchange (one round trip, H/2 times the
# bytes of the two steps); two hosts always do (the same bytes).
ONE_SHOT_BYTES = 256 << 10


def piece_bytes(total):
    kb = _env.get("RINGREDUCE_HIER_PIECE_KB")
    return kb << 10 if kb else max(PIECE_MIN, min(PIECE_MAX, total // 4))


def pieces(per_rank, L, H, elem_size, align):
    """[(offset in the buffer, row length)] of a buffer of L * H * per_rank elements (per_rank a
    multiple of align): each piece L * H rows of a multiple of align elements."""
    per_row = max(align, piece_bytes(per_rank * L * H * elem_size) // (elem_size * L * H)
                  // align * align)
    out, done = [], 0
    while done < per_rank:
        n = min(per_row, per_rank - done)
        out.append((L * H * done, n))
        done += n
    return out


def _drive(count, start, middle, end, depth):
    """Runs pieces 0..count-1 through start, middle (or None) and end, up to depth pieces in
    flight, every stage in piece order; returns the sum of what end returned."""
    total, inflight = 0, []
    for p in range(count):
        inflight.append(start(p))
        if middle is not None and len(inflight) >= 2:
            middle(inflight[-2])
        if len(inflight) == depth:
            total += end(inflight.pop(0))
    if middle is not None and inflight:
        middle(inflight[-1])
    for pc in inflight:
        total += end(pc)
    return total


TAG_ROWS, TAG_GATHER = 100, 200  # Gloo point-to-point tags: + the piece's slot


class _Works:
    """Gloo point-to-point works waited for together, each within the communicator's timeout (a
    peer host that vanished without closing its connections fails the wait, never hangs it); a
    failure names the peer: what it was (receiving from / sending to host h (its ranks))."""

    def __init__(self, works, timeout):
        self.works, self.timeout = works, datetime.timedelta(seconds=timeout)

    def wait(self):
        for what, w in self.works:
            try:
                w.wait(self.timeout)
            except Exception as e:
                first = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise RuntimeError(f"{what}: {first}") from e


def hosts_of(comm):
    """How errors name the cross group's members: host h and its ranks in the group."""
    return [f"host {h} (ranks {', '.join(map(str, rs))})" for h, rs in enumerate(comm.by_host)]


def _exchange(pg, me, send, got, tag, timeout, peers):
    """Among pg's members: got[k] = what member k sends this member, for every k but this member's
    own (the caller writes got[me]); send is (members, bytes), row k for member k, or one row for
    all (a gather). Receives are posted before sends, so no member's data waits for a buffer
    (Gloo's alltoall and allgather took 1.5x the link's time on emulated hosts where this takes
    1.0x). peers[k] names member k in errors."""
    n = got.shape[0]
    row = (lambda k: send[k]) if send.dim() == 2 else (lambda k: send)
    works = [(f"receiving from {peers[k]}", pg.recv([got[k]], k, tag))
             for k in range(n) if k != me]
    works += [(f"sending to {peers[k]}", pg.send([row(k)], k, tag)) for k in range(n) if k != me]
    return _Works(works, timeout)


class _Piece:
    __slots__ = ("slot", "off", "n", "wb", "rows", "shard", "send", "got", "gathered", "work")


def all_reduce(comm, buf, code):
    """In-place all_reduce of buf (L * c elements) without a wire (code: SUM, MIN, MAX,
    PROD, or AVG, which sums and divides once by the group's size on the shard's owner)."""
    L, j = len(comm.local_ranks), comm.local_rank
    red = SUM if code == AVG else code
    opts = dist.AllreduceOptions()
    opts.reduceOp = GLOO_OPS[red]
    plan = pieces(buf.numel() // L, L, 1, buf.element_size(), 1)

    def start(p):
        off, n = plan[p]
        piece = buf[off:off + L * n]
        shard = piece[j * n:(j + 1) * n]
        if L > 1:
            comm._shm("reduce-scatter", comm.intra._native.reduce_scatter, shard, piece, red)
        work = comm._gloo_start("all_reduce of this rank's chunk",
                                lambda: comm.cross.allreduce([shard], opts))
        return piece, shard, work

    def end(pc):
        piece, shard, work = pc
        comm._gloo_wait(work)
        comm._finish_avg(shard, code)
        if L > 1:
            comm._shm("all-gather", comm.intra._native.all_gather, piece, shard)
        return 0

    _drive(len(plan), start, None, end, 2)


def all_reduce_wire(comm, buf, code, wire):
    """All-reduce of buf (L * H * cb elements, cb whole blocks) with the wire between hosts;
    returns the fp16 overflows this rank learned (its local rank's ranks' encodes and folds)."""
    H, L, j = comm.nhosts, len(comm.local_ranks), comm.local_rank
    plan = pieces(buf.numel() // (L * H), L, H, buf.element_size(), WIRE_BLOCK)
    me, peers = comm.host, hosts_of(comm)

    def reduced(p):
        pc = _Piece()
        pc.slot, (pc.off, pc.n) = p % SLOTS, plan[p]
        piece = buf[pc.off:pc.off + L * H * pc.n]
        pc.shard = piece[j * H * pc.n:(j + 1) * H * pc.n]
        if L > 1:
            comm._shm("reduce-scatter", comm.intra._native.reduce_scatter, pc.shard, piece, SUM)
        if code == AVG:  # the average's range on the wire (a float16 wire would overflow first)
            pc.shard.div_(comm.world_size)
        pc.rows = pc.shard.view(H, pc.n)
        pc.wb = _C.wire_bytes(wire, pc.n)
        return pc

    def all_gather(pc):
        if L > 1:
            piece = buf[pc.off:pc.off + L * H * pc.n]
            comm._shm("all-gather", comm.intra._native.all_gather, piece, pc.shard)

    if H == 2 or buf.numel() * buf.element_size() <= ONE_SHOT_BYTES:
        return _one_shot(comm, plan, reduced, all_gather, wire)

    def start(p):
        pc = reduced(p)
        wb = pc.wb
        pc.send = comm._buf(f"wp_send{pc.slot}", H * (wb + 8), torch.uint8).view(H, wb + 8)
        pc.got = comm._buf(f"wp_got{pc.slot}", H * (wb + 8), torch.uint8).view(H, wb + 8)
        # this host's own row goes straight where the fold reads it
        count = sum(_C.wire_encode((pc.got if k == me else pc.send)[k, :wb], pc.rows[k], wire)
                    for k in range(H))
        counts = torch.tensor([count], dtype=torch.int64).view(torch.uint8)
        pc.send[:, wb:].copy_(counts.expand(H, 8))
        pc.got[me, wb:].copy_(counts)
        pc.work = comm._gloo_start("exchange of the wire rows with the other hosts",
                                   lambda: _exchange(comm.cross, me, pc.send, pc.got,
                                                     TAG_ROWS + pc.slot, comm.timeout, peers))
        return pc

    def exchanged(pc):
        comm._gloo_wait(pc.work)
        wb = pc.wb
        count = int(pc.got[:, wb:].contiguous().view(torch.int64).sum())
        pc.gathered = comm._buf(f"wp_all{pc.slot}", H * (wb + 8), torch.uint8).view(H, wb + 8)
        # The fold's result, rounded, is this host's row of the shard (its input row is on the
        # wire already) and its wire bytes this member's row of the gather.
        count += _C.wire_reduce(pc.rows[me], pc.gathered[me, :wb], pc.got[:, :wb], SUM, wire)
        pc.gathered[me, wb:].copy_(torch.tensor([count], dtype=torch.int64).view(torch.uint8))
        pc.work = comm._gloo_start("gather of the folded wire rows from the other hosts",
                                   lambda: _exchange(comm.cross, me, pc.gathered[me],
                                                     pc.gathered, TAG_GATHER + pc.slot,
                                                     comm.timeout, peers))

    def gathered(pc):
        comm._gloo_wait(pc.work)
        wb = pc.wb
        for k in range(H):
            if k != comm.host:
                _C.wire_decode(pc.rows[k], pc.gathered[k, :wb], wire)
        all_gather(pc)
        return int(pc.gathered[:, wb:].contiguous().view(torch.int64).sum())

    return _drive(len(plan), start, exchanged, gathered, SLOTS)


def _one_shot(comm, plan, reduced, all_gather, wire):
    """The wire's exchange in one step: every host's rank of this cross group sends its whole
    shard on the wire to every other, and each folds every row itself in host order (the same
    inputs in the same order: the same bits as the row's owner gets in two steps). With two
    hosts it moves the same bytes as the two steps (a row out, a row back) in one round trip;
    with more it moves H/2 times as many, so it serves only small tensors there."""
    H, me = comm.nhosts, comm.host

    def start(p):
        pc = reduced(p)
        wb = pc.wb
        # got[h, k]: host h's row k; this host's rows are encoded in place and sent from there
        pc.got = comm._buf(f"wp_got{pc.slot}", H * H * (wb + 8), torch.uint8).view(H, H, wb + 8)
        mine = pc.got[me]
        count = sum(_C.wire_encode(mine[k, :wb], pc.rows[k], wire) for k in range(H))
        mine[:, wb:].zero_()
        mine[0, wb:].copy_(torch.tensor([count], dtype=torch.int64).view(torch.uint8))
        pc.work = comm._gloo_start("exchange of the wire shards with the other hosts",
                                   lambda: _exchange(comm.cross, me, mine.view(-1),
                                                     pc.got.view(H, -1), TAG_ROWS + pc.slot,
                                                     comm.timeout, hosts_of(comm)))
        return pc

    def end(pc):
        comm._gloo_wait(pc.work)
        wb = pc.wb
        count = int(pc.got[:, :, wb:].contiguous().view(torch.int64).sum())
        scratch = comm._buf("wp_res", wb, torch.uint8)
        for k in range(H):  # the fold of row k over the hosts, rounded: the result's row k
            count += _C.wire_reduce(pc.rows[k], scratch, pc.got[:, k, :wb], SUM, wire)
        all_gather(pc)
        return count

    return _drive(len(plan), start, None, end, 2)
