"""Figures (matplotlib, Agg): busbw vs size per backend; time vs N when several N were run."""
import os

from . import report


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def busbw_vs_size(path, runs):
    """One panel per collective; a line per backend (and N when several); solid in-place,
    dashed out-of-place."""
    plt = _pyplot()
    from matplotlib.ticker import FuncFormatter
    colls = list(dict.fromkeys(r["collective"] for run in runs for r in run["rows"]))
    fig, axes = plt.subplots(1, max(1, len(colls)), figsize=(5.5 * max(1, len(colls)), 4.5),
                             squeeze=False)
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, c in zip(axes[0], colls):
        color = 0
        for run in runs:
            for b in dict.fromkeys(r["backend"] for r in run["rows"] if r["collective"] == c):
                label = b if len(runs) == 1 else f"{b} N={run['nranks']}"
                for inplace, style in ((True, "-o"), (False, "--")):
                    pts = sorted((r["size_bytes"], r["busbw_GBps"]) for r in run["rows"]
                                 if r["collective"] == c and r["backend"] == b
                                 and r["inplace"] == inplace)
                    if pts:
                        ax.plot(*zip(*pts), style, color=cycle[color % len(cycle)],
                                markersize=3, label=label if inplace else None,
                                alpha=1.0 if inplace else 0.5)
                color += 1
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: report.human(int(x))
                                                   .replace(" ", "").replace("iB", "")))
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.set_title(f"{c} (solid in-place, dashed out-of-place)", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    membw = [(run["nranks"], run["peak_membw_GBps"]) for run in runs if run["peak_membw_GBps"]]
    if membw:  # the physical limit, measured in the same run (see the package docstring)
        fig.suptitle("peak memory bandwidth (copy, read+write counted): " +
                     ", ".join(f"N={n}: {bw:.1f} GB/s" for n, bw in membw), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def time_vs_n(path, runs):
    """One panel per collective: in-place time at the largest size against N, per backend."""
    plt = _pyplot()
    data = report.vs_n(runs)
    colls = list(dict.fromkeys(c for c, _, _, _ in data))
    ns = [run["nranks"] for run in runs]
    fig, axes = plt.subplots(1, max(1, len(colls)), figsize=(5 * max(1, len(colls)), 4),
                             squeeze=False)
    for ax, c in zip(axes[0], colls):
        for cc, size, b, times in data:
            if cc != c:
                continue
            pts = [(n, t) for n, t in zip(ns, times) if t]
            if pts:
                ax.plot(*zip(*pts), "-o", label=b)
                ax.set_title(f"{c}, {report.human(size)}, in-place", fontsize=9)
        ax.set_xlabel("ranks (N)")
        ax.set_ylabel("time (us)")
        ax.set_xticks(ns)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def vs_n_path(path):
    stem, ext = os.path.splitext(path)
    return f"{stem}_vs_n{ext}"
