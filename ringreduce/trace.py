"""Reads the flight recorder dumps of every rank and says what went wrong, first line first.

    python -m ringreduce.trace DIR [--chrome out.json] [--plot out.png]

DIR holds the dumps (rank<R>.json, one folder per communicator: the folder a failure names, or
RINGREDUCE_TRACE_DIR with several). Exit status 1 when it finds a desync, a failure, a rank that
never entered a call or ranks still waiting; 0 when every rank agrees and every call finished;
2 when it cannot read what it was given.

The dump (version 1) is a JSON object: the rank's identity (rank, world_size, global_rank, host,
hostname, pid, transport, communicator: its store prefix, job: rank 0's time and a random id when
it was made, group, members, pids, timeout_s, stacks: the file SIGUSR1 wrote
its Python stacks to, or null), time_us (wall clock of the dump, microseconds), capacity, calls
(calls made, the newest seq), dropped (older calls no longer in the buffer), waiting (what the
rank's ring waits for: seq, peer, for, phase, step, slice, waited_s; or null) and entries: one per
call, oldest first: seq, coll, numel, dtype, op, algo, bytes, source (api, backend, ddp_hook,
bucketer, op, nn), state (queued, started, finished, failed), queued_us, started_us, ended_us
(0: not reached) and error (failed calls).
"""
import argparse
import glob
import json
import os
import re
import statistics
import sys
import tempfile
from collections import Counter, defaultdict

VERSION = 1
TRACE_KEEP = 20  # runs the default trace folder keeps: ringreduce._lifecycle.TRACE_KEEP
# Errors that follow from another rank's failure rather than cause one.
_CONSEQUENCE = re.compile(r"aborted the group|broken by an earlier failure|communicator is closed|"
                         r"stopped because|was aborted|aborted on this rank")
_DIED = re.compile(r"peer rank (\d+) \(pid (\d+)\) died")


class _Usage(Exception):
    """What the analyzer cannot read or do: exit status 2 (1 means it found a problem)."""


def load(path):
    """Every dump under path (a folder, searched recursively, or one file), grouped by
    communicator: {communicator: {rank: dump}}."""
    files = [path] if os.path.isfile(path) else sorted(
        glob.glob(os.path.join(path, "**", "rank*.json"), recursive=True))
    comms = defaultdict(dict)
    for f in files:  # one bad file is skipped (said on stderr), not the whole folder
        try:
            with open(f, encoding="utf-8", errors="replace") as fh:
                d = json.load(fh)
        except (OSError, ValueError) as e:
            print(f"ringreduce.trace: {f}: skipped, not a readable dump ({e})", file=sys.stderr)
            continue
        if not isinstance(d, dict) or d.get("version") != VERSION:
            version = d.get("version") if isinstance(d, dict) else None
            print(f"ringreduce.trace: {f}: skipped, dump version {version!r}; this analyzer "
                  f"reads version {VERSION}", file=sys.stderr)
            continue
        if not all(k in d for k in ("rank", "world_size", "entries", "calls")):
            print(f"ringreduce.trace: {f}: skipped, not a ringreduce dump", file=sys.stderr)
            continue
        d["_file"] = f
        # one communicator of one job (an earlier job's dumps may sit in the same folder tree)
        key = f"{d.get('communicator', f)}" + (f" [{d['job']}]" if d.get("job") else "")
        comms[key][d["rank"]] = d
    return comms


def describe(e):
    """all_reduce(numel=1024, float32, SUM) of an entry."""
    op = "" if e["coll"] == "all_gather" else f", {e['op']}"
    return f"{e['coll']}(numel={e['numel']}, {e['dtype']}{op})"


def _signature(e):
    return (e["coll"], e["numel"], e["dtype"], "" if e["coll"] == "all_gather" else e["op"])


def _difference(entries):
    """How calls of one seq differ: "different collectives", or "the same collective (all_reduce)
    with different numel / dtype / op" naming the fields that differ (all_gather has no op)."""
    colls = {e["coll"] for e in entries}
    if len(colls) > 1:
        return "different collectives"
    coll = colls.pop()
    fields = [f for f in ("numel", "dtype", "op")
              if not (f == "op" and coll == "all_gather") and len({e[f] for e in entries}) > 1]
    return f"the same collective ({coll}) with different {' / '.join(fields)}"


def _ranks(rs):
    rs = sorted(rs)
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))


def _first_line(text):
    return (text or "").strip().splitlines()[0] if (text or "").strip() else ""


