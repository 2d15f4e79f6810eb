"""Auto's steps measured on the machine (ringreduce/_calibrate.py, issue 85): which source a group
runs (a table entry, a calibration, neither), the cache, and ranks agreeing."""
import glob
import json
import os
import time

import pytest
import torch
import torch.distributed as dist

import ringreduce as rr
from dist_utils import run_ranks


def cal_worker(rank, world, env):
    os.environ.update(env)
    if "CACHE_OF_RANK" in env:  # each rank its own cache folder
        os.environ["XDG_CACHE_HOME"] = os.path.join(env["CACHE_OF_RANK"], str(rank))
    rr._read_environment()  # RINGREDUCE_DETERMINISTIC is read at the import
    g = dist.new_group()
    t = (torch.arange(1 << 22, dtype=torch.float32) % 977) * (rank + 1) / 7  # 16 MiB
    rr.all_reduce(t, group=g)
    comm = rr.get_communicator(g)
    return {"source": comm.tuning_source, "steps": comm.auto_steps, "tuning": comm.tuning,
            "algos": {s: comm.algo_for(s // 4, torch.float32) for s in (1 << 20, 4 << 20, 16 << 20)},
            "bits": t.numpy().tobytes()}


def run(world, tmp_path, **env):
    env = dict({"XDG_CACHE_HOME": str(tmp_path / "cache"), "RINGREDUCE_CALIBRATE": "auto"}, **env)
    outs = run_ranks(world, cal_worker, env, timeout=180)
    for o in outs[1:]:  # every rank runs rank 0's steps, and gets its bits
        assert (o["source"], o["steps"], o["algos"]) == (outs[0]["source"], outs[0]["steps"],
                                                         outs[0]["algos"]), (o, outs[0])
        assert o["bits"] == outs[0]["bits"]
    return outs[0]


def cache_files(tmp_path):
    return glob.glob(str(tmp_path / "cache" / "ringreduce" / "cpu-*.json"))


@pytest.mark.parametrize("world", [2, 4])
def test_fresh_calibration_is_cached_and_read_again(tmp_path, world):
    first = run(world, tmp_path)
    assert first["source"] == "calibration (fresh)", first["tuning"]
    assert first["tuning"].startswith("calibration (fresh, "), first["tuning"]
    files = cache_files(tmp_path)
    assert len(files) == 1, files
    data = json.load(open(files[0]))
    assert data["key"]["world"] == world and data["key"]["cpu_model"] == rr._shm.cpu_model()
    assert {a for a in data["median_us"]} >= {"ring", "twoshot"}
    # cma is timed in whole chunks beside its blocks (or neither, where the probe denies cma)
    assert ("cma" in data["median_us"]) == ("cmawhole" in data["median_us"]), data["median_us"]
    assert (data["key"]["format"], data["key"]["cma_block_bytes"]) == (4, rr._C.SHM_SLICE_BYTES)
    assert [tuple(s) for s in data["steps"]] == first["steps"] and first["steps"]
    second = run(world, tmp_path)
    assert second["source"] == "calibration (cached)", second["tuning"]
    assert second["steps"] == first["steps"] and second["algos"] == first["algos"]
    # what the steps say is what runs: the cached file names the algorithm at 16 MiB
    assert second["algos"][16 << 20] == [a for b, a in first["steps"] if b <= 16 << 20][-1]


def run_with_cached_steps(tmp_path, steps):
    """Calibrates once, writes steps into the cache file by hand, runs again."""
    run(2, tmp_path)
    path, = cache_files(tmp_path)
    data = json.load(open(path))
    data["steps"] = steps
    json.dump(data, open(path, "w"))
    return run(2, tmp_path)


def test_a_cached_file_chooses_the_algorithm(tmp_path):
    """A cache file written by hand (the steps of another run) is what every rank runs."""
    out = run_with_cached_steps(tmp_path, [[1 << 20, "twoshot"], [3 << 20, "ring"], [8 << 20, "twoshot"]])
    assert out["source"] == "calibration (cached)"
    assert out["algos"] == {1 << 20: "twoshot", 4 << 20: "ring", 16 << 20: "twoshot"}, out["algos"]


def test_a_cached_cmawhole_step_runs_cma_in_whole_chunks(tmp_path):
    """The step the calibration records for cma reading whole chunks is what runs (run() checks
    every rank's bits)."""
    out = run_with_cached_steps(tmp_path, [[1 << 20, "cma"], [3 << 20, "cmawhole"], [8 << 20, "twoshot"]])
    assert out["source"] == "calibration (cached)"
    assert out["algos"] == {1 << 20: "cma", 4 << 20: "cmawhole", 16 << 20: "twoshot"}, out["algos"]


def test_an_old_format_cache_is_recalibrated(tmp_path):
    """A format-1 file (steps without cmawhole, a key without cma's block) is not this machine's."""
    run(2, tmp_path)
    path, = cache_files(tmp_path)
    data = json.load(open(path))
    data["key"]["format"] = 1
    del data["key"]["cma_block_bytes"]
    json.dump(data, open(path, "w"))
    out = run(2, tmp_path)
    assert out["source"] == "calibration (fresh)", out["tuning"]
    assert json.load(open(path))["key"]["format"] == 4


def test_every_rank_runs_rank_0s_steps(tmp_path):
    """Rank 1's own cache says something else: rank 0's file decides for the group."""
    run(2, tmp_path)
    path, = cache_files(tmp_path)
    data = json.load(open(path))
    for rank, steps in ((0, [[1 << 20, "twoshot"]]), (1, [[1 << 20, "ring"]])):
        os.makedirs(tmp_path / "own" / str(rank) / "ringreduce")
        json.dump(dict(data, steps=steps),
                  open(tmp_path / "own" / str(rank) / "ringreduce" / os.path.basename(path), "w"))
    out = run(2, tmp_path, CACHE_OF_RANK=str(tmp_path / "own"))  # run() checks the ranks agree
    assert out["source"] == "calibration (cached)" and set(out["algos"].values()) == {"twoshot"}


def test_a_corrupt_cache_is_ignored_with_a_warning(tmp_path):
    run(2, tmp_path)
    path, = cache_files(tmp_path)
    open(path, "w").write('{"key": ')
    out = run(2, tmp_path)
    assert out["source"] == "calibration (fresh)", out["tuning"]
    json.load(open(path))  # rewritten whole


def test_corrupt_and_foreign_cache_files_warn(tmp_path):
    from ringreduce import _calibrate
    key = _calibrate.machine_key("X", 2, 2, 131072)
    p = tmp_path / "c.json"
    p.write_text("not json")
    with pytest.warns(UserWarning, match="calibration cache .* ignored"):
        assert _calibrate.read_cache(str(p), key) is None
    _calibrate.write_cache(str(p), dict(key, world=4), [(1 << 20, "ring")], {})
    with pytest.warns(UserWarning, match="is not this machine's"):
        assert _calibrate.read_cache(str(p), key) is None
    _calibrate.write_cache(str(p), key, [(1 << 20, "fastest")], {})
    with pytest.warns(UserWarning, match="bad steps"):
        assert _calibrate.read_cache(str(p), key) is None
    _calibrate.write_cache(str(p), key, [(1 << 20, "cma")], {})
    assert _calibrate.read_cache(str(p), key)[0] == [(1 << 20, "cma")]
    assert _calibrate.read_cache(str(tmp_path / "none.json"), key) is None  # no file: no warning


def test_force_recalibrates(tmp_path):
    run(2, tmp_path)
    path, = cache_files(tmp_path)
    data = json.load(open(path))
    data["steps"] = [[1 << 20, "twoshot"]]
    data["median_us"] = "marker"
    json.dump(data, open(path, "w"))
    out = run(2, tmp_path, RINGREDUCE_CALIBRATE="force")
    assert out["source"] == "calibration (fresh)"
    assert json.load(open(path))["median_us"] != "marker"


def test_table_then_defaults_when_calibration_is_off(tmp_path):
    from ringreduce import _shm
    entry = {"cpu_model": _shm.cpu_model(), "cores": len(os.sched_getaffinity(0)), "world": 2,
             "oneshot_max": 2048, "steps": [[1 << 20, "twoshot"], [8 << 20, "ring"]],
             "date": "test", "command": "test"}
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"entries": [entry]}))
    out = run(2, tmp_path, RINGREDUCE_CALIBRATE="0", RINGREDUCE_CPU_TUNING=str(table))
    assert out["source"] == "table" and "not calibrated: RINGREDUCE_CALIBRATE=off" in out["tuning"]
    assert out["algos"] == {1 << 20: "twoshot", 4 << 20: "twoshot", 16 << 20: "ring"}
    out = run(2, tmp_path, RINGREDUCE_CALIBRATE="off", RINGREDUCE_CPU_TUNING="none")
    assert out["source"] == "defaults" and out["steps"] == []
    assert set(out["algos"].values()) == {"ring"}
    assert not cache_files(tmp_path)
    # calibration on: it runs over the table, whose steps stay below its first size
    out = run(2, tmp_path, RINGREDUCE_CPU_TUNING=str(table))
    assert out["source"] == "calibration (fresh)" and "over measured on " in out["tuning"]


