"""The narrow wire on the inter-host leg of the two-level plan, pipelined (_hier.py's all_reduce
with wire_dtype=, outside deterministic mode).

Each piece of the tensor goes through five stages: reduce-scatter inside the host over shared
memory (local rank j then holds the host's partial sum of its shard, in the tensor's dtype), the
shard's H rows rounded onto the wire once and sent, row h to host h (one all_to_all among the ranks
of local rank j, over Gloo), the H rows that arrive folded in host order in float32 (AVG divides by
the group's size) and rounded once more, those results gathered among the same ranks (Gloo), then
decoded and all-gathered inside the host. Between hosts each rank sends 2(H-1)/H of 1/L of the
wire-width tensor.

The stages of consecutive pieces overlap: while piece p is reduced inside the host, the exchange of
piece p - 1 and the gather of piece p - 2 are on the network (Gloo's own threads), so the link,
not the host, sets the pace. Every rank issues the same calls in the same order (shared-memory calls
on the caller's thread, Gloo calls started there and run by Gloo), so the pipeline needs no
agreement beyond the call's. Pieces are whole numbers of 128-element blocks in every shard, so a
piece's cut never moves a block boundary: the bits do not depend on the piece size.
"""
import os

import torch

from . import _C

SUM = 0  # the native op code (csrc/cpu/reduce.h)
WIRE_BLOCK = 128  # elements per fp8 scale (csrc/cpu/wire.h, kWireBlock)
# Tensor bytes per piece. Smaller pieces overlap more of the link with the host's work but pay
# each stage's fixed cost (two Gloo calls and two shared-memory calls, ~0.2-0.5 ms each on the
# 2-core dev machine) more often; measured on emulated hosts (BENCHMARKS.md, "Hosts on a real
# link"). RINGREDUCE_HIER_PIECE_KB overrides it (measurements, tests).
PIECE_BYTES = 4 << 20
SLOTS = 3  # pieces in flight: one reduced inside the host, one exchanged, one gathered


def piece_bytes():
    kb = os.environ.get("RINGREDUCE_HIER_PIECE_KB", "").strip()
    return int(kb) << 10 if kb else PIECE_BYTES


def pieces(cb, L, H, elem_size):
    """[(offset in the buffer, row length)] of a buffer of L * H * cb elements (cb whole blocks):
    each piece L * H rows of a whole number of blocks."""
    per_row = max(WIRE_BLOCK, piece_bytes() // (elem_size * L * H) // WIRE_BLOCK * WIRE_BLOCK)
    out, done = [], 0
    while done < cb:
        n = min(per_row, cb - done)
        out.append((L * H * done, n))
        done += n
    return out


TAG_ROWS, TAG_GATHER = 100, 200  # Gloo point-to-point tags: + the piece's slot


class _Works:
    def __init__(self, works):
        self.works = works

    def wait(self):
        for w in self.works:
            w.wait()


def _exchange(pg, me, send, got, tag):
    """Among pg's members: got[k] = what member k sends this member; send is (members, bytes), row
    k for member k, or one row for all (a gather). Receives are posted before sends, so no
    member's data waits for a buffer (Gloo's alltoall and allgather took 1.5x the link's time on
    emulated hosts where this takes 1.0x: BENCHMARKS.md, "Hosts on a real link")."""
    n = got.shape[0]
    row = (lambda k: send[k]) if send.dim() == 2 else (lambda k: send)
    works = [pg.recv([got[k]], k, tag) for k in range(n) if k != me]
    works += [pg.send([row(k)], k, tag) for k in range(n) if k != me]
    got[me].copy_(row(me))
    return _Works(works)


class _Piece:
    __slots__ = ("slot", "off", "n", "wb", "rows", "shard", "send", "got", "mine", "res", "gathered",
                 "work")


def all_reduce(comm, buf, code, wire):
    """All-reduce of buf (L * H * cb elements, cb whole blocks) with the wire between hosts;
    returns the fp16 overflows this rank learned (its local rank's ranks' encodes and folds)."""
    H, L, j = comm.nhosts, len(comm.local_ranks), comm.local_rank
    cb = buf.numel() // (L * H)
    plan = pieces(cb, L, H, buf.element_size())
    over = 0
    inflight = []  # pieces in order: each waits for its exchange, then for its gather

    def start(p):
        pc = _Piece()
        pc.slot, (pc.off, pc.n) = p % SLOTS, plan[p]
        pc.gathered = None
        piece = buf[pc.off:pc.off + L * H * pc.n]
        pc.shard = piece[j * H * pc.n:(j + 1) * H * pc.n]
        if L > 1:
            comm._shm("reduce-scatter", comm.intra._native.reduce_scatter, pc.shard, piece, SUM)
        pc.rows = pc.shard.view(H, pc.n)
        pc.wb = wb = _C.wire_bytes(wire, pc.n)
        pc.send = comm._buf(f"wp_send{pc.slot}", H * (wb + 8), torch.uint8).view(H, wb + 8)
        count = sum(_C.wire_encode(pc.send[k, :wb], pc.rows[k], wire) for k in range(H))
        pc.send[:, wb:].copy_(torch.tensor([count], dtype=torch.int64).view(torch.uint8).expand(H, 8))
        pc.got = comm._buf(f"wp_got{pc.slot}", H * (wb + 8), torch.uint8).view(H, wb + 8)
        pc.work = comm._gloo_start("exchange of the wire rows with the other hosts",
                                   lambda: _exchange(comm.cross, comm.host, pc.send, pc.got,
                                                     TAG_ROWS + pc.slot))
        return pc

    def exchanged(pc):
        comm._gloo_wait(pc.work)
        wb = pc.wb
        count = int(pc.got[:, wb:].contiguous().view(torch.int64).sum())
        pc.res = comm._buf(f"wp_res{pc.slot}", wb + 8, torch.uint8)
        pc.mine = comm._buf(f"wp_mine{pc.slot}", pc.n, buf.dtype)
        count += _C.wire_reduce(pc.mine, pc.res[:wb], pc.got[:, :wb], code, wire, comm.world_size)
        pc.res[wb:].copy_(torch.tensor([count], dtype=torch.int64).view(torch.uint8))
        pc.gathered = comm._buf(f"wp_all{pc.slot}", H * (wb + 8), torch.uint8).view(H, wb + 8)
        pc.work = comm._gloo_start("gather of the folded wire rows from the other hosts",
                                   lambda: _exchange(comm.cross, comm.host, pc.res, pc.gathered,
                                                     TAG_GATHER + pc.slot))

    def gathered(pc):
        comm._gloo_wait(pc.work)
        wb = pc.wb
        for k in range(H):
            _C.wire_decode(pc.rows[k], pc.gathered[k, :wb], wire)
        if L > 1:
            piece = buf[pc.off:pc.off + L * H * pc.n]
            comm._shm("all-gather", comm.intra._native.all_gather, piece, pc.shard)
        return int(pc.gathered[:, wb:].contiguous().view(torch.int64).sum())

    for p in range(len(plan)):
        inflight.append(start(p))
        if len(inflight) >= 2 and inflight[-2].gathered is None:
            exchanged(inflight[-2])
        if len(inflight) == SLOTS:
            over += gathered(inflight.pop(0))
    for pc in inflight:
        if pc.gathered is None:
            exchanged(pc)
    for pc in inflight:
        over += gathered(pc)
    return over
