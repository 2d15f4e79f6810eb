"""Output: the nccl-tests-style table, the summary, the machine description and the JSON file.

Every line that is not a data row starts with '#', so a data row is any other non-empty line:
  size(B) count type redop backend  time algbw busbw #wrong (out-of-place)  time algbw busbw #wrong
"""
import json
import os
import platform
import statistics
import sys
import time

import torch

_ROW = "{:>12} {:>12} {:>8} {:>6} {:>16}  {:>10} {:>8} {:>8} {:>6}  {:>10} {:>8} {:>8} {:>6}"


def human(nbytes):
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.4g} {unit}"
    return f"{nbytes} B"


def print_header(collective, world, device):
    print(f"#\n# {collective}  nranks {world}  device {device.type}")
    print("#" + " " * 70 + "out-of-place" + " " * 26 + "in-place")
    print(_comment(_ROW.format("size(B)", "count", "type", "redop", "backend", "time(us)", "algbw",
                               "busbw", "#wrong", "time(us)", "algbw", "busbw", "#wrong")))
    print(_comment(_ROW.format("", "(elements)", "", "", "", "", "(GB/s)", "(GB/s)", "", "",
                               "(GB/s)", "(GB/s)", "")), flush=True)


def _comment(line):
    return "#" + line[1:]


def _cells(row):
    wrong = "N/A" if row["wrong"] is None else str(row["wrong"])
    return (f"{row['time_us']:.1f}", f"{row['algbw_GBps']:.3f}", f"{row['busbw_GBps']:.3f}", wrong)


def print_row(oop, ip):
    print(_ROW.format(oop["size_bytes"], oop["count"], oop["dtype"], oop["op"], oop["backend"],
                      *_cells(oop), *_cells(ip)), flush=True)


def summarize(rows, backends):
    """Average busbw per backend and collective; per size, baseline time / ringreduce time
    (in-place; > 1 means ringreduce is faster)."""
    avg = {}
    for b in backends:
        per = {}
        for c in dict.fromkeys(r["collective"] for r in rows):
            vals = [r["busbw_GBps"] for r in rows if r["backend"] == b and r["collective"] == c]
            if vals:
                per[c] = statistics.mean(vals)
        avg[b] = per
    ours = [b for b in backends if b.startswith("ringreduce/")]
    bases = [b for b in backends if not b.startswith("ringreduce/")]
    by = {(r["collective"], r["size_bytes"], r["backend"]): r for r in rows if r["inplace"]}
    ratios, spreads = [], []
    for (c, size) in dict.fromkeys((r["collective"], r["size_bytes"]) for r in rows):
        entry, spread = {"collective": c, "size_bytes": size}, {"collective": c, "size_bytes": size}
        for o in ours:
            for base in bases:
                mine, theirs = by.get((c, size, o)), by.get((c, size, base))
                if mine and theirs:
                    entry[f"{base} / {o}"] = theirs["time_us"] / mine["time_us"]
                    if "time_us_q1" in mine and "time_us_q1" in theirs:
                        spread[f"{base} / {o}"] = [theirs["time_us_q1"] / mine["time_us_q3"],
                                                   theirs["time_us_q3"] / mine["time_us_q1"]]
        ratios.append(entry)
        spreads.append(spread)
    # The printed table compares each baseline with the automatic choice (the first ringreduce
    # row: ringreduce/shm on CPU, p2p on GPU); every pair stays in the JSON. The spread of a ratio:
    # the baseline's lower quartile over ours' upper, to its upper over ours' lower.
    return {"avg_busbw_GBps": avg, "time_ratios_inplace": ratios, "time_ratio_spread": spreads,
            "iters": max((r.get("iters") or 0 for r in rows), default=0) or None,
            "reference": ours[0] if ours else None, "baselines": bases}