def test_no_calibration_where_it_cannot_apply(tmp_path):
    out = run(2, tmp_path, RINGREDUCE_ALGO="twoshot")
    assert out["source"] == "defaults" and "not calibrated: an algorithm is forced" in out["tuning"]
    out = run(2, tmp_path, RINGREDUCE_DETERMINISTIC="1")
    assert out["source"] == "defaults" and "not calibrated: deterministic mode" in out["tuning"]
    assert not cache_files(tmp_path)


def test_bad_calibrate_value():
    from ringreduce import _shm
    os.environ["RINGREDUCE_CALIBRATE"] = "sometimes"
    try:
        with pytest.raises(ValueError, match="RINGREDUCE_CALIBRATE must be one of auto, off, 0, "
                                             r"force \(.*\), got 'sometimes'"):
            _shm.calibrate_from_env()
    finally:
        os.environ["RINGREDUCE_CALIBRATE"] = "off"


def test_derive_steps():
    from ringreduce._calibrate import derive_steps
    M = 1 << 20
    med = {"ring": {M: 100, 4 * M: 400, 16 * M: 1600},
           "twoshot": {M: 95, 4 * M: 300, 16 * M: 1700},
           "cma": {M: 200, 4 * M: 380, 16 * M: 1000}}
    # 5% faster is noise (the fallback's ring stays at 1 MiB); 25% and 37% faster are not; from
    # 32 MiB (nothing timed there) the fallback's choice again
    assert derive_steps(med, []) == [(M, "ring"), (2 * M, "twoshot"), (8 * M, "cma"), (32 * M, "ring")]
    # the fallback's steps below 1 MiB stay, its twoshot where it measured fastest, and above
    assert derive_steps(med, [(65536, "twoshot")]) == [(65536, "twoshot"), (8 * M, "cma"),
                                                       (32 * M, "twoshot")]
    # the fallback's steps beyond the reach stay as they are
    assert derive_steps(med, [(64 * M, "cma")]) == [(M, "ring"), (2 * M, "twoshot"), (8 * M, "cma"),
                                                    (32 * M, "ring"), (64 * M, "cma")]
    # the fallback's cma at 16 MiB is kept where nothing beats it by the margin
    med["ring"][16 * M] = 950
    assert derive_steps(med, [(8 * M, "cma")]) == [(M, "ring"), (2 * M, "twoshot"), (8 * M, "cma")]
    # an algorithm the fallback names but the calibration could not time (cma denied): the ring
    del med["cma"]
    assert derive_steps(med, [(4 * M, "cma")]) == [(M, "ring"), (2 * M, "twoshot"), (8 * M, "ring")]
    assert derive_steps(med, [(64 * M, "cma")]) == [(M, "ring"), (2 * M, "twoshot"), (8 * M, "ring")]
    # cma in whole chunks is a candidate of its own: it wins where it is the margin faster
    med["cma"] = {M: 200, 4 * M: 380, 16 * M: 1000}
    med["cmawhole"] = {M: 210, 4 * M: 250, 16 * M: 960}
    assert derive_steps(med, []) == [(M, "ring"), (2 * M, "cmawhole"), (8 * M, "ring")]
    assert derive_steps(med, [(8 * M, "cma")]) == [(M, "ring"), (2 * M, "cmawhole"), (8 * M, "cma")]


