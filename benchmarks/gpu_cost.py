"""Cost report of the p2p transport's algorithms, counted on the emulated CUDA device (no GPU has
been lent to this project, so nothing here is a GPU timing).

    python benchmarks/gpu_cost.py --world 8 --sizes 4K,256K,4M,256M [--algo auto,ring,oneshot,twoshot,registered]
        [--recurring] [--coll all_reduce] [--bin cbuild/gpu_cost_emu] [--json out.json] [--check]

For each algorithm and size it runs one counted call on WORLD emulated GPUs (cbuild/gpu_cost_emu,
built by `cmake -S . -B cbuild && cmake --build cbuild --target gpu_cost_emu`) and prints, for the
busiest rank: bytes written to and read from other GPUs' memory, bytes written and read in its own
memory, waits on remote flags (polls that cross the link), and the critical path in dependent remote
round trips (tests/native/emu/cost.cpp says how it is counted), and what the kernels keep in
flight: blocks resident per rank (one per SM) and bytes of loads in flight per SM. Then a projected
time from an alpha-beta model with the H100 figures below, the loads capped by Little's law: a
model, not a measurement. --direct-loads-in-flight N models N loads per thread in the one-shot and
two-shot kernels instead of their own (1: as in the kernels of the first GPU run).

--check exits 1 unless issue 25's targets hold at world 8: 4 KiB all-reduce (auto) within 3 round
trips; 256 MiB: remote bytes per rank <= 1.05 x 2(N-1)/N x size and local writes no more than the
output (no staging copy of the payload); 4 MiB ring: >= 4 slices per channel. With --algo registered
(all_reduce of tensors in registered buffers, ringreduce.shared_empty on CUDA), at 256 MiB: remote
bytes <= 1.01 x the ideal, local bytes <= 2 x size / N (nothing staged), <= 4 round trips. At every
world above 1, every algorithm but copy: no flag load from host memory outside a long wait
(host_reads: a PCIe round trip on every call on a GPU). --recurring adds rows asked "recurring": the
second all_reduce on the same ordinary tensors (imported memory, as DDP's buckets are), which
--check holds, wherever it ran imported, to the registered algorithm's bounds: nothing staged (local
bytes <= 2 x size / N, plus 64 B per block and peer that the barriers carry), remote bytes <= 1.01 x
the ideal from 1 MiB, <= 2 barriers.
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The model's H100 SXM figures (public, approximate; see docs/counted.md, C8, for the sources):
RTT_US = 1.0            # one remote round trip over NVLink 4 through NVSwitch, ~1 us
LINK_GBS = 450.0        # NVLink 4: 900 GB/s per GPU in both directions, 450 GB/s each way
HBM_GBS = 3350.0        # HBM3 of the H100 SXM: 3.35 TB/s
LAUNCH_US = 3.0         # a kernel launch seen from the stream, ~2-5 us
LOAD_LAT_US = 0.8       # a 16-byte load under load, HBM or a peer's memory: ~0.6-1 us
# Little's law: a block (one per SM) with B bytes of loads in flight reads at most B per load
# latency, so `blocks` blocks read at most blocks x B / LOAD_LAT_US: the "load cap" column. On the
# first H100 run (one load in flight per thread) it explains the direct algorithms' times: one-shot
# 256 MiB at world 2 on 4 blocks, 17.0 ms measured; two-shot on 16 blocks, 4.8 ms.


def parse_size(s):
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(s[:-1]) * mult[s[-1]]) if s[-1] in mult else int(s)


def human(b):
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if b >= div:
            v = b / div
            return f"{v:.0f}{unit}" if v == int(v) else f"{v:.1f}{unit}"
    return str(b)


def run(binary, world, coll, algo, sizes, wire=None):
    # The emulated GPUs have the H100's 132 SMs: a call's blocks are capped by them (one rank per
    # GPU here), as on the GPU the model describes.
    env = dict(os.environ, EMU_CUDA_SMS=os.environ.get("EMU_CUDA_SMS", "132"))
    if wire:
        env["RINGREDUCE_WIRE"] = wire
    out = subprocess.run([binary, str(world), coll, algo, *map(str, sizes)], capture_output=True,
                         text=True, check=False, env=env)
    if out.returncode:
        sys.exit(f"gpu_cost_emu failed: {out.stderr.strip() or out.stdout.strip()}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def summarize(row, loads_in_flight=None):
    ranks = row["ranks"]
    busiest = lambda k: max(r[k] for r in ranks)  # noqa: E731
    rtt = max(r["half_round_trips"] for r in ranks) / 2
    remote = max(r["remote_write"] + r["remote_read"] for r in ranks)
    local = max(r["local_write"] + r["local_read"] for r in ranks)
    loads = max(r["local_read"] + r["remote_read"] for r in ranks)
    if not loads_in_flight or row["algo"] == "ring":
        loads_in_flight = row["loads_in_flight"]
    inflight = row["threads"] * loads_in_flight * 16  # per block (SM)
    cap_gbs = row["blocks"] * inflight / LOAD_LAT_US / 1e3
    t = LAUNCH_US + rtt * RTT_US + max(remote / (LINK_GBS * 1e3), local / (HBM_GBS * 1e3),
                                       loads / (cap_gbs * 1e3))
    n, size = row["world"], row["bytes"]
    factor = 2 * (n - 1) / n if row["coll"] == "all_reduce" else (n - 1) / n
    return {**{k: row[k] for k in ("world", "coll", "wire", "algo", "bytes", "blocks", "slice_bytes",
                                   "steps", "device_bytes")},
            # cross-rank waits on the critical path of one call: the most waits one thread of a
            # block made (a barrier is one per thread and peer; the ring's thread 0 waits per step)
            "barriers": max(r["thread_waits"] for r in ranks),
            # flag loads from host memory (across PCIe on a GPU) outside long waits, all blocks
            "host_reads": busiest("host_reads"),
            "remote_write": busiest("remote_write"), "remote_read": busiest("remote_read"),
            "local_write": busiest("local_write"), "local_read": busiest("local_read"),
            "remote_waits": sum(r["remote_waits"] for r in ranks),
            "critical_rtt": rtt, "remote_vs_ideal": remote / (factor * size) if size and factor else 0.0,
            "inflight_per_sm": inflight, "load_cap_gbs": cap_gbs,
            "model_us": t, "busbw_gbs": factor * size / t / 1e3 if size and factor else 0.0}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--sizes", default="4K,256K,4M,256M")
    p.add_argument("--algo", default="auto,ring,oneshot,twoshot")
    p.add_argument("--coll", default="all_reduce",
                   choices=["all_reduce", "reduce_scatter", "all_gather"])
    p.add_argument("--bin", default=os.path.join(ROOT, "cbuild", "gpu_cost_emu"))
    p.add_argument("--json")
    p.add_argument("--check", action="store_true")
    p.add_argument("--recurring", action="store_true",
                   help="also the second all_reduce on the same ordinary tensors (imported memory)")
    p.add_argument("--wire", help="also the narrow wire: bf16,fp16,fp8,fp8e5m2 (rows asked ALGO/WIRE; "
                   "rem/ideal is against float32's bytes)")
    p.add_argument("--direct-loads-in-flight", type=int,
                   help="model N loads per thread in the direct kernels (default: the kernels' own)")
    a = p.parse_args()
    if not os.path.exists(a.bin):
        sys.exit(f"{a.bin} not found: cmake -S . -B cbuild && cmake --build cbuild --target gpu_cost_emu")
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    rows = []
    algos = a.algo.split(",") + (["recurring"] if a.recurring and "recurring" not in a.algo else [])
    for wire in [None] + (a.wire.split(",") if a.wire else []):
        for algo in algos:
            if algo == "recurring" and (wire or a.coll != "all_reduce"):
                continue
            rows += [summarize(r, a.direct_loads_in_flight) | {"asked": algo + ("/" + wire if wire else "")}
                     for r in run(a.bin, a.world, a.coll, algo, sizes, wire)]
    print(f"{a.coll}, float32, world {a.world}, p2p transport on the emulated device (counts per "
          f"call; busiest rank). Model: {RTT_US:g} us/round trip, {LINK_GBS:g} GB/s link, "
          f"{HBM_GBS:g} GB/s HBM, {LAUNCH_US:g} us launch, {LOAD_LAT_US:g} us per load "
          f"(blk: blocks resident per rank, one per SM; inflight/SM: bytes of loads in flight).")
    head = ("asked", "ran", "size", "blk", "slice", "steps", "barriers", "host R", "dev mem", "remote W",
            "remote R", "local W", "crit RTT", "rem/ideal", "inflt/SM", "load cap", "model us", "busbw")
    print(" ".join(f"{h:>9}" for h in head))
    for r in rows:
        cells = (r["asked"], r["algo"], human(r["bytes"]), r["blocks"], human(r["slice_bytes"]),
                 r["steps"], r["barriers"], r["host_reads"], human(r["device_bytes"]), human(r["remote_write"]),
                 human(r["remote_read"]), human(r["local_write"]), f"{r['critical_rtt']:g}",
                 f"{r['remote_vs_ideal']:.3f}", human(r["inflight_per_sm"]),
                 f"{r['load_cap_gbs']:.0f}", f"{r['model_us']:.1f}", f"{r['busbw_gbs']:.0f}")
        print(" ".join(f"{str(c):>9}" for c in cells))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    if a.check:
        sys.exit(0 if check(rows, a.world) else 1)


SYM = ("oneshot", "twoshot", "registered", "imported")  # the symmetric workspace's algorithms


def check(rows, world):
    ok = True
    plain = {(r["coll"], r["asked"], r["bytes"]): r for r in rows if r["wire"] == "none"}

    def expect(cond, what):
        nonlocal ok
        print(("ok   " if cond else "FAIL ") + what)
        ok &= cond

    for r in rows:
        if r["world"] != world:
            continue
        size, algo = r["bytes"], r["algo"]
        # issue 50: device memory per rank, barriers per call and per piece of the workspace
        if world == 1:
            expect(r["device_bytes"] == 0, f"world 1: {r['device_bytes']} bytes of device memory, want 0")
        if world == 2 and r["asked"].split("/")[0] in ("auto", "registered"):
            # by default: a forced ring (its FIFO) or copy (its inboxes) may hold more
            expect(r["device_bytes"] <= 64 << 20,
                   f"world 2: {human(r['device_bytes'])}B of device memory per rank <= 64 MiB")
        if world > 1 and algo != "copy":
            # the abort word a host writes is mirrored into device memory: no kernel reads the
            # host's across PCIe on its way through a call (a wait that has polled long may)
            expect(r["host_reads"] == 0, f"{human(size)} {r['coll']} {algo}: {r['host_reads']} reads of "
                   f"host memory per call outside long waits, want 0")
        if world > 1 and algo in SYM:
            expect(r["barriers"] <= 3 * r["steps"],
                   f"{human(size)} {r['coll']} {algo}: {r['barriers']} barriers <= 3 per piece "
                   f"({r['steps']} pieces)")
            if size <= 16 << 20:
                expect(r["barriers"] <= 3, f"{human(size)} {algo}: {r['barriers']} barriers <= 3")
            if size == 256 << 20:
                expect(r["barriers"] <= 48 and r["slice_bytes"] * world >= 16 << 20 or
                       r["coll"] == "all_reduce" and r["slice_bytes"] >= 16 << 20 or algo == "registered",
                       f"256 MiB {algo}: {r['barriers']} barriers <= 48, pieces of "
                       f"{human(r['slice_bytes'])}B")
        if r["wire"] != "none":
            # issue 52: the narrow wire moves the wire's bytes between ranks (fp8: plus a float scale
            # per 128 elements), with float32's barriers, from 1 MiB (below it headers count)
            f32 = plain.get((r["coll"], r["asked"].split("/")[0], size))
            if world > 1 and size >= 1 << 20 and f32:
                limit = {"bfloat16": 0.5, "float16": 0.5}.get(r["wire"], 0.25 + 1 / 128) * 1.02
                ratio = (r["remote_read"] + r["remote_write"]) / (f32["remote_read"] + f32["remote_write"])
                expect(ratio <= limit, f"{human(size)} {r['coll']} {algo} {r['wire']} wire: remote bytes "
                       f"{ratio:.3f} x float32's <= {limit:.3f}")
                expect(r["barriers"] <= f32["barriers"], f"{human(size)} {r['coll']} {algo} {r['wire']} "
                       f"wire: {r['barriers']} barriers <= float32's {f32['barriers']}")
            continue
        if r["coll"] != "all_reduce":
            continue
        if algo == "twoshot" and size >= 256 << 10:
            # every rank reduces its share: pieces of equal size, not the workspace's and a remainder
            expect(r["remote_vs_ideal"] <= 1.05,
                   f"{human(size)} twoshot: remote bytes {r['remote_vs_ideal']:.3f} x 2(N-1)/N x size <= 1.05")
        if r["asked"] == "auto" and size == 4 << 10:
            expect(r["critical_rtt"] <= 3, f"4 KiB auto ({algo}): {r['critical_rtt']:g} <= 3 round trips")
        if size == 256 << 20 and r["asked"] in ("auto", "ring", "twoshot"):
            expect(r["remote_vs_ideal"] <= 1.05,
                   f"256 MiB {algo}: remote bytes {r['remote_vs_ideal']:.3f} x 2(N-1)/N x size <= 1.05")
            # the ring writes the output; the workspace also its copy of the input (once)
            limit = 2 * size if algo in SYM else size
            expect(r["local_write"] <= limit,
                   f"256 MiB {algo}: local writes {r['local_write']} <= {limit} (nothing staged twice)")
        if size == 256 << 20 and r["asked"] == "registered":
            # every rank's chunk read from every copy and written into every copy, once
            expect(algo == "registered", f"256 MiB in registered buffers ran {algo}")
            expect(r["remote_vs_ideal"] <= 1.01,
                   f"256 MiB registered: remote bytes {r['remote_vs_ideal']:.3f} x 2(N-1)/N x size <= 1.01")
            expect(r["local_write"] + r["local_read"] <= 2.01 * size / world,
                   f"256 MiB registered: local bytes {r['local_write'] + r['local_read']} <= 2 x size / N "
                   f"(nothing staged)")
            expect(r["barriers"] <= 2, f"256 MiB registered: {r['barriers']} <= 2 barriers")
            expect(r["critical_rtt"] <= 4, f"256 MiB registered: {r['critical_rtt']:g} <= 4 round trips "
                   f"(two barriers)")
        if algo == "ll":
            # issue 71: the LL one-shot waits for no barrier (its words say they arrived)
            expect(r["barriers"] == 0, f"{human(size)} ll: {r['barriers']} barriers, want 0")
        if r["asked"] == "recurring" and algo == "imported":
            # the second call on the same ordinary tensors: in place, as a registered buffer
            tag = f"{human(size)} recurring (imported)"
            # what the barriers carry besides: a header and a tag of 16 B each per block and peer, read
            limit = 2 * size / world + r["blocks"] * (world - 1) * 64
            expect(r["local_write"] + r["local_read"] <= limit,
                   f"{tag}: local bytes {r['local_write'] + r['local_read']} <= 2 x size / N + barriers' "
                   f"{limit - 2 * size / world:.0f} (nothing staged)")
            expect(r["remote_vs_ideal"] <= 1.01 or size < 1 << 20,
                   f"{tag}: remote bytes {r['remote_vs_ideal']:.3f} x 2(N-1)/N x size <= 1.01")
            expect(r["barriers"] <= 2, f"{tag}: {r['barriers']} <= 2 barriers")
        if size == 4 << 20 and algo == "ring":
            expect(r["steps"] >= 4, f"4 MiB ring: {r['steps']} >= 4 slices per channel")
    return ok


if __name__ == "__main__":
    main()
