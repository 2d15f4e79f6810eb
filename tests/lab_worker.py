"""A rank started by torchrun inside an emulated host (tests/test_lab.py):

    python lab_worker.py OUT_DIR MODE

joins the group over the lab's network (env://, GLOO_SOCKET_IFNAME), runs MODE and writes its
result, or its traceback, to OUT_DIR/rank<R>.json.

MODE exact: all_reduce and reduce_scatter_tensor with every wire, SUM and AVG, float32 and
bfloat16, in place and async, compared bit for bit with tests/reference.py's hosts references
(the host layout from the ranks' RINGREDUCE_HOST_ID); then a float32 all_reduce of integers.
MODE victim: 16 MiB bf16-wire all_reduces until one fails (the test takes a host away); the
error, how long the failing call took, and what a later call says.
"""
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ringreduce as rr  # noqa: E402


def exact(rank, world):
    from test_hosts import wire_hosts_worker
    hosts = [None] * world
    dist.all_gather_object(hosts, os.environ["RINGREDUCE_HOST_ID"])
    failures, digests, plan = wire_hosts_worker(rank, world, hosts, (1, 129, 5000, 70001),
                                                (torch.float32, torch.bfloat16))
    t = torch.arange(300001, dtype=torch.float32) + rank  # integers: exact in any order
    rr.all_reduce(t)
    want = torch.arange(300001, dtype=torch.float32) * world + world * (world - 1) // 2
    if not torch.equal(t, want):
        failures.append("float32 all_reduce of integers")
    return {"failures": failures, "digests": digests, "hosts": hosts, "plan": list(plan)}


def victim(rank, world):
    comm = rr.get_communicator()
    t = torch.ones(4 << 20)
    ready = os.path.join(sys.argv[1], f"calls{rank}")
    for i in range(100000):
        start = time.monotonic()
        try:
            rr.all_reduce(t, wire_dtype=torch.bfloat16)
        except Exception as e:
            took, error = time.monotonic() - start, [type(e).__name__, str(e)]
            break
        t.fill_(1)
        if i == 2:
            open(ready, "w").close()  # the test takes the host away once every rank is here
    else:
        return {"error": None}
    start = time.monotonic()
    try:
        rr.all_reduce(torch.ones(8), wire_dtype=torch.bfloat16)
        again = "no error"
    except Exception as e2:
        again = str(e2)
    return {"error": error, "took": took, "timeout": comm.timeout,
            "again": again, "again_took": time.monotonic() - start}


def main():
    out, mode = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        res = {"ok": globals()[mode](rank, world)}
    except BaseException:
        res = {"error": traceback.format_exc()}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    if mode == "victim":  # the group is broken: leave without a teardown that would wait on it
        os._exit(0)
    rr.destroy() if hasattr(rr, "destroy") else None
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