class ColdCacheNative:
    """A stand-in for the native ring whose calls cost the algorithm's time, plus a cold penalty
    where the call before it was another algorithm or another buffer (the cache the real one
    evicts): what the calibration must not measure."""
    COST_S = {"ring": 0.002, "twoshot": 0.004, "cma": 0.006}
    COLD_S = 0.020

    def __init__(self):
        self.algo, self.last, self.calls = None, None, []

    def set_auto_steps(self, steps):
        (_, self.algo), = steps

    def all_reduce(self, t, op, deterministic, timeout):
        if t.numel() == 1:  # the budget's verdict
            return
        state = (self.algo, t.numel())
        self.calls.append(state)
        time.sleep(self.COST_S[self.algo] + (self.COLD_S if state != self.last else 0))
        self.last = state


def test_algorithms_are_timed_warm():
    from ringreduce._calibrate import CALLS, time_algos
    native = ColdCacheNative()
    algos = ["ring", "twoshot", "cma"]
    sizes = (1 << 10, 1 << 12)
    med = time_algos(native, algos, rr._C.OP_CODES, 0, sizes=sizes, rounds=3, budget_s=60)
    for a in algos:  # each algorithm's own cost, not the penalty for the one before it
        for s in sizes:
            assert native.COST_S[a] * 1e6 <= med[a][s] < (native.COST_S[a] + 0.010) * 1e6, med
    # every timed call followed a call of its own; the order of the algorithms turned
    n = 1 + CALLS
    assert all(len(set(native.calls[i:i + n])) == 1 for i in range(0, len(native.calls), n))
    firsts = {native.calls[i][0] for i in range(0, len(native.calls), n * len(algos))}
    assert firsts == set(algos), native.calls
