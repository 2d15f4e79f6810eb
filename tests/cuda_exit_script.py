"""Run by tests/test_cuda.py under torchrun: a CUDA process that used ringreduce must exit with
status 0 however it ends (the first GPU run crashed every one at exit). Each rank prints
'rank R ok: <mode>' as its last line before it exits.

    torchrun --standalone --nproc-per-node=2 tests/cuda_exit_script.py MODE

MODE:
  free_after_destroy  tensors of every kind of call (sync, async, non-contiguous) freed after
                      rr.destroy() and dist.destroy_process_group()
  no_destroy          never calls rr.destroy(): closed at exit, tensors and Works still alive
  ddp_hook            a DDP model with rr.ddp.allreduce_hook, a few steps
  graph_after_destroy a CUDA graph with a captured all_reduce outlives rr.destroy(): replayed after
                      it (stops at its first wait: no use of freed memory), then freed at exit
  streams_reused      a second communicator after destroy takes the first one's stream (never
                      destroyed) from the free list
"""
import os
import sys

import torch
import torch.distributed as dist

import ringreduce as rr

# What must outlive main(): freed by the interpreter's shutdown, after the exit-time close.
KEEP = []


def main(mode):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    keep = KEEP if mode in ("no_destroy", "graph_after_destroy") else []
    if mode in ("free_after_destroy", "no_destroy"):
        t = torch.full((1 << 20,), float(rank + 1), device=dev)
        rr.all_reduce(t)
        w = rr.all_reduce(torch.ones(4099, device=dev), async_op=True)
        nc = torch.ones(64, 64, device=dev).t()  # non-contiguous: a copy and a write back
        w2 = rr.all_reduce(nc, async_op=True)
        out = torch.empty(1000, device=dev)
        rr.reduce_scatter_tensor(out, torch.ones(1000 * world, device=dev))
        assert t[0].item() == world * (world + 1) / 2
        w.wait()
        w2.wait()
        keep += [t, w, nc, w2, out, w.get_future()]
        del t, w, nc, w2, out  # only keep refers to them now
        if mode == "free_after_destroy":
            torch.cuda.synchronize()
            rr.destroy()
            dist.destroy_process_group()
            del keep[:]  # every tensor and Work freed here, after the communicators closed
            torch.cuda.synchronize()
    elif mode == "ddp_hook":
        from torch.nn.parallel import DistributedDataParallel as DDP
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                        torch.nn.Linear(256, 8)).to(dev), device_ids=[dev.index])
        model.register_comm_hook(None, rr.ddp.allreduce_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(5):
            x = torch.randn(32, 64, device=dev) + rank
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        grad = next(model.parameters()).grad.cpu()
        gathered = [torch.empty_like(grad) for _ in range(world)]
        dist.all_gather(gathered, grad)  # the averaged gradients are the same bits everywhere
        assert all(torch.equal(g, grad) for g in gathered)
        keep += [model, opt]
    elif mode == "graph_after_destroy":
        os.environ.setdefault("RINGREDUCE_TRANSPORT", "p2p")
        t = torch.ones(1 << 16, device=dev)
        rr.all_reduce(t)  # the communicator exists before the capture
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            rr.all_reduce(t)  # warm-up on the side stream, as torch's docs ask
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            rr.all_reduce(t)
        g.replay()
        torch.cuda.synchronize()
        dist.barrier()
        rr.destroy()
        g.replay()  # the ring is closed; its memory is pinned by the graph: stops, no fault
        torch.cuda.synchronize()
        dist.barrier()  # no rank exits while another's replay may still run
        keep += [g, t]  # the graph is freed at exit
    elif mode == "streams_reused":
        from ringreduce import _C
        t = torch.ones(1000, device=dev)
        rr.all_reduce(t)
        before = _C.cuda_free_streams(dev.index)
        rr.destroy()
        after_destroy = _C.cuda_free_streams(dev.index)
        assert after_destroy == before + 1, (before, after_destroy)
        rr.all_reduce(t)  # a new communicator: takes the stream back
        assert _C.cuda_free_streams(dev.index) == before, _C.cuda_free_streams(dev.index)
        assert t[0].item() == world * world, t[0].item()
        keep += [t]
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    torch.cuda.synchronize()
    sys.stdout.write(f"rank {rank} ok: {mode}\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1])