def _last_frame(stack_file, pid):
    """The innermost frame of the main thread in the last stack dump of a SIGUSR1 (faulthandler's
    format), or None."""
    try:
        with open(stack_file) as f:
            text = f.read()
    except OSError:
        return None
    blocks = re.split(r"\n(?=Current thread|Thread 0x)", text)
    frames = None
    for b in blocks:
        lines = [ln.strip() for ln in b.splitlines() if ln.strip().startswith("File ")]
        if lines and ("Current thread" in b or frames is None):
            frames = lines
    if not frames:
        return None
    m = re.match(r'File "(.+)", line (\d+) in (.+)', frames[0])
    return f"{m.group(3)} at {os.path.basename(m.group(1))}:{m.group(2)}" if m else frames[0]


class Analysis:
    """The findings of one communicator's dumps."""

    def __init__(self, name, dumps):
        self.name, self.dumps = name, dumps
        self.world = max(d["world_size"] for d in dumps.values())
        self.missing = sorted(set(range(self.world)) - set(dumps))
        self.by_rank = {r: {e["seq"]: e for e in d["entries"]} for r, d in dumps.items()}
        self.calls = {r: d["calls"] for r, d in dumps.items()}
        self.findings = []  # (kind, text): kind in desync, absent, failure, waiting
        self.details = []
        self._desync()
        self._absent()
        self._failures()
        self._waiting()

    def _entry(self, seq):
        for r in sorted(self.by_rank):
            if seq in self.by_rank[r]:
                return self.by_rank[r][seq]
        return None

    def _desync(self):
        seqs = sorted(set().union(*[set(m) for m in self.by_rank.values()])) if self.by_rank else []
        for seq in seqs:
            sigs = {r: _signature(m[seq]) for r, m in self.by_rank.items() if seq in m}
            groups = defaultdict(list)
            for r, s in sigs.items():
                groups[s].append(r)
            if len(groups) < 2:
                continue
            ordered = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[1]))
            by = {r: describe(self.by_rank[r][seq]) for r in sigs}
            if len(ordered[0][1]) > len(ordered[1][1]):  # a majority: the others are at fault
                major = ordered[0][1]
                odd = sorted(r for s, rs in ordered[1:] for r in rs)
                text = (f"DESYNC in call #{seq}: {_ranks(odd)} called "
                        f"{' / '.join(by[r] for r in odd)} where {_ranks(major)} called "
                        f"{by[major[0]]}")
            else:
                how = _difference([self.by_rank[r][seq] for r in sigs])
                text = (f"DESYNC in call #{seq}: the ranks called {how}: "
                        + "; ".join(f"rank {r} {by[r]}" for r in sorted(by)))
            self.findings.append(("desync", text))
            self.details.append(f"call #{seq}, side by side:")
            self.details += [f"  rank {r}: {by[r]}  (source {self.by_rank[r][seq]['source']}, "
                             f"{self.by_rank[r][seq]['state']})" for r in sorted(by)]
            return  # the first one explains the rest

    def _absent(self):
        top = max(self.calls.values()) if self.calls else 0
        # A dead peer's error names its pid (and its rank in the ring that saw it: a local rank
        # under a hierarchical plan); the dumps' pids say whose it was.
        owner = {}  # (host, pid) -> rank: pids repeat across hosts
        for d in self.dumps.values():
            for r, pid in enumerate(d.get("pids") or []):
                if pid:
                    owner.setdefault((d.get("host"), str(pid)), r)
        died = {}
        # the rank that saw it die first: its own error, not the abort it passed on
        for e, d in sorted(((e, d) for d in self.dumps.values() for e in d["entries"]),
                           key=lambda x: bool(_CONSEQUENCE.search(x[0].get("error", "")))):
            m = _DIED.search(e.get("error", ""))
            if m:
                flat = int(m.group(1)) if d.get("transport") == "shm" else None
                who = owner.get((d.get("host"), m.group(2)), flat)
                if who is not None:
                    died.setdefault(who, (d["rank"], e["seq"], m.group(2)))
        for r in self.missing:
            if r in died:
                seen_by, seq, pid = died[r]
                e = self._entry(seq)
                self.findings.append(("absent", f"rank {r} died in call #{seq} "
                                      f"{describe(e) if e else ''}: rank {seen_by} saw its process "
                                      f"(pid {pid}) gone; it left no dump"))
            else:
                waiters = sorted(d["rank"] for d in self.dumps.values()
                                 if (d.get("waiting") or {}).get("peer") == r)
                how = f"; {_ranks(waiters)} waited for it" if waiters else ""
                self.findings.append(("absent", f"rank {r} left no dump (dead, or not dumped: with "
                                      f"RINGREDUCE_TRACE_SIGNAL=1 send it SIGUSR1){how}"))
        for r in sorted(self.calls):
            if self.calls[r] >= top:
                continue
            newest = self.by_rank[r].get(self.calls[r])
            if newest is not None and newest["state"] != "finished":
                continue  # it stopped in (or failed) its own last call: not a call it skipped
            seq = self.calls[r] + 1
            ahead = sorted(q for q in self.calls if self.calls[q] >= seq)
            e = self._entry(seq)
            last = self.by_rank[r].get(self.calls[r])
            d = self.dumps[r]
            when = ""
            if last and last.get("ended_us"):
                when = (f"; its last call #{last['seq']} {describe(last)} ended "
                        f"{(d['time_us'] - last['ended_us']) / 1e6:.1f} s before its dump")
            where = _last_frame(d["stacks"], d["pid"]) if d.get("stacks") else None
            if where:
                when += f"; its main thread was in {where}"
            self.findings.append(("absent", f"rank {r} never entered call #{seq} "
                                  f"{describe(e) if e else ''} ({_ranks(ahead)} did){when}"))

    def _failures(self):
        failed = [(e["ended_us"], r, e) for r, m in self.by_rank.items() for e in m.values()
                  if e["state"] == "failed"]
        if not failed:
            return
        causes = [f for f in failed if not _CONSEQUENCE.search(f[2].get("error", ""))] or failed
        t, r, e = min(causes, key=lambda f: (f[0] or float("inf"), f[1]))  # 0: time unknown
        self.findings.append(("failure", f"rank {r} failed first, in call #{e['seq']} "
                              f"{describe(e)}: {_first_line(e.get('error'))}"))
        for t2, r2, e2 in sorted(failed, key=lambda f: (f[0] or float("inf"), f[1])):
            when = f"{(t2 - t) / 1e3:+.1f} ms" if t and t2 else "(time unknown)"
            self.details.append(f"  rank {r2} call #{e2['seq']} failed {when}: "
                                f"{_first_line(e2.get('error'))}")

    def _waiting(self):
        lines = []
        for r in sorted(self.dumps):
            d = self.dumps[r]
            open_ = [e for e in self.by_rank[r].values() if e["state"] in ("started", "queued")]
            if not open_:
                continue
            e = min(open_, key=lambda x: x["seq"])
            w = d.get("waiting")
            at = ""
            if w and e["state"] == "started" and len(open_) == 1:
                at = (f" ({w['phase']} step {w['step']}, slice {w['slice']}: waiting {w['waited_s']:.1f} s "
                      f"for {w['for']} rank {w['peer']})")
            lines.append(f"rank {r} is in call #{e['seq']} {describe(e)}, {e['state']}{at}")
        if lines:
            self.findings.append(("waiting", "; ".join(lines)))

    def stragglers(self):
        """(rank, times last, calls compared, median lateness in ms): who the others waited for."""
        if len(self.by_rank) < 2:
            return None
        common = set.intersection(*[set(m) for m in self.by_rank.values()])
        last, late = Counter(), defaultdict(list)
        n = 0
        for seq in common:
            starts = {r: m[seq]["started_us"] for r, m in self.by_rank.items()}
            if not all(starts.values()):
                continue
            n += 1
            r = max(starts, key=starts.get)
            others = [t for q, t in starts.items() if q != r]
            last[r] += 1
            late[r].append((starts[r] - statistics.median(others)) / 1e3)
        if not n:
            return None
        r, k = last.most_common(1)[0]
        return r, k, n, statistics.median(late[r])

    def lines(self):
        out = [text for _, text in self.findings]
        s = self.stragglers()
        if s and s[2] >= 10:  # fewer calls say little
            out.append(f"stragglers: rank {s[0]} arrived last in {s[1]} of {s[2]} calls, "
                       f"{s[3]:.3f} ms late on median")
        return out


