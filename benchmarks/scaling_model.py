"""Alpha-beta model of all-reduce across hosts: flat ring vs two-level ring vs NCCL-style tree.

Every message over a link costs alpha + bytes / bandwidth, with one (alpha, bandwidth) pair for
links inside a host and one for links between hosts. P = H hosts x L ranks per host, S bytes.
Each algorithm's time is a + b*S; the formulas (docs/scaling.md explains them):

  flat ring   2(P-1) steps of S/P; with H > 1 every step waits for the slowest hop, an inter-host
              one: 2(P-1) * (alpha_inter + S / (P * bw)), bw = the bandwidth one ring gets across
              hosts (one NIC; k parallel rings on k NICs get k NICs, capped by the intra link).
  two-level   intra reduce-scatter over L ((L-1) steps of S/L), all-reduce of S/L among the H
              ranks with the same local rank (ring: 2(H-1) steps of S/(L*H)), intra all-gather.
              The L inter-host rings run at once and share the host's NICs.
  tree        chain inside the host, double binary tree across hosts, pipelined: latency
              2*((L-1)*alpha_intra + ceil(log2 H)*alpha_inter), bandwidth term 2*S/bw.

    python benchmarks/scaling_model.py                      # gpu profile: 8 x H100 per host
    python benchmarks/scaling_model.py --profile cpu        # this project's measured CPU figures
    python benchmarks/scaling_model.py --plot docs/scaling.png
"""
import argparse
import math
import sys
from dataclasses import dataclass, replace

# Where each figure comes from: docs/scaling.md, "Parameters".
PROFILES = {
    # DGX H100: NVLink 4 via NVSwitch, 450 GB/s per GPU per direction; 8 x 400 Gb/s
    # ConnectX-7 InfiniBand per host, one per GPU (50 GB/s each). Alphas are assumptions.
    "gpu": dict(ranks_per_host=8, nics_per_host=8, alpha_intra_us=2.0, bw_intra_GBps=450.0,
                alpha_inter_us=7.0, bw_inter_GBps=50.0),
    # This machine (docs/benchmark-log.md, B5): shared-memory ring, 2 ranks on 2 cores, ~5 GB/s busbw at
    # 64 MiB, ~3 us per 4 KiB call (2 steps). Between hosts: one 10 GbE NIC over TCP (assumed).
    "cpu": dict(ranks_per_host=2, nics_per_host=1, alpha_intra_us=1.5, bw_intra_GBps=5.0,
                alpha_inter_us=25.0, bw_inter_GBps=1.25),
}
ALGOS = ("flat ring", "two-level", "tree")
DEFAULT_RANKS = [2 ** i for i in range(1, 11)]  # 2 .. 1024
DEFAULT_SIZES = ["4K", "64K", "1M", "16M", "256M", "1G"]


@dataclass(frozen=True)
class Model:
    ranks_per_host: int
    nics_per_host: int
    alpha_intra_us: float
    bw_intra_GBps: float    # per rank, one direction
    alpha_inter_us: float
    bw_inter_GBps: float    # per NIC, one direction
    channels: int = 1       # parallel rings / trees the flat ring and the tree spread over NICs
    pipelined: bool = False  # two-level: overlap the intra and inter phases (max, not sum)


def make_model(profile="gpu", **overrides):
    return replace(Model(**PROFILES[profile]), **{k: v for k, v in overrides.items() if v is not None})


def layout(p, m):
    """(hosts, ranks per host) for p ranks; fewer than a host's worth of ranks sit on one host."""
    if p <= m.ranks_per_host:
        return 1, p
    if p % m.ranks_per_host:
        raise ValueError(f"{p} ranks do not fill hosts of {m.ranks_per_host}")
    return p // m.ranks_per_host, m.ranks_per_host


