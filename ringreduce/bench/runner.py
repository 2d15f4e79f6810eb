"""The sweep, run by every rank: buffers, alternation of backends, timing, checking, gathering."""
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from . import backends as bk
from . import report
from .cli import BATCH_CALLS_MAX, agg_iters, calibrated, sizes
from .data import Reference, sentinel

MEMBW_BYTES = 256 << 20  # large enough to leave every cache far behind (L3 is tens of MiB)
MEMBW_REPEATS = 5
EXTRA_WARMUPS = 6       # iterations run again when a batch came out short of its target
CORRUPT_DELTA = 100      # added by --corrupt-for-test; far outside any tolerance


def bus_factor(collective, world):
    if world <= 1:
        return 0.0
    return 2.0 * (world - 1) / world if collective == "all_reduce" else (world - 1) / world


def element_count(collective, size, elsize, world):
    count = max(1, size // elsize)
    if collective != "all_reduce":
        count = max(world, count // world * world)
    return count


class Buffers:
    """One collective and size on this rank: reference data, an input and an output buffer."""

    def __init__(self, collective, count, ctx):
        a = ctx.args
        self.collective, self.count, self.rank = collective, count, ctx.rank
        self.chunk = count // ctx.world
        self.ref = Reference(collective, count, ctx.rank, ctx.world, a.dtype, a.op, ctx.device,
                             check=bool(a.check))
        self.sentinel = sentinel(a.dtype)
        out_numel = self.chunk if collective == "reduce_scatter" else count
        self.inp = torch.empty_like(self.ref.input)
        self.out = torch.empty(out_numel, dtype=a.dtype, device=ctx.device)

    def prepare(self, backend, inplace):
        """Resets the buffers (untimed); returns (timed call, tensor holding this rank's result)."""
        c, r = self.chunk, self.rank
        if self.collective == "all_reduce":
            own = getattr(backend, "own_tensor", None)  # ringreduce/pool: its shared buffer
            t = own(self.out) if own else self.out
            # torch/symm-oneshot-sym: the result lands in another tensor
            res = backend.result_tensor(t) if hasattr(backend, "result_tensor") else t
            if res is not t:
                res.fill_(self.sentinel)
            if inplace:
                t.copy_(self.ref.input)
                return (lambda: backend.all_reduce(t)), res
            self.inp.copy_(self.ref.input)
            t.fill_(self.sentinel)

            def out_of_place():  # all_reduce is in place only: the copy is part of the call
                t.copy_(self.inp)
                backend.all_reduce(t)
            return out_of_place, res
        if self.collective == "reduce_scatter":
            self.inp.copy_(self.ref.input)
            if inplace:
                view = self.inp[r * c:(r + 1) * c]
                return (lambda: backend.reduce_scatter(view, self.inp)), view
            self.out.fill_(self.sentinel)
            return (lambda: backend.reduce_scatter(self.out, self.inp)), self.out
        self.out.fill_(self.sentinel)
        if inplace:
            view = self.out[r * c:(r + 1) * c]
            view.copy_(self.ref.input)
            return (lambda: backend.all_gather(self.out, view)), self.out
        self.inp.copy_(self.ref.input)
        return (lambda: backend.all_gather(self.out, self.inp)), self.out


class Context:
    def __init__(self, args, rank, world, device, ctrl):
        self.args, self.rank, self.world, self.device, self.ctrl = args, rank, world, device, ctrl
        self.cuda = device.type == "cuda"
        bk.HOSTS = args.hosts
        bk.REAL_HOSTS = bool(getattr(args, "lab", None))
        bk.DEVICE = device.type
        self.notes = []
        self.tty = sys.stderr.isatty()
        self.progress_shown = False  # a progress line stands on the terminal, unterminated
        for line in getattr(args, "skipped", ()):  # names the command line left out here
            self.note(line)
        self.backends = [bk.make(label, args.op, rank, world) for label in args.backends]
        for b in self.backends:  # the peers' versions, with the numbers they produce
            if getattr(b, "library", None):
                self.note(f"{b.label}: {b.library}")

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def barrier(self):
        self.sync()
        dist.barrier(group=self.ctrl)

    def note(self, text):
        self.notes.append(text)
        if self.rank == 0:
            self.clear_progress()
            print(f"# note: {text}", flush=True)

    def progress(self, text, final=False):
        if self.rank != 0:
            return
        if self.tty:  # one line, rewritten in place
            sys.stderr.write("\r\033[K" + text + ("\n" if final else ""))
            self.progress_shown = not final
        else:  # a log: one line per step
            sys.stderr.write(text + "\n")
        sys.stderr.flush()

    def clear_progress(self):
        """Erases the progress line before a line of the table goes to the same terminal (stdout
        and stderr share it: a row printed after it would start where it ends)."""
        if self.progress_shown:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
            self.progress_shown = False


def peak_membw(ctx):
    """GB/s of a large copy on rank 0 (read + write counted); None on the other ranks."""
    result = None
    if ctx.rank == 0:
        n = MEMBW_BYTES // 4
        src = torch.ones(n, dtype=torch.float32, device=ctx.device)
        dst = torch.empty_like(src)
        threads = torch.get_num_threads()
        if not ctx.cuda:
            torch.set_num_threads(len(os.sched_getaffinity(0)))  # the whole host, as a copy can
        times = []
        for _ in range(MEMBW_REPEATS + 1):
            if ctx.cuda:
                start = torch.cuda.Event(enable_timing=True)
                stop = torch.cuda.Event(enable_timing=True)
                start.record()
                dst.copy_(src)
                stop.record()
                stop.synchronize()
                times.append(start.elapsed_time(stop) / 1e3)
            else:
                t0 = time.perf_counter()
                dst.copy_(src)
                times.append(time.perf_counter() - t0)
        torch.set_num_threads(threads)
        result = 2 * MEMBW_BYTES / statistics.median(times[1:]) / 1e9
        del src, dst
    ctx.barrier()
    return result


def probe_backends(ctx):
    """Drops ringreduce GPU transports and torch's SymmetricMemory backends that fail a tiny call
    on any rank (e.g. not built yet, or a rendezvous refused)."""
    keep = []
    for b in ctx.backends:
        error = None
        if isinstance(b, (bk.RingReduce, bk.TorchSymm)) and ctx.cuda:
            try:
                t = torch.ones(ctx.world, device=ctx.device)
                if isinstance(b, bk.TorchSymm):
                    t = b.own_tensor(t)
                    t.fill_(1)
                b.all_reduce(t)
                ctx.sync()
            except Exception as e:  # the transport's own error, reported as a note
                error = str(e).splitlines()[0] if str(e) else type(e).__name__
            if isinstance(b, bk.TorchSymm):
                b.release()
        ok = torch.tensor([0 if error else 1])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=ctx.ctrl)
        if ok.item():
            keep.append(b)
        else:
            ctx.note(f"{b.label} skipped: {error or 'failed on another rank'}")
    ctx.backends = keep


def time_case(ctx, buffers, inplace, backends, agg):
    """Warmup and timed iterations, backends rotated every iteration; per-backend statistics.

    An iteration times a batch of calls back to back after a barrier, per call. With -m the batch
    is agg calls for every backend; without, each backend's batch is calibrated (every rank agrees
    on the slowest rank's time) to last at least --batch_ms: after every iteration, warm-up or
    timed, a batch shorter than half of that grows its count, and the iteration does not count and
    runs again (at most EXTRA_WARMUPS times), so a stalled warm-up cannot leave a short count for
    the timed batches. With batches of one call the timed result is checked; with more, repeated
    in-place calls change their own input, so an untimed call from fresh buffers just before is
    checked instead."""
    a = ctx.args
    k = len(backends)
    calls = [agg] * k
    times = torch.zeros(k, a.iters, dtype=torch.float64)
    wrong = torch.zeros(k, a.iters, dtype=torch.int64)
    err = torch.zeros(k, dtype=torch.float64)  # --wire: the largest |result - exact|
    warmup, it = a.warmup_iters, 0
    while it < warmup + a.iters:
        timed = it - warmup
        batch = torch.zeros(k, dtype=torch.float64)
        for j in [(it + s) % k for s in range(k)]:  # rotate the order so no backend is always first
            b = backends[j]
            if calls[j] > 1 and timed >= 0:
                call, result = buffers.prepare(b, inplace)
                call()
                ctx.sync()
                check(ctx, buffers, b, result, wrong, err, j, timed)
            call, result = buffers.prepare(b, inplace)
            ctx.barrier()
            t0 = time.perf_counter()
            if a.stall_for_test and it < a.warmup_iters and ctx.rank == 0:
                time.sleep(a.stall_for_test * 1e-3)
            for _ in range(calls[j]):
                call()
            ctx.sync()
            batch[j] = time.perf_counter() - t0
            if timed >= 0:
                times[j, timed] = batch[j] / calls[j]
                if calls[j] == 1:
                    check(ctx, buffers, b, result, wrong, err, j, timed)
        if a.agg_iters is None:
            dist.all_reduce(batch, op=dist.ReduceOp.MAX, group=ctx.ctrl)
            # Only ever longer: one batch slowed by a descheduled rank must not shorten it.
            short = any(calls[j] < BATCH_CALLS_MAX and batch[j].item() < a.batch_ms * 0.5e-3
                        for j in range(k))
            calls = [max(calls[j], calibrated(calls[j], batch[j].item(), a.batch_ms))
                     for j in range(k)]
            if short and timed >= -1 and warmup < a.warmup_iters + EXTRA_WARMUPS:
                warmup += 1  # this iteration (or the last warm-up) runs again with the new counts
        it += 1
    # The call ends when the slowest rank is done; wrong elements add up over ranks.
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=ctx.ctrl)
    dist.all_reduce(wrong, op=dist.ReduceOp.SUM, group=ctx.ctrl)
    dist.all_reduce(err, op=dist.ReduceOp.MAX, group=ctx.ctrl)
    out = []
    for j in range(k):
        t = times[j].tolist()
        q1, _, q3 = statistics.quantiles(t, n=4) if len(t) > 1 else t * 3
        out.append({"time_us": statistics.median(t) * 1e6, "time_us_min": min(t) * 1e6,
                    "time_us_max": max(t) * 1e6, "time_us_q1": q1 * 1e6, "time_us_q3": q3 * 1e6,
                    "agg_iters": calls[j],
                    "wrong": int(wrong[j].max()) if a.check else None,
                    "max_err": float(err[j]) if a.wire and a.check else None})
    return out


