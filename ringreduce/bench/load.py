"""Whether other work took the cores during a run. The load average counts the bench's own ranks (two
busy ranks on two cores read 2.2 on a quiet machine), so the run's note goes by CPU time instead:
the machine's busy time (/proc/stat) minus the bench's own process tree's (/proc/<pid>/stat of
each live process in it, with the time of the children each has reaped), over the run."""
import os
import time
from typing import NamedTuple

# Other work may take this much of a core beyond the cores the ranks leave free before the run says
# so: a quarter of a core is one time slice in four taken from a rank.
MARGIN_CORES = 0.25


class Sample(NamedTuple):
    wall: float     # time.monotonic()
    machine: int    # busy clock ticks of every core since boot
    own: int        # clock ticks of the bench's process tree


def _machine_busy():
    with open("/proc/stat") as f:
        fields = f.readline().split()
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    return user + nice + system + irq + softirq + steal  # guest time is inside user


def _stat(pid):
    """(ppid, ticks of itself and of the children it reaped, command line) of a live process."""
    with open(f"/proc/{pid}/stat") as f:
        s = f.read()
    rest = s[s.rindex(")") + 2:].split()  # field 3 (state) on; the name may hold spaces
    return int(rest[1]), sum(int(x) for x in rest[11:15])  # ppid; utime stime cutime cstime


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def bench_root(pid=None):
    """The top of the bench's process tree: the highest ancestor, through ancestors that all run
    ringreduce.bench (torchrun and the --link launcher do), of this process."""
    pid = pid or os.getpid()
    try:
        while True:
            parent = _stat(pid)[0]
            if parent <= 1 or "ringreduce.bench" not in _cmdline(parent):
                return pid
            pid = parent
    except (OSError, ValueError, IndexError):
        return pid


def _tree_ticks(root):
    procs = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                procs[int(name)] = _stat(name)
            except (OSError, ValueError, IndexError):  # gone meanwhile
                pass
    children = {}
    for pid, (ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0, [root]
    while todo:  # each process counted once: live ones themselves, reaped ones in their reaper
        pid = todo.pop()
        total += procs[pid][1] if pid in procs else 0
        todo += children.get(pid, [])
    return total


def sample(root):
    """Now, for other_cores; None where /proc cannot tell (not Linux)."""
    try:
        return Sample(time.monotonic(), _machine_busy(), _tree_ticks(root))
    except (OSError, ValueError, IndexError):
        return None


def other_cores(start, end):
    """The cores other work kept busy on average between two samples, or None."""
    if start is None or end is None or end.wall <= start.wall:
        return None
    other = (end.machine - start.machine) - (end.own - start.own)
    return max(0.0, other / os.sysconf("SC_CLK_TCK") / (end.wall - start.wall))


def busy_note(other, ranks, cores, how):
    """A note when other work (other cores on average, measured how) took more of the cores than
    the bench's ranks leave free, else None."""
    free = max(0, cores - ranks)
    if other is None or other <= free + MARGIN_CORES:
        return None
    return (f"other processes kept {other:.2f} cores busy on average during the run ({how}; the "
            f"bench's own {ranks} rank{'s' if ranks != 1 else ''} aside), more than the {free} of the {cores} cores the ranks "
            f"leave free: these times (small sizes most) are not to be trusted; rerun on an idle "
            f"machine")