def print_summary(run):
    s, w = run["summary"], run["nranks"]
    colls = list(dict.fromkeys(c for per in s["avg_busbw_GBps"].values() for c in per))
    best = {b: max((r["busbw_GBps"] for r in run["rows"] if r["backend"] == b), default=0.0)
            for b in s["avg_busbw_GBps"]}
    print(f"#\n# summary, nranks {w}: average busbw (GB/s) over sizes, both forms; best: the "
          f"highest of any row")
    print("# " + f"{'backend':<20}" + "".join(f"{c:>16}" for c in colls) + f"{'best':>10}")
    for b, per in s["avg_busbw_GBps"].items():
        print("# " + f"{b:<20}" + "".join(f"{per[c]:>16.3f}" if c in per else f"{'-':>16}"
                                          for c in colls) + f"{best[b]:>10.3f}")
    ref = s.get("reference")
    bases = [b for b in s.get("baselines", []) if any(f"{b} / {ref}" in e
                                                       for e in s["time_ratios_inplace"])]
    if ref and bases:
        n = s.get("iters")
        print(f"#\n# time of each baseline / time of {ref}, in-place (> 1: {ref} faster)\n"
              f"# medians{f' of {n} timed iterations' if n else ''}; below each ratio its spread, "
              f"from the baseline's lower\n# quartile over ours' upper to its upper over ours' "
              f"lower")
        widths = [max(10, len(b)) + 2 for b in bases]
        print("# " + f"{'collective':<15}{'size':>9}" +
              "".join(f"{b:>{w}}" for b, w in zip(bases, widths)))
        spreads = s.get("time_ratio_spread") or [{}] * len(s["time_ratios_inplace"])
        for e, sp in zip(s["time_ratios_inplace"], spreads):
            cells = (e.get(f"{b} / {ref}") for b in bases)
            print("# " + f"{e['collective']:<15}{human(e['size_bytes']):>9}" +
                  "".join(f"{c:>{w}.2f}" if c is not None else f"{'-':>{w}}"
                          for c, w in zip(cells, widths)))
            ranges = [sp.get(f"{b} / {ref}") for b in bases]
            if any(ranges):
                print("# " + " " * 24 + "".join(
                    f"{_range(r):>{w}}" for r, w in zip(ranges, widths)))
    if run["peak_membw_GBps"] is not None:
        print(f"#\n# peak memory bandwidth (rank 0, {run['membw_method']}): "
              f"{run['peak_membw_GBps']:.1f} GB/s")
    print_wire(run["rows"])
    print_hosts(run)
    bad = sum(r["wrong"] or 0 for r in run["rows"])
    print(f"# wrong elements in total: {bad}" + ("" if run["rows"] and
                                                  run["rows"][0]["wrong"] is not None
                                                  else " (not checked)"), flush=True)


def print_wire(rows):
    """--wire: per collective and size, in place: each backend's time over ringreduce/shm's (the
    float32 automatic choice; > 1: faster than it) and the largest error against the exact
    result."""
    rows = [r for r in rows if r["inplace"] and r.get("max_err") is not None]
    if not rows:
        return
    names = list(dict.fromkeys(r["backend"] for r in rows))
    print("#\n# --wire, in place: speedup over ringreduce's float32 call (ringreduce/hier with "
          "--hosts, ringreduce/p2p on CUDA, else ringreduce/shm: its time / the backend's) | "
          "largest |error| against the exact result")
    w = max(len(b) for b in names) + 2
    print("# " + f"{'collective':<15}{'size':>9}" + "".join(f"{b:>{w}}" for b in names))
    for c, size in dict.fromkeys((r["collective"], r["size_bytes"]) for r in rows):
        at = {r["backend"]: r for r in rows if r["collective"] == c and r["size_bytes"] == size}
        base = at.get("ringreduce/hier") or at.get("ringreduce/shm") or at.get("ringreduce/p2p")
        cells = []
        for b in names:
            r = at.get(b)
            if r is None:
                cells.append("-")
                continue
            speed = f"{base['time_us'] / r['time_us']:.2f}x" if base else "-"
            cells.append(f"{speed} | {r['max_err']:.1e}")
        print("# " + f"{c:<15}{human(size):>9}" + "".join(f"{x:>{w}}" for x in cells))


def link_bound_us(size, hosts, gbps):
    """The least time an all_reduce of size bytes across hosts can take on links of gbps GB/s
    each way: whatever the plan, each host's link carries its partial sums out and the others'
    in, 2 (H - 1) / H x size bytes each way (float32; a narrow wire carries fewer)."""
    return 2 * (hosts - 1) / hosts * size / (gbps * 1e9) * 1e6


def print_hosts(run):
    """--hosts: the all_reduce rows in place against ringreduce/hier's (each row's time / hier's;
    > 1: hier faster) and, with --link, hier's time against the link's bound (link_bound_us at the
    GB/s one TCP stream got across the link). The wire rows are in print_wire's table."""
    hosts, gbps = run.get("hosts", 1), run.get("link_GBps")
    rows = [r for r in run["rows"] if r["inplace"] and r["collective"] == "all_reduce"]
    hier = {r["size_bytes"]: r["time_us"] for r in rows if r["backend"] == "ringreduce/hier"}
    if hosts < 2 or not hier:
        return
    others = [b for b in dict.fromkeys(r["backend"] for r in rows)
              if b != "ringreduce/hier" and "/wire-" not in b]
    if not gbps and not any(b.startswith("ringreduce/") for b in others):
        return  # the summary's table already has hier against each baseline
    print(f"#\n# across {hosts} hosts, all_reduce in place: each row's time / ringreduce/hier's "
          f"(> 1: hier faster)" + (f"; the link's bound: 2(H-1)/H x size at {gbps:.3f} GB/s "
                                   f"(one TCP stream across it)" if gbps else ""))
    widths = [max(8, len(b)) + 2 for b in others]
    print("# " + f"{'size':>9}{'hier us':>12}" +
          (f"{'bound us':>12}{'hier/bound':>12}" if gbps else "") +
          "".join(f"{b:>{w}}" for b, w in zip(others, widths)))
    at = {(r["backend"], r["size_bytes"]): r["time_us"] for r in rows}
    for size, t in hier.items():
        cells = [f"{human(size):>9}", f"{t:>12.1f}"]
        if gbps:
            bound = link_bound_us(size, hosts, gbps)
            cells += [f"{bound:>12.1f}", f"{t / bound:>12.2f}"]
        cells += [f"{at[(b, size)] / t:>{w}.2f}" if (b, size) in at else f"{'-':>{w}}"
                  for b, w in zip(others, widths)]
        print("# " + "".join(cells))