def costs(p, m):
    """{algorithm: (a seconds, b seconds per byte)}: time for S bytes is a + b*S."""
    h, l = layout(p, m)
    a_in, a_out = m.alpha_intra_us * 1e-6, m.alpha_inter_us * 1e-6
    bw_in, bw_nic = m.bw_intra_GBps * 1e9, m.bw_inter_GBps * 1e9
    # Bandwidth across hosts for the flat ring and the tree: each ring/tree leaves the host
    # through one NIC, so k of them use k NICs, and every one also crosses the intra links.
    bw_cross = min(min(m.channels, m.nics_per_host) * bw_nic, bw_in)
    steps = 2 * (p - 1)
    if h == 1:
        flat = (steps * a_in, steps / (p * bw_in))
    else:
        flat = (steps * a_out, steps / (p * bw_cross))

    a2 = 2 * (l - 1) * a_in
    b_intra = 2 * (l - 1) / (l * bw_in)
    b_inter = 0.0
    if h > 1:
        per_ring = bw_nic * m.nics_per_host / l  # L rings share the host's NICs
        a2 += 2 * (h - 1) * a_out
        b_inter = 2 * (h - 1) / (l * h * per_ring)
    two = (a2, max(b_intra, b_inter) if m.pipelined else b_intra + b_inter)

    depth = math.ceil(math.log2(h)) if h > 1 else 0
    # Each rank sends and receives S going up (reduce) and S coming down (broadcast); the two
    # trees of the double binary tree each carry S/2, so every rank's links stay busy: 2S/bw.
    tree = (2 * ((l - 1) * a_in + depth * a_out), 2 / (bw_in if h == 1 else bw_cross))
    return {"flat ring": flat, "two-level": two, "tree": tree}


def leaders_cost(p, m):
    """(a, b) of the leaders plan (ringreduce/_hier/): all-reduce inside each host (ring over L), a ring
    all-reduce of the whole tensor among the H hosts' first ranks (one NIC each), broadcast from
    the first rank inside the host (one intra message of S)."""
    h, l = layout(p, m)
    a_in, a_out = m.alpha_intra_us * 1e-6, m.alpha_inter_us * 1e-6
    bw_in, bw_nic = m.bw_intra_GBps * 1e9, m.bw_inter_GBps * 1e9
    a = 2 * (l - 1) * a_in + 2 * (h - 1) * a_out + (a_in if l > 1 else 0.0)
    b = 2 * (l - 1) / (l * bw_in) + 2 * (h - 1) / (h * bw_nic) + (1 / bw_in if l > 1 else 0.0)
    return a, b


def compare_lab(path, m):
    """Prints the model beside a `python -m ringreduce.bench --link` run (its --json): for every
    size, the model's two-level (phases in sequence, and pipelined) and leaders times against the
    measured medians of torch/gloo and ringreduce/hier (in place)."""
    import json
    with open(path) as f:
        doc = json.load(f)
    print(f"# {doc['args'].get('lab') or 'no lab recorded'}")
    print(f"# model: inter {m.alpha_inter_us:g} us + {m.bw_inter_GBps:g} GB/s per NIC, intra "
          f"{m.alpha_intra_us:g} us + {m.bw_intra_GBps:g} GB/s, {m.ranks_per_host} ranks/host")
    print(f"{'ranks':>5} {'size':>9} | {'two-level':>10} {'pipelined':>10} {'leaders':>10} | "
          f"{'measured: gloo':>14} {'rr/hier':>10}  (ms)")
    for run in doc["runs"]:
        p = run["nranks"]
        seq, pipe = costs(p, m)["two-level"], costs(p, replace(m, pipelined=True))["two-level"]
        lead = leaders_cost(p, m)
        rows = {(r["backend"], r["size_bytes"]): r for r in run["rows"]
                if r["collective"] == "all_reduce" and r["inplace"]}
        for size in sorted({b for _, b in rows}):
            got = [rows.get((k, size)) for k in ("torch/gloo", "ringreduce/hier")]
            cells = " ".join(f"{(a + b * size) * 1e3:>10.1f}" for a, b in (seq, pipe, lead))
            meas = [f"{g['time_us'] / 1e3:.1f}" if g else "-" for g in got]
            print(f"{p:>5} {fmt_size(size):>9} | {cells} | {meas[0]:>14} {meas[1]:>10}")
    return 0


