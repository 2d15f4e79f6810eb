"""What going on without a lost rank costs (docs/failures.md, shrink_group): from a SIGKILL to the
survivors' next completed all_reduce, in its parts, by world size and plan.

    python benchmarks/shrink_cost.py [--worlds 3,4,6] [--repeat 3] [--hosts 1,3]

Each run: `world` processes join a ringreduce default group on a TCPStore this script holds (as
torchrun's agent holds one); every rank runs 1 MiB all_reduces; the last rank SIGKILLs itself
between calls (hosts > 1: the last host's ranks all die, as a host does). The survivors time, from
the kill (its wall-clock time, written before it): detect (their call raises), lost_ranks (they
agree who is gone), shrink (dist.shrink_group), first call (the new group's first all_reduce,
which creates its communicator) and the total. Medians over --repeat runs of the slowest
survivor. Simulated hosts (RINGREDUCE_HOST_ID) share this machine: the inter-host step runs over
loopback TCP. The elastic recipe's restart on the same machine class is in docs/training.md
(6.7-7.8 s from the death to the first step, 3 ranks).
"""
import argparse
import json
import multiprocessing as mp
import os
import signal
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTS = ("detect", "lost_ranks", "shrink", "first_call", "total")


def rank_main(rank, world, hosts, port, victims, out):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if hosts > 1:
        os.environ["RINGREDUCE_HOST_ID"] = f"h{rank * hosts // world}"
    sys.path.insert(0, ROOT)
    import torch
    import torch.distributed as dist
    import ringreduce as rr
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    dist.init_process_group("ringreduce", store=store, rank=rank, world_size=world)
    t = torch.ones(1 << 18)
    for _ in range(5):
        dist.all_reduce(t)
    if rank in victims:
        if rank == max(victims) and len(victims) > 1:
            time.sleep(0.2)  # the others first
        store.set(f"killed/{rank}", repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    times = {}
    try:
        while True:
            dist.all_reduce(t)
    except RuntimeError:
        times["detect"] = time.time()
    lost = rr.lost_ranks()
    times["lost_ranks"] = time.time()
    dist.shrink_group(lost)
    times["shrink"] = time.time()
    x = torch.ones(1 << 18)
    dist.all_reduce(x)
    times["first_call"] = time.time()
    killed = min(float(store.get(f"killed/{v}")) for v in victims)
    prev, row = killed, {}
    for part in PARTS[:-1]:
        row[part], prev = times[part] - prev, times[part]
    row["total"] = times["first_call"] - killed
    ok = x[0].item() == world - len(victims) and lost == sorted(victims)
    with open(out, "w") as f:
        json.dump({"row": row, "ok": ok}, f)
    dist.destroy_process_group()


def one_run(world, hosts, tmp):
    import torch.distributed as dist
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    per_host = world // hosts
    victims = list(range(world - per_host, world)) if hosts > 1 else [world - 1]
    ctx = mp.get_context("spawn")
    outs = [os.path.join(tmp, f"r{world}-{hosts}-{r}.json") for r in range(world)]
    for o in outs:
        if os.path.exists(o):
            os.unlink(o)
    procs = [ctx.Process(target=rank_main, args=(r, world, hosts, server.port, victims, outs[r]))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        if p.is_alive():
            p.kill()
    rows = []
    for r in range(world):
        if r in victims:
            continue
        with open(outs[r]) as f:
            got = json.load(f)
        if not got["ok"]:
            raise SystemExit(f"world {world}, hosts {hosts}: rank {r}'s result is wrong")
        rows.append(got["row"])
    return {part: max(row[part] for row in rows) for part in PARTS}  # the slowest survivor


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="3,4,6")
    ap.add_argument("--hosts", default="1,3", help="1: one host (shared memory); H > 1: H "
                    "simulated hosts, the last one lost whole")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    import tempfile
    tmp = tempfile.mkdtemp(prefix="rr-shrink-")
    print(f"# {os.uname().nodename}, {os.cpu_count()} CPUs; ms from the SIGKILL, median of "
          f"{args.repeat} runs of the slowest survivor")
    print("| world | hosts | lost | plan after | " + " | ".join(PARTS) + " |")
    print("|---:|---:|---:|---|" + "---:|" * len(PARTS))
    for hosts in [int(h) for h in args.hosts.split(",")]:
        for world in [int(w) for w in args.worlds.split(",")]:
            if world % hosts:
                continue
            runs = [one_run(world, hosts, tmp) for _ in range(args.repeat)]
            med = {p: statistics.median(r[p] for r in runs) * 1e3 for p in PARTS}
            lost = world // hosts if hosts > 1 else 1
            left_hosts = hosts - 1 if hosts > 1 else 1
            plan = "shm" if left_hosts == 1 else f"two-level, {left_hosts} hosts"
            print(f"| {world} | {hosts} | {lost} | {plan} | " +
                  " | ".join(f"{med[p]:.0f}" for p in PARTS) + " |", flush=True)


if __name__ == "__main__":
    main()