def print_vs_n(runs):
    """Time (us, in-place) at the largest size of each collective against the rank count."""
    ns = [r["nranks"] for r in runs]
    rows = vs_n(runs)
    w = max([len("backend")] + [len(b) for _, _, b, _ in rows]) + 2  # names never run together
    print("#\n# time (us) vs nranks at the largest size, in-place")
    print("# " + f"{'collective':>16}{'size(B)':>12}{'backend':>{w}}" +
          "".join(f"{'N=' + str(n):>12}" for n in ns))
    for c, size, b, t in rows:
        print("# " + f"{c:>16}{size:>12}{b:>{w}}" + "".join(f"{v:>12.1f}" if v else f"{'-':>12}"
                                                              for v in t))


def vs_n(runs):
    """(collective, largest size, backend, [time per run or None]) for every pair present."""
    out = []
    keys = dict.fromkeys((r["collective"], r["backend"]) for run in runs for r in run["rows"])
    for c, b in keys:
        size = max(r["size_bytes"] for run in runs for r in run["rows"] if r["collective"] == c)
        times = []
        for run in runs:
            # reduce_scatter/all_gather round to a multiple of N: take each run's largest size
            cand = [r for r in run["rows"] if r["collective"] == c and r["backend"] == b
                    and r["inplace"]]
            times.append(max(cand, key=lambda r: r["size_bytes"])["time_us"] if cand else None)
        out.append((c, size, b, times))
    return out