def times(p, size, m):
    return {k: a + b * size for k, (a, b) in costs(p, m).items()}


def busbw(p, size, t):
    """GB/s, nccl-tests' definition: bytes * 2(P-1)/P / time."""
    return size * 2 * (p - 1) / p / t / 1e9


def envelope(p, m):
    """[(from_bytes, algorithm)]: which algorithm is fastest from each size on (lines in S)."""
    lines = costs(p, m)
    cur = min(ALGOS, key=lambda k: lines[k])
    s, out = 0.0, [(0.0, cur)]
    while True:
        a0, b0 = lines[cur]
        nxt = [((a - a0) / (b0 - b), k) for k, (a, b) in lines.items()
               if b < b0 and (a - a0) / (b0 - b) >= s]
        if not nxt:
            return out
        s, cur = min(nxt)
        out.append((s, cur))


def parse_size(s):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    s = s.strip().upper().rstrip("B").rstrip("I")
    return int(float(s[:-1]) * units[s[-1]]) if s[-1] in units else int(s)


def fmt_size(b):
    for unit, div in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= div:
            return f"{b / div:.3g} {unit}"
    return f"{b:.0f} B"


def ranks_that_fit(ranks, m):
    ok = [p for p in ranks if p >= 2 and (p <= m.ranks_per_host or p % m.ranks_per_host == 0)]
    skipped = sorted(set(ranks) - set(ok))
    return ok, skipped


def print_tables(ranks, sizes, m, profile):
    print(f"# profile {profile}: {m.ranks_per_host} ranks/host, {m.nics_per_host} NICs/host, "
          f"intra {m.alpha_intra_us:g} us + {m.bw_intra_GBps:g} GB/s, "
          f"inter {m.alpha_inter_us:g} us + {m.bw_inter_GBps:g} GB/s per NIC, "
          f"channels {m.channels}, two-level {'pipelined' if m.pipelined else 'phases in sequence'}")
    print("# time in us; busbw = S * 2(P-1)/P / time, GB/s; * = fastest")
    for size in sizes:
        print(f"\n## {fmt_size(size)}")
        print(f"{'ranks':>6} {'hosts':>5} | {'flat ring':>11} {'two-level':>11} {'tree':>11} | "
              f"{'fastest':<21} | {'busbw flat':>10} {'two-level':>10} {'tree':>10}")
        for p in ranks:
            h, _ = layout(p, m)
            t = times(p, size, m)
            low = min(t.values())
            best = [k for k in ALGOS if t[k] <= low * (1 + 1e-9)]  # ties: one host, both rings
            cells = " ".join(f"{t[k] * 1e6:>10,.1f}{'*' if k in best else ' '}" for k in ALGOS)
            bws = " ".join(f"{busbw(p, size, t[k]):>10.2f}" for k in ALGOS)
            print(f"{p:>6} {h:>5} | {cells} | {' = '.join(best):<21} | {bws}")
    print("\n## fastest algorithm by size (from the model's lines; exact crossovers)")
    for p in ranks:
        env = envelope(p, m)
        one_host = layout(p, m)[0] == 1  # both rings are the same algorithm there
        name = lambda k: "flat ring = two-level" if one_host and k == "flat ring" else k
        parts = [name(env[0][1])] + [f"{fmt_size(s)}: {name(k)}" for s, k in env[1:]]
        print(f"{p:>6} ranks: " + " | ".join(parts))