def diagnose(comms):
    """(exit status, report lines) for every communicator, the worst first."""
    order = {"desync": 0, "absent": 1, "failure": 2, "waiting": 3}
    analyses = [Analysis(name, dumps) for name, dumps in comms.items()]
    analyses.sort(key=lambda a: (min([order[k] for k, _ in a.findings] or [9]), a.name))
    bad = any(a.findings for a in analyses)
    out = []
    for a in analyses:
        a.findings.sort(key=lambda f: order[f[0]])
        head = a.lines()
        if not a.findings:
            top = max(a.calls.values()) if a.calls else 0
            head.insert(0, f"OK: {len(a.dumps)} of {a.world} ranks agree on {top} calls; none "
                        f"failed or waiting")
        out += [head[0] if len(analyses) == 1 else f"{head[0]}  (communicator {a.name})"]
        rest = head[1:] + a.details
        d0 = next(iter(a.dumps.values()))
        rest.append(f"communicator {a.name} ({d0.get('transport')}, {a.world} ranks, dumps: "
                    f"{', '.join(str(r) for r in sorted(a.dumps)) or 'none'})")
        out += ["  " + x if not x.startswith("  ") else x for x in rest]
    return (1 if bad else 0), out


def chrome(comms):
    """A Chrome trace / Perfetto JSON object: a process per rank, a track per communicator, a
    complete event per call with its arguments."""
    events = []
    for name, dumps in sorted(comms.items()):
        for r, d in sorted(dumps.items()):
            pid = d.get("global_rank") if d.get("global_rank") is not None else r
            events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                           "args": {"name": f"rank {pid} ({d.get('host')}, pid {d['pid']})"}})
            tid = abs(hash(name)) % 100000
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                           "args": {"name": f"{d.get('transport')} {name}"}})
            for e in d["entries"]:
                start = e["started_us"] or e["queued_us"]
                # in progress: to the dump; ended at an unknown time: a point
                end = e["ended_us"] or (d["time_us"] if e["state"] in ("started", "queued") else start)
                args = {k: e[k] for k in ("seq", "numel", "dtype", "op", "algo", "bytes", "source",
                                          "state")}
                if e.get("error"):
                    args["error"] = e["error"]
                events.append({"name": e["coll"], "cat": d.get("transport") or "ringreduce",
                               "ph": "X", "ts": start, "dur": max(end - start, 0.0), "pid": pid,
                               "tid": tid, "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def plot(comms, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise _Usage("ringreduce.trace: --plot needs matplotlib (pip install "
                         "'ringreduce[bench]' or pip install matplotlib)")
    fig, ax = plt.subplots(figsize=(12, 1 + 0.5 * sum(len(d) for d in comms.values())))
    t0 = min((e["started_us"] or e["queued_us"]) for ds in comms.values() for d in ds.values()
             for e in d["entries"]) if any(d["entries"] for ds in comms.values()
                                          for d in ds.values()) else 0
    colors = {"finished": "tab:blue", "failed": "tab:red", "started": "tab:orange",
              "queued": "tab:gray"}
    labels, y = [], 0
    for name, dumps in sorted(comms.items()):
        for r, d in sorted(dumps.items()):
            for e in d["entries"]:
                s = (e["started_us"] or e["queued_us"]) - t0
                end = (e["ended_us"] or (d["time_us"] if e["state"] in ("started", "queued")
                                         else s + t0)) - t0
                ax.broken_barh([(s / 1e3, max(end - s, 1.0) / 1e3)], (y - 0.4, 0.8),
                               color=colors.get(e["state"], "k"))
            labels.append(f"rank {r} {d.get('transport')}")
            y += 1
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels)
    ax.set_xlabel("ms")
    ax.set_title("ringreduce calls per rank (blue finished, orange in progress, red failed)")
    fig.tight_layout()
    fig.savefig(path)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m ringreduce.trace", description=__doc__.split("\n")[0])
    p.add_argument("dir", help="a folder of dumps (searched recursively) or one dump")
    p.add_argument("--chrome", metavar="OUT.json", help="write a Chrome trace / Perfetto file")
    p.add_argument("--plot", metavar="OUT.png", help="draw the per-rank timeline (matplotlib)")
    args = p.parse_args(argv)
    if not os.path.exists(args.dir):
        raise _Usage(f"ringreduce.trace: {args.dir}: no such file or folder")
    comms = load(args.dir)
    if not comms:
        raise _Usage(f"ringreduce.trace: no readable dumps (rank*.json) under {args.dir}")
    status, lines = diagnose(comms)
    print("\n".join(lines))
    default = os.path.realpath(os.path.join(tempfile.gettempdir(), "ringreduce-trace"))
    if os.path.commonpath([os.path.realpath(args.dir), default]) == default:
        print(f"ringreduce.trace: note: {default} keeps the {TRACE_KEEP} most recent runs (a new "
              f"communicator removes older ones); copy a folder to keep it, or set "
              f"RINGREDUCE_TRACE_DIR, whose folders are never pruned", file=sys.stderr)
    if args.chrome:
        with open(args.chrome, "w") as f:
            json.dump(chrome(comms), f)
    if args.plot:
        plot(comms, args.plot)
    return status


if __name__ == "__main__":
    try:
        sys.exit(main())
    except _Usage as e:
        print(e, file=sys.stderr)
        sys.exit(2)
