"""cma's read size (cma_block_bytes, RINGREDUCE_CMA_BLOCK_BYTES; issue 85 item 2): every block size,
whole chunks included, gives the bits of today's block and of two-shot (both fold in rank order),
and of the ring on integers; on every rank; all_reduce and reduce_scatter, in place and out of it."""
import hashlib
import json
import os

import pytest
import torch
import torch.distributed as dist

import ringreduce as rr
from dist_utils import run_ranks

SLICE = 4096  # small, so that the slice (the default block) means many reads per chunk
# name: the Communicator's arguments. 12 and 12292 bytes: blocks of odd element counts (fp32:
# 3 and 3073; bf16: 6 and 6146); 1 << 62: larger than any chunk (the whole chunk).
VARIANTS = {"slice": dict(algo="cma"), "whole": dict(algo="cma", cma_block_bytes=0),
            "tiny": dict(algo="cma", cma_block_bytes=12), "odd": dict(algo="cma", cma_block_bytes=12292),
            "huge": dict(algo="cma", cma_block_bytes=1 << 62), "twoshot": dict(algo="twoshot"),
            "ring": dict(algo="ring")}
NUMELS = [0, 1, 2, 3, 7, 1001, 40013, 262147]
CASES = [(torch.float32, "SUM"), (torch.float32, "AVG"), (torch.bfloat16, "SUM"),
         (torch.int32, "SUM"), (torch.int32, "MAX")]


