"""Simulated hosts on one machine: each host's ranks run in a mount namespace of their own with a
private /dev/shm (a fresh tmpfs), so no collective can pass through shared memory across hosts.

    results = run(["a", "a", "b", "b"], "module:function", args)

starts one `unshare -m --propagation private` process per host id (root needed, as in CI); it
mounts the tmpfs, imports torch once and forks that host's ranks, each with
RINGREDUCE_HOST_ID=<host id>, joined by a Gloo default group on a FileStore (in the shared /tmp,
not /dev/shm). Every rank calls
function(rank, world, *args) from the tests directory and its result, or traceback, comes back. The
host process also reports what its ranks left in its /dev/shm.
"""
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))


class RankError(AssertionError):
    pass


def run(hosts, fn, *args, timeout=180, env=None, expect_dead=()):
    """Returns (results by rank, leftover /dev/shm names by host id); raises RankError with every
    failing rank's traceback. Ranks in expect_dead may die without a result."""
    tmp = tempfile.mkdtemp(prefix="rr-hosts-")
    with open(os.path.join(tmp, "job.pkl"), "wb") as f:
        pickle.dump({"hosts": hosts, "fn": fn, "args": args, "env": env or {}}, f)
    procs = {}
    for h in dict.fromkeys(hosts):
        script = ('mount -t tmpfs -o size=1g tmpfs /dev/shm && exec "$0" "$1" "$2" host "$3"')
        procs[h] = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c", script,
                                     sys.executable, os.path.abspath(__file__), tmp, h])
    deadline = time.monotonic() + timeout
    try:
        for h, p in procs.items():
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise RankError(f"simulated hosts did not finish within {timeout} s") from None
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    results, errors = {}, {}
    for r in range(len(hosts)):
        path = os.path.join(tmp, f"rank{r}.pkl")
        if not os.path.exists(path):
            if r not in expect_dead:
                errors[r] = "no result (the rank died or never started)"
            continue
        with open(path, "rb") as f:
            status, value = pickle.load(f)
        (results if status == "ok" else errors)[r] = value
    if errors:
        raise RankError("\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items())))
    leftovers = {}
    for h in procs:
        with open(os.path.join(tmp, f"shm-{h}.json")) as f:
            leftovers[h] = json.load(f)
    return results, leftovers


def _host(tmp, host):
    """In the host's namespace: import torch once, fork its ranks, wait, list what they left in
    /dev/shm. A rank leaves through sys.exit, unwinding to the top: a whole interpreter exit."""
    with open(os.path.join(tmp, "job.pkl"), "rb") as f:
        job = pickle.load(f)
    mine = [r for r, h in enumerate(job["hosts"]) if h == host]
    os.environ.update(RINGREDUCE_HOST_ID=host, **job["env"])
    sys.path.insert(0, HERE)
    import torch.distributed  # noqa: F401  (before the forks: seconds once, not once per rank)
    import ringreduce  # noqa: F401
    pids = []
    for r in mine:
        pid = os.fork()
        if pid == 0:
            _rank(tmp, r)
            sys.exit(0)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)
    with open(os.path.join(tmp, f"shm-{host}.json"), "w") as f:
        json.dump(sorted(os.listdir("/dev/shm")), f)


def _rank(tmp, rank):
    sys.path.insert(0, HERE)
    with open(os.path.join(tmp, "job.pkl"), "rb") as f:
        job = pickle.load(f)
    world = len(job["hosts"])
    try:
        import importlib
        import torch.distributed as dist
        import ringreduce
        module, name = job["fn"].split(":")
        fn = getattr(importlib.import_module(module), name)
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), world),
                                rank=rank, world_size=world)
        out = ("ok", fn(rank, world, *job["args"]))
        ringreduce.destroy()
        dist.destroy_process_group()
    except BaseException:
        out = ("error", traceback.format_exc())
    with open(os.path.join(tmp, f"rank{rank}.pkl.part"), "wb") as f:
        pickle.dump(out, f)
    os.rename(os.path.join(tmp, f"rank{rank}.pkl.part"), os.path.join(tmp, f"rank{rank}.pkl"))


if __name__ == "__main__":
    tmp, mode, arg = sys.argv[1:4]
    _host(tmp, arg) if mode == "host" else _rank(tmp, int(arg))