def check(ctx, buffers, backend, result, wrong, err, j, timed):
    a = ctx.args
    if a.corrupt_for_test == backend.label and timed == 0 and ctx.rank == 0:
        result[:1].add_(CORRUPT_DELTA)
    if a.check:  # a run-again iteration keeps what the first try found
        tol = backend.tolerance(1.0) if hasattr(backend, "tolerance") else None  # values <= 1
        wrong[j, timed] = max(int(wrong[j, timed]), buffers.ref.wrong(result, tol))
        if a.wire:
            err[j] = max(float(err[j]), buffers.ref.max_error(result))


def sweep(ctx):
    """Every collective x size x backend on this rank; rank 0 prints and returns the rows."""
    a = ctx.args
    rows = []
    elsize = torch.empty(0, dtype=a.dtype).element_size()
    for collective in a.collectives:
        runnable = []
        for b in ctx.backends:
            reason = b.supports(collective, a.dtype)
            if reason:
                ctx.note(f"{b.label} skips {collective} {a.type_name} {a.op}: {reason}")
            else:
                runnable.append(b)
        if ctx.rank == 0:
            ctx.clear_progress()
            report.print_header(collective, ctx.world, ctx.device)
        for size in sizes(a):
            count = element_count(collective, size, elsize, ctx.world)
            buffers = Buffers(collective, count, ctx)
            stats = {}
            agg = agg_iters(a, count * elsize)
            ctx.progress(f"[bench] N={ctx.world} {collective} {report.human(count * elsize)}")
            for inplace in (False, True):
                stats[inplace] = time_case(ctx, buffers, inplace, runnable, agg)
            for j, b in enumerate(runnable):
                for inplace in (False, True):
                    s = stats[inplace][j]
                    algbw = count * elsize / (s["time_us"] * 1e-6) / 1e9
                    rows.append(dict(collective=collective, backend=b.label, nranks=ctx.world,
                                     size_bytes=count * elsize, count=count, dtype=a.type_name,
                                     op="none" if collective == "all_gather" else a.op,
                                     inplace=inplace, time_us=s["time_us"], algbw_GBps=algbw,
                                     busbw_GBps=algbw * bus_factor(collective, ctx.world),
                                     wrong=s["wrong"], max_err=s["max_err"], iters=a.iters,
                                     agg_iters=s["agg_iters"],
                                     time_us_min=s["time_us_min"], time_us_max=s["time_us_max"],
                                     time_us_q1=s["time_us_q1"], time_us_q3=s["time_us_q3"]))
                if ctx.rank == 0:
                    ctx.clear_progress()
                    report.print_row(rows[-2], rows[-1])
            del buffers
            for b in runnable:
                if hasattr(b, "release"):
                    b.release()
    ctx.progress(f"[bench] N={ctx.world} done", final=True)
    return rows