def digest(t):
    return hashlib.sha1(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def make(rank, numel, dtype, seed):
    g = torch.Generator().manual_seed(seed * 131 + rank)
    if dtype == torch.int32:
        return torch.randint(-1000, 1000, (numel,), generator=g, dtype=torch.int32)
    return (torch.randn(numel, generator=g) * 10 ** (rank % 3)).to(dtype)


def blocks_worker(rank, world, numels, variants):
    from ringreduce import _C, _shm
    comms = {v: _shm.Communicator(dist.new_group(), slice_bytes=SLICE, **VARIANTS[v]) for v in variants}
    out = {}
    for dtype, op in CASES:
        code = _C.OP_CODES[op]
        for numel in numels:
            base = make(rank, numel, dtype, numel)
            rs_in = make(rank, numel * world, dtype, numel + 7)
            for v, comm in comms.items():
                t = base.clone()
                comm.all_reduce(t, code, False)
                o = torch.empty(numel, dtype=dtype)
                comm.reduce_scatter(o, rs_in.clone(), code, False)
                buf = rs_in.clone()  # in place: the output is this rank's chunk of the input
                comm.reduce_scatter(buf[rank * numel:(rank + 1) * numel], buf, code, False)
                out[f"{dtype} {op} {numel} {v}"] = (digest(t), digest(o),
                                                     digest(buf[rank * numel:(rank + 1) * numel]))
    for comm in comms.values():
        comm.close()
    return out


def check_same(outs, numels, variants):
    for o in outs[1:]:  # all_reduce: the same bits on every rank
        assert [v[0] for v in o.values()] == [v[0] for v in outs[0].values()]
    for rank, o in enumerate(outs):
        for dtype, op in CASES:
            # floats: rank order (cma, two-shot); integers: the ring too (exact)
            same = [v for v in variants if v != "ring" or dtype == torch.int32]
            for numel in numels:
                got = {v: o[f"{dtype} {op} {numel} {v}"] for v in same}
                want = got[same[0]]
                assert want[1] == want[2], (rank, dtype, op, numel)  # in place = out of place
                assert all(g == want for g in got.values()), (rank, dtype, op, numel, got)


@pytest.mark.parametrize("world", [2, 3])
def test_every_block_size_gives_the_same_bits(world):
    variants = list(VARIANTS)
    outs = run_ranks(world, blocks_worker, NUMELS, variants, timeout=300)
    check_same(outs, NUMELS, variants)


def test_world_4_whole_chunks():
    numels, variants = [5, 40013], ["slice", "whole", "twoshot", "ring"]
    check_same(run_ranks(4, blocks_worker, numels, variants, timeout=300), numels, variants)


def options_worker(rank, world):
    from ringreduce import _shm
    out = {}
    for bad in (-1, 1.5, "1M", True, None):
        try:
            if bad is None:  # the environment's bad value
                os.environ["RINGREDUCE_CMA_BLOCK_BYTES"] = "-5"
                _shm.Communicator(dist.new_group(), algo="cma")
            else:
                _shm.Communicator(dist.new_group(), algo="cma", cma_block_bytes=bad)
            out[repr(bad)] = "no error"
        except ValueError as e:
            out[repr(bad)] = str(e)
        finally:
            os.environ.pop("RINGREDUCE_CMA_BLOCK_BYTES", None)
    names = {}
    for env, kw in (("", {}), ("0", {}), ("65536", {}), ("", {"cma_block_bytes": 0})):
        if env:
            os.environ["RINGREDUCE_CMA_BLOCK_BYTES"] = env
        comm = _shm.Communicator(dist.new_group(), algo="cma", **kw)
        os.environ.pop("RINGREDUCE_CMA_BLOCK_BYTES", None)
        names[f"{env} {kw}"] = (comm.cma_block_bytes, comm.algo_for(1 << 20, torch.float32))
        comm.close()
    out["names"] = names
    return out


def test_options_and_their_bad_values():
    out = run_ranks(2, options_worker, timeout=120)[0]
    want = "ringreduce: cma_block_bytes must be an integer >= 0 (the bytes cma reads from a peer at a time; 0: the whole chunk), got "
    for bad in ("-1", "1.5", "'1M'", "True"):
        assert out[bad] == want + bad, out
    assert out["None"] == ("ringreduce: RINGREDUCE_CMA_BLOCK_BYTES must be an integer >= 0 (what cma "
                           "reads from a peer at a time, bytes; 0: the whole chunk), got '-5'"), out
    s = rr._C.SHM_SLICE_BYTES
    assert out["names"] == {" {}": (s, "cma"), "0 {}": (0, "cmawhole"), "65536 {}": (65536, "cma"),
                            " {'cma_block_bytes': 0}": (0, "cmawhole")}, out["names"]


def steps_worker(rank, world, table, deterministic):
    os.environ["RINGREDUCE_CPU_TUNING"] = table
    rr.set_deterministic(deterministic)
    g = dist.new_group()
    t = make(rank, 1 << 20, torch.float32, 3)  # 4 MiB: the cmawhole step
    rr.all_reduce(t, group=g)
    comm = rr.get_communicator(g)
    return {"picks": {b: comm.algo_for(b // 4, torch.float32) for b in (1 << 20, 4 << 20)},
            "steps": comm.auto_steps, "bits": digest(t)}


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_table_step_names_cmawhole(tmp_path, deterministic):
    """A table's (or a calibration's) "cmawhole" step runs cma in whole chunks, in deterministic
    mode too; its bits are cma's."""
    from ringreduce import _shm
    entry = {"cpu_model": _shm.cpu_model(), "cores": len(os.sched_getaffinity(0)), "world": 2,
             "oneshot_max": 1024, "steps": [[1 << 20, "cma"], [2 << 20, "cmawhole"]]}
    table = tmp_path / "t.json"
    table.write_text(json.dumps({"entries": [entry]}))
    env = {"RINGREDUCE_CALIBRATE": "off"}
    outs = run_ranks(2, steps_worker, str(table), deterministic, env=env, timeout=120)
    assert outs[0]["picks"] == {1 << 20: "cma", 4 << 20: "cmawhole"}, outs[0]
    assert outs[0]["steps"] == [(1 << 20, "cma"), (2 << 20, "cmawhole")]
    assert outs[1]["bits"] == outs[0]["bits"]
    entry["steps"] = [[1 << 20, "cma"]]  # cma's bits, at its default block
    table.write_text(json.dumps({"entries": [entry]}))
    again = run_ranks(2, steps_worker, str(table), deterministic, env=env, timeout=120)
    assert again[0]["picks"][4 << 20] == "cma" and again[0]["bits"] == outs[0]["bits"]


def test_without_cma_drops_both_names():
    from ringreduce import _shm
    assert _shm.without_cma([(1, "cma"), (5, "cmawhole"), (9, "twoshot")]) == [
        (1, "ring"), (5, "ring"), (9, "twoshot")]