def plot(path, ranks, m, profile):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib: pip install matplotlib", file=sys.stderr)
        return 2
    sizes = [64 << 10, 16 << 20, 1 << 30]
    # Second row: the same machine with NCCL's habits (one ring/tree per NIC) and the two-level
    # phases overlapped, the fairer comparison for what we would build.
    rows = [(m, f"as given: channels {m.channels}, two-level "
                f"{'pipelined' if m.pipelined else 'in sequence'}"),
            (replace(m, channels=m.nics_per_host, pipelined=True),
             f"channels {m.nics_per_host} (one ring/tree per NIC), two-level pipelined")]
    fig, axes = plt.subplots(len(rows), len(sizes), figsize=(5 * len(sizes), 4 * len(rows)),
                             sharex=True, squeeze=False)
    for row, (mm, label) in zip(axes, rows):
        for ax, size in zip(row, sizes):
            for k, style in zip(ALGOS, ("o-", "s-", "^-")):
                ax.plot(ranks, [times(p, size, mm)[k] * 1e6 for p in ranks], style, label=k, ms=4)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{fmt_size(size)}; {label}", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
        row[0].set_ylabel("all-reduce time (us), model")
    for ax in axes[-1]:
        ax.set_xlabel(f"ranks ({m.ranks_per_host} per host)")
    axes[0][0].legend()
    fig.suptitle(f"alpha-beta model, profile {profile}: intra {m.alpha_intra_us:g} us, "
                 f"{m.bw_intra_GBps:g} GB/s; inter {m.alpha_inter_us:g} us, "
                 f"{m.bw_inter_GBps:g} GB/s x {m.nics_per_host} NICs/host")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", choices=sorted(PROFILES), default="gpu")
    ap.add_argument("--ranks-per-host", type=int)
    ap.add_argument("--nics-per-host", type=int, help="default: one per GPU (gpu), 1 (cpu)")
    ap.add_argument("--alpha-intra-us", type=float)
    ap.add_argument("--bw-intra-GBps", type=float, help="per rank, one direction")
    ap.add_argument("--alpha-inter-us", type=float)
    ap.add_argument("--bw-inter-GBps", type=float, help="per NIC, one direction")
    ap.add_argument("--channels", type=int, default=1,
                    help="parallel rings/trees for the flat ring and the tree, one NIC each "
                         "(NCCL runs one or more per NIC; default 1: a single ring/tree)")
    ap.add_argument("--pipelined", action="store_true",
                    help="two-level: overlap intra and inter phases (bandwidth terms max, not sum)")
    ap.add_argument("--ranks", "--gpus", default=",".join(map(str, DEFAULT_RANKS)),
                    help="comma-separated rank counts")
    ap.add_argument("--sizes", default=",".join(DEFAULT_SIZES), help="e.g. 4K,1M,1G")
    ap.add_argument("--plot", metavar="PATH", help="write a figure (needs matplotlib)")
    ap.add_argument("--compare", metavar="RUN.json",
                    help="the model beside a `python -m ringreduce.bench --link ... --json` run "
                         "on emulated hosts (docs/scaling.md, 'Measured on emulated hosts')")
    a = ap.parse_args(argv)

    m = make_model(a.profile, ranks_per_host=a.ranks_per_host, nics_per_host=a.nics_per_host,
                   alpha_intra_us=a.alpha_intra_us, bw_intra_GBps=a.bw_intra_GBps,
                   alpha_inter_us=a.alpha_inter_us, bw_inter_GBps=a.bw_inter_GBps,
                   channels=a.channels, pipelined=a.pipelined)
    if min(m.ranks_per_host, m.nics_per_host, m.channels) < 1:
        ap.error("ranks per host, NICs per host and channels must be >= 1")
    if a.compare:
        return compare_lab(a.compare, m)
    ranks, skipped = ranks_that_fit([int(x) for x in a.ranks.split(",")], m)
    if skipped:
        print(f"# skipped (fewer than 2 ranks, or not a whole number of hosts): {skipped}")
    print_tables(ranks, [parse_size(s) for s in a.sizes.split(",")], m, a.profile)
    if a.plot:
        return plot(a.plot, ranks, m, a.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