def machine():
    """Where the numbers come from: CPU, memory, versions, GPU and NCCL if any."""
    import ringreduce
    info = {"cpu_model": platform.processor() or platform.machine(),
            "cpu_cores": os.cpu_count(), "cpu_affinity": len(os.sched_getaffinity(0)),
            "memory_bytes": None, "platform": platform.platform(),
            "python": sys.version.split()[0], "torch": torch.__version__,
            "ringreduce": getattr(ringreduce, "__version__", None),
            "cuda": torch.version.cuda, "gpu_count": 0, "gpu_name": None, "nccl_version": None}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    info["memory_bytes"] = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if torch.cuda.is_available():
        info["gpu_count"] = torch.cuda.device_count()
        info["gpu_name"] = torch.cuda.get_device_name(0)
        try:
            info["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:
            pass
    return info


def print_machine(info, args, world):
    mem = human(info["memory_bytes"]) if info["memory_bytes"] else "?"
    print(f"#\n# ringreduce.bench, nranks {world}: {info['cpu_model']}, {info['cpu_affinity']} "
          f"cores, {mem}; "
          f"python {info['python']}, torch {info['torch']}, ringreduce {info['ringreduce']}" +
          (f"; {info['gpu_count']} x {info['gpu_name']}, NCCL {info['nccl_version']}"
           if info["gpu_name"] else "; no GPU"))
    print(f"# sizes {args.minbytes}..{args.maxbytes} B x{args.stepfactor}, iters {args.iters}, "
          f"agg {args.agg_iters or f'auto (batches >= {args.batch_ms:g} ms)'}, warmup {args.warmup_iters}, check {args.check}, type {args.type_name}, op {args.op}, "
          f"backends {','.join(args.backends)}" +
          (f"; every row on {args.hosts} emulated hosts" if getattr(args, "lab", None) else
           f"; every row on {args.hosts} emulated hosts of this machine's GPUs (RINGREDUCE_HOST_ID "
           f"and NCCL_HOSTID per host; NCCL's sockets over loopback between them)"
           if args.hosts > 1 and args.device == "cuda" else
           f"; ringreduce/hier on {args.hosts} simulated hosts (Gloo over loopback TCP between "
           f"them)" if args.hosts > 1 else ""), flush=True)
    if getattr(args, "lab", None):
        print(f"# link: {args.lab}", flush=True)


def write_json(path, args, info, runs, extra=None):
    """Writes the run's document (command, flags, machine, runs, and extra) to path; returns it."""
    keep = ("minbytes", "maxbytes", "stepfactor", "iters", "agg_iters", "batch_ms", "hosts", "lab", "link_gbps", "warmup_iters", "check", "datatype",
            "op", "nranks", "collectives", "backends", "quick", "device", "torchrun", "results")
    doc = {"command": [os.path.basename(sys.executable), "-m", "ringreduce.bench"] + sys.argv[1:],
           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
           "args": {k: getattr(args, k, None) for k in keep}, "machine": info, "runs": runs,
           **(extra or {})}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    return doc


def markdown(doc):
    """summary.md: the run in a few tables (in-place times per size and backend, average busbw)."""
    m, a = doc["machine"], doc["args"]
    load = doc.get("load_average") or {}
    mem = human(m["memory_bytes"]) if m.get("memory_bytes") else "?"
    out = [f"# ringreduce.bench, {doc.get('date', '')}", "",
           f"`{' '.join(doc['command'])}`", "",
           f"{m['cpu_model']}, {m['cpu_affinity']} cores, {mem}; python {m['python']}, torch "
           f"{m['torch']}, ringreduce {m['ringreduce']}" +
           (f"; {m['gpu_count']} x {m['gpu_name']}, NCCL {m['nccl_version']}" if m.get("gpu_name")
            else "; no GPU") + ".",
           f"Load average (1 min): {_load1(load.get('start'))} at start, "
           f"{_load1(load.get('end'))} at end" +
           (f"; other work: {load['other_cores']:.2f} cores on average ({load.get('other_how')}, "
            f"the bench's ranks aside)" if load.get("other_cores") is not None else "") +
           f". Type {a['datatype']}, op {a['op']}, {a['iters']} timed iterations." +
           (" **Other work took the cores the ranks need: these times are not to be trusted.**"
            if load.get("busy") else ""), ""]
    if doc.get("legend"):
        out += ["Backends:", ""] + [f"- `{b}`: {text}" for b, text in doc["legend"].items()] + [""]
    if doc.get("left_out"):
        out += ["Left out:", ""] + [f"- `{b}`: {why}" for b, why in doc["left_out"]] + [""]
    for run in doc["runs"]:
        n = run["nranks"]
        for c in dict.fromkeys(r["collective"] for r in run["rows"]):
            rows = [r for r in run["rows"] if r["collective"] == c and r["inplace"]]
            backends = list(dict.fromkeys(r["backend"] for r in rows))
            t = {(r["size_bytes"], r["backend"]): _spread_cell(r) for r in rows}
            iters = max((r.get("iters") or 0 for r in rows), default=0)
            out += [f"## {c}, {n} ranks: time (us), in-place: the median"
                    f"{f' of {iters} timed iterations' if iters else ''} (lower - upper quartile)",
                    "",
                    "| size | " + " | ".join(backends) + " |",
                    "| ---: |" + " ---: |" * len(backends)]
            for size in sorted(dict.fromkeys(r["size_bytes"] for r in rows)):
                out.append(f"| {human(size)} | " + " | ".join(
                    t.get((size, b), "-") for b in backends) + " |")
            out.append("")
        out += [f"## {n} ranks: average busbw (GB/s), both forms", "",
                "| backend | " + " | ".join(_collectives(run)) + " |",
                "| --- |" + " ---: |" * len(_collectives(run))]
        for b, per in run["summary"]["avg_busbw_GBps"].items():
            out.append(f"| {b} | " + " | ".join(f"{per[c]:.3f}" if c in per else "-"
                                               for c in _collectives(run)) + " |")
        out.append("")
        if run.get("peak_membw_GBps"):
            out += [f"Peak memory bandwidth ({run['membw_method']}): "
                    f"{run['peak_membw_GBps']:.1f} GB/s.", ""]
        if run.get("notes"):
            out += ["Notes:", ""] + [f"- {note}" for note in run["notes"]] + [""]
    wrong = sum(r["wrong"] or 0 for run in doc["runs"] for r in run["rows"])
    out.append(f"Wrong elements in total: {wrong}.")
    return "\n".join(out) + "\n"


def _range(r):
    return "-" if not r else f"{r[0]:.3g}-{r[1]:.3g}"


def _spread_cell(r):
    if "time_us_q1" not in r:
        return f"{r['time_us']:.1f}"
    return f"{r['time_us']:.1f} ({r['time_us_q1']:.1f} - {r['time_us_q3']:.1f})"


def _load1(load):
    return "?" if not load else f"{load[0]:.2f}"


def _collectives(run):
    return list(dict.fromkeys(r["collective"] for r in run["rows"]))
