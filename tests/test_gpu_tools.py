"""The GPU tools that need no GPU to check: benchmarks/gpu_roofline.py and gpu_tune.py arithmetic, the table auto reads, the warning for ranks sharing a GPU without MPS."""
import importlib.util
import os
import pathlib

import pytest
import torch.distributed as dist

from ringreduce import _C

spec = importlib.util.spec_from_file_location(
    "gpu_roofline", pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_roofline.py")
roof = importlib.util.module_from_spec(spec)
spec.loader.exec_module(roof)


def test_hbm_limit_counts_every_input_read_and_output_written():
    # world 2, 256 MiB per rank, 2.9 TB/s: 4 x 256 MiB at 2.9e12 B/s = 370 us (DESIGN.md's figure)
    assert roof.hbm_limit_us(2, 256 << 20, 2900) == pytest.approx(370.2, abs=0.1)


def test_bench_rows_in_place_times_and_a_cut_short_run():
    # what ringreduce.bench prints (report._ROW): out-of-place then in-place time/algbw/busbw/#wrong
    printed = "\n".join([
        "# all_reduce  nranks 2  device cuda",
        "#     size(B)        count     type  redop          backend    time(us) ...",
        "        4096         1024    float    sum   ringreduce/p2p        25.0    0.164    0.164      0        20.0    0.205    0.205      0",
        "        8192         2048    float    sum   ringreduce/p2p        31.0    0.264    0.264      0        30.0    0.273    0.273      3",
        "       16384         4096    float    sum   ringreduce/p2p        33.0    0.496    0.496    N/A        32.5    0.504    0.504    N/A",
        "       65536        16384    float    sum   ringreduce/p2p        4",  # killed mid-line
    ])
    # a row with wrong elements is not a time; an unchecked (N/A) one is
    assert roof.parse_rows(printed) == {4096: 20.0, 16384: 32.5}


def test_table_fraction_and_ratio():
    s = 256 << 20
    results = {("on", 2, "auto"): {s: 740.4}, ("off", 2, "auto"): {s: 2221.2},
               ("on", 2, "oneshot"): {s: 17031.5}}
    text = roof.table(results, 2900, [s])
    rows = [line for line in text.splitlines() if line.startswith("| 2 |")]
    assert rows[0] == "| 2 | 256 MiB | auto | 740.4 | 0.50 | 2,221.2 | 3.0x |", rows
    assert rows[1] == "| 2 | 256 MiB | oneshot | 17,031.5 | 0.02 | - | - |", rows


@pytest.mark.parametrize("text,value", [("4K", 4096), ("256M", 256 << 20), ("1MiB", 1 << 20), ("100", 100)])
def test_sizes(text, value):
    assert roof.parse_size(text) == value


def test_algorithms_with_blocks_checked(tmp_path):
    for bad in ("twoshot@", "twoshot@0", "twoshot@65", "tree@8", "twoshot@x"):
        with pytest.raises(SystemExit):
            roof.main(["--algos", bad, "--out", str(tmp_path / "r.md")])


def test_algorithms_with_blocks_in_the_table():
    assert roof.split_algo("twoshot@64") == ("twoshot", 64) and roof.split_algo("auto") == ("auto", None)
    names = roof.row_names(["twoshot@64", "registered@64", "twoshot@48", "twoshot"])
    assert names.index("twoshot") < names.index("twoshot@48") < names.index("twoshot@64")
    assert names.index("torch/symm-twoshot-sym") < names.index("registered@64")
    rows = roof.table({("on", 2, "twoshot@64"): {256 << 20: 600.0}}, 4175, [256 << 20])
    assert "| 2 | 256 MiB | twoshot@64 | 600.0 | 0.43 |" in rows


# -- benchmarks/gpu_tune.py and the table auto reads (ringreduce._cuda.tuned_threshold) --------
spec_t = importlib.util.spec_from_file_location(
    "gpu_tune", pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_tune.py")
tune = importlib.util.module_from_spec(spec_t)
spec_t.loader.exec_module(tune)

K, M = 1 << 10, 1 << 20


def test_threshold_follows_the_faster_direct_algorithm():
    sizes = [4 * K, 64 * K, 1 * M, 16 * M, 256 * M]
    times = {"oneshot": {4 * K: 10, 64 * K: 14, 1 * M: 60, 16 * M: 900, 256 * M: 17000},
             "twoshot": {4 * K: 15, 64 * K: 18, 1 * M: 40, 16 * M: 200, 256 * M: 4800}}
    assert tune.threshold(times, sizes) == 64 * K
    # Within the margin two-shot's win is noise: one-shot keeps the size; beyond it, not.
    noisy = {"oneshot": {4 * K: 38.7, 64 * K: 36.0, 1 * M: 66.0},
             "twoshot": {4 * K: 37.2, 64 * K: 40.2, 1 * M: 55.9}}
    assert tune.threshold(noisy, sizes[:3]) == 64 * K
    # The first clear loss ends one-shot's range, whatever comes after it.
    later = {"oneshot": {4 * K: 10, 64 * K: 30, 1 * M: 40}, "twoshot": {4 * K: 11, 64 * K: 20, 1 * M: 80}}
    assert tune.threshold(later, sizes[:3]) == 4 * K


def test_threshold_when_one_shot_never_wins():
    sizes = [4 * K, 1 * M]
    assert tune.threshold({"oneshot": {4 * K: 50, 1 * M: 90},
                           "twoshot": {4 * K: 40, 1 * M: 80}}, sizes) == 0
    assert tune.threshold({"twoshot": {4 * K: 20, 1 * M: 80}}, sizes) == 0  # a missing time loses


def test_profile_summary_picks_the_collectives_kernel():
    spec = importlib.util.spec_from_file_location(
        "gpu_profile", pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_profile.py")
    prof = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prof)
    # Three calls: the collective's kernel three times, a copy twice, in no particular order.
    # The first waited ~1 s for the peer's profiler: the median ignores it, as a mean would not.
    kernels = [("sym_kernel", 21.0, 3.0), ("copy", 5.0, 1.0), ("sym_kernel", 0.0, 900_000.0),
               ("sym_kernel", 10.0, 4.0), ("copy", 15.0, 1.0)]
    s = prof.summarize(kernels, 3)
    assert (s["name"], s["count"], s["median_us"], s["interval_us"]) == ("sym_kernel", 3, 4.0, 10.5)
    assert prof.summarize(kernels, 4) is None  # no kernel launched once per call


def test_tuning_entries_from_a_roofline_json():
    doc = {"device": "NVIDIA H200", "torch": "2.11.0", "copy_GBps": 4300.0, "results": [
        {"mps": "on", "world": 2, "algo": "oneshot", "median_us": {"4096": 10.0, "1048576": 90.0}},
        {"mps": "on", "world": 2, "algo": "twoshot", "median_us": {"4096": 12.0, "1048576": 40.0}},
        {"mps": "on", "world": 2, "algo": "ring", "median_us": {"4096": 30.0, "1048576": 50.0}},
        {"mps": "on", "world": 2, "algo": "auto", "median_us": {"4096": 1.0, "1048576": 1.0}},
        {"mps": "off", "world": 2, "algo": "twoshot", "median_us": {"4096": 1.0, "1048576": 1.0}}]}
    (e,) = tune.entries_from_roofline(doc, "--from x.json")
    assert (e["device"], e["world"], e["ranks_per_device"], e["mps"]) == ("NVIDIA H200", 2, 2, True)
    assert e["oneshot_max"] == 4096  # auto, ring and MPS-off rows ignored
    assert set(e["median_us"]) == {"oneshot", "twoshot"}


def test_no_entry_from_a_roofline_without_forced_runs(capsys):
    # Session 24's lease: the roofline was cut after its auto run; tuning from it wrote
    # one-shot <= 0 B (two-shot at every size) into the checked-in table.
    doc = {"device": "NVIDIA H200", "torch": "2.11.0", "copy_GBps": 4176.0, "results": [
        {"mps": "on", "world": 2, "algo": "auto", "median_us": {"4096": 15.3, "1048576": 54.6}},
        {"mps": "on", "world": 2, "algo": "oneshot", "median_us": {"4096": 15.0}}]}
    assert tune.entries_from_roofline(doc, "--from x.json") == []
    assert "world 2: no twoshot medians" in capsys.readouterr().err


def test_table_written_and_read_back(tmp_path):
    from ringreduce._cuda.policy import tuned
    table = tmp_path / "gpu_tuning.json"
    table.write_text('{"about": "", "entries": []}')
    assert tuned("NVIDIA H100 80GB HBM3", 2, 2, str(table))[:2] == (None, None)
    entry = {"device": "NVIDIA H100 80GB HBM3", "world": 2, "ranks_per_device": 2,
             "oneshot_max": 65536, "date": "2026-11-25", "command": "x"}
    tune.update_table(str(table), entry)
    tune.update_table(str(table), {**entry, "oneshot_max": 4096})  # replaced, not added
    assert tuned("NVIDIA H100 80GB HBM3", 2, 2, str(table))[:2] == (4096, None)
    tune.update_table(str(table), {**entry, "sym_blocks": 64})
    assert tuned("NVIDIA H100 80GB HBM3", 2, 2, str(table))[:2] == (65536, 64)
    assert tune.current_blocks(str(table), "NVIDIA H100 80GB HBM3", 2, 2) == 64
    limits, blocks, why = tuned("NVIDIA H100 80GB HBM3", 4, 4, str(table))
    assert (limits, blocks) == (None, None) and "no measurement for NVIDIA H100 80GB HBM3, world 4" in why


def test_more_blocks_taken_only_where_measured_faster():
    plain = {"twoshot": {64 * K: 20.0, 1 * M: 50.0, 16 * M: 90.0, 256 * M: 990.0},
             "registered": {1 * M: 50.0, 256 * M: 515.0}}
    faster = {"twoshot": {64 * K: 30.0, 1 * M: 52.0, 16 * M: 70.0, 256 * M: 600.0},
              "registered": {1 * M: 50.0, 256 * M: 330.0}}
    assert tune.sym_blocks(plain, {64: faster}) == 64
    # 64 KiB runs one block either way: its noise does not count.
    assert tune.sym_blocks(plain, {64: {**faster, "twoshot": {**faster["twoshot"], 64 * K: 90.0}}}) == 64
    # Slower beyond the margin at one size from 1 MiB, for either algorithm: the current value stays.
    slow_1m = {**faster, "twoshot": {**faster["twoshot"], 1 * M: 60.0}}
    assert tune.sym_blocks(plain, {64: slow_1m}) is None
    assert tune.sym_blocks(plain, {64: {**faster, "registered": {256 * M: 600.0}}}, 32) == 32
    # A gain within the margin is noise.
    assert tune.sym_blocks(plain, {64: {"twoshot": {1 * M: 50.0, 256 * M: 950.0}}}) is None
    # Of two that qualify, the faster at the largest size.
    assert tune.sym_blocks(plain, {48: {"twoshot": {1 * M: 50.0, 256 * M: 700.0}},
                                   64: {"twoshot": {1 * M: 50.0, 256 * M: 650.0}}}) == 64
    assert tune.sym_blocks(plain, {}) is None and tune.sym_blocks(plain, {}, 48) == 48
    # A run cut short before the plain run's largest size does not count, however fast it was.
    assert tune.sym_blocks(plain, {48: {"twoshot": {1 * M: 30.0, 16 * M: 40.0}},
                                   64: {"twoshot": {1 * M: 50.0, 256 * M: 800.0}}}) == 64


def test_blocks_entry_from_a_roofline_json(tmp_path):
    table = tmp_path / "gpu_tuning.json"
    table.write_text('{"about": "", "entries": []}')
    run = lambda algo, ts, **kw: {"mps": "on", "world": 2, "algo": algo,  # noqa: E731
                                  "median_us": {str(s): v for s, v in ts.items()}, **kw}
    results = [run("oneshot", {4 * K: 10.0, 1 * M: 90.0}), run("twoshot", {4 * K: 12.0, 1 * M: 40.0, 256 * M: 990.0}),
               run("registered", {1 * M: 30.0, 256 * M: 515.0}),
               run("torch/symm-twoshot-sym", {256 * M: 470.0}, peer_of="registered")]
    doc = {"device": "NVIDIA H200", "torch": "2.11.0", "copy_GBps": 4175.0, "results": results}
    (e,) = tune.entries_from_roofline(doc, "--from x.json", str(table))
    assert "sym_blocks" not in e and e["oneshot_max"] == 4 * K
    doc["results"] = results + [run("twoshot@64", {1 * M: 41.0, 256 * M: 700.0}),
                                run("registered@64", {1 * M: 30.0, 256 * M: 340.0})]
    (e,) = tune.entries_from_roofline(doc, "--from x.json", str(table))
    assert e["sym_blocks"] == 64 and e["oneshot_max"] == 4 * K and e["plain_sym_blocks"] is None
    assert e["median_us"]["twoshot@64"] == {str(1 * M): 41.0, str(256 * M): 700.0}
    assert "torch/symm-twoshot-sym" not in e["median_us"]
    tune.update_table(str(table), e)
    # Measured again without the variant: the table's 64 ran as "twoshot", and stays.
    doc["results"] = results
    (e,) = tune.entries_from_roofline(doc, "--from x.json", str(table))
    assert e["sym_blocks"] == 64
    # The roofline says what its plain runs had: 64 from the table, against a run at 24 that is no
    # faster: 64 stays (and the recorded runs give the same answer again).
    doc["plain_sym_blocks"] = {"2": 64}
    doc["results"] = results + [run("twoshot@24", {1 * M: 40.0, 256 * M: 985.0})]
    (e,) = tune.entries_from_roofline(doc, "--from x.json", str(table))
    assert (e["sym_blocks"], e["plain_sym_blocks"]) == (64, 64)


def test_the_checked_in_table_parses():
    import json
    from ringreduce._cuda.policy import TUNING_PATH
    doc = json.loads(pathlib.Path(TUNING_PATH).read_text())
    for e in doc["entries"]:
        assert {"device", "world", "ranks_per_device", "oneshot_max", "date", "command"} <= set(e), e


def test_ranks_sharing_a_gpu_without_mps_are_warned():
    from ringreduce._cuda.policy import sharing_warning
    assert sharing_warning(1, "cuda:0", mps=False) is None
    assert sharing_warning(2, "cuda:0", mps=True) is None
    msg = sharing_warning(2, "cuda:0", mps=False)
    assert "2 ranks share cuda:0" in msg and "nvidia-cuda-mps-control -d" in msg
    assert "RINGREDUCE_CUDA_ALGO=copy" in msg and "nvidia-cuda-mps-control -d" in msg


def test_blocks_per_call_leave_room_for_every_rank_on_a_device():
    """A p2p call's blocks: the SMs over the ranks sharing a device, the least over the group
    (the kernels of all ranks spin on each other, so all their blocks must be resident at once)."""
    from ringreduce._cuda.policy import resident_blocks
    h100 = 132
    assert resident_blocks([("a", "0:1", h100)]) == 132
    assert resident_blocks([("a", "0:1", h100), ("a", "0:2", h100)]) == 132  # one rank per GPU
    assert resident_blocks([("a", "0:1", h100)] * 2) == 66  # two ranks share it
    assert resident_blocks([("a", "0:1", h100)] * 3 + [("a", "0:2", h100)]) == 44
    # the same bus id on another host is another device; the smaller GPU sets the count
    assert resident_blocks([("a", "0:1", h100), ("b", "0:1", 108)]) == 108
    assert resident_blocks([("a", "0:1", 2)] * 4) == 1  # never below one block


def test_blocks_leave_room_for_mps_shares_and_other_communicators(monkeypatch):
    """A communicator's SMs: the MPS share of the device (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE where
    the driver cannot say), split with the communicators already live on it."""
    from ringreduce._cuda.policy import mps_sm_share, usable_sms
    assert usable_sms(132, 100, 0) == 132
    assert usable_sms(132, 50, 0) == 66
    assert usable_sms(132, 100, 1) == 66  # a second communicator on the device
    assert usable_sms(132, 50, 2) == 22
    assert usable_sms(4, 10, 3) == 1  # never below one
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "25")
    assert mps_sm_share(0) == 25  # no driver here: the variable
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "lots")
    assert mps_sm_share(0) == 100
    monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    assert mps_sm_share(0) == 100


def test_time_sliced_where_ranks_share_a_gpu_without_mps():
    """The copy algorithm (no kernel waits for another rank) where some GPU of the group is
    shared by ranks and MPS does not run; where[q] = (host, bus id, SMs, MPS active)."""
    from ringreduce._cuda.policy import resident_blocks, time_sliced
    assert not time_sliced([("a", "0:1", 132, False), ("a", "0:2", 132, False)])  # a GPU each
    assert time_sliced([("a", "0:1", 132, False)] * 2)
    assert not time_sliced([("a", "0:1", 132, True)] * 2)  # MPS
    # one shared GPU is enough, for every rank of the group
    assert time_sliced([("a", "0:1", 132, False), ("a", "0:2", 132, False), ("a", "0:2", 132, False)])
    assert not time_sliced([("a", "0:1", 132, False), ("b", "0:1", 132, False)])  # two hosts
    assert resident_blocks([("a", "0:1", 132, False)] * 2) == 66  # the same records


def test_emulated_hosts_sharing_a_gpu_counted_as_one_device():
    """Ranks of two emulated hosts (RINGREDUCE_HOST_ID) on one GPU of one machine, as the bench's
    --hosts 2 puts 2 x 2 ranks on one H200: the plans see two hosts, but all four ranks' blocks
    spin on that GPU at once, so each may keep a quarter of its SMs, not half (half let two ranks
    of different hosts fill the GPU while their peers waited for an SM: a hang until timeout)."""
    from ringreduce._cuda.policy import (device_record, parse_device_records, resident_blocks,
                                         time_sliced)
    values = [device_record(f"h{q // 2}", "box/boot", "0000:19:00.0", 132, True).encode()
              for q in range(4)]
    where, devices = parse_device_records(values)
    assert [h for h, _, _, _ in where] == ["h0", "h0", "h1", "h1"]
    assert resident_blocks(devices) == 33 and resident_blocks(where) == 66
    assert not time_sliced(devices)  # MPS
    off = parse_device_records([device_record(f"h{q}", "box/boot", "0:1", 132, False)
                                for q in range(2)])
    assert time_sliced(off[1]) and not time_sliced(off[0])
    # two real machines, a GPU each on the same bus id: not shared
    two = parse_device_records([device_record(f"m{q}", f"m{q}/boot", "0:1", 132, False)
                                for q in range(2)])
    assert resident_blocks(two[1]) == 132 and not time_sliced(two[1])
    assert parse_device_records([device_record("a|b", "m", "0:1", 8, 0)])[0] == [("a|b", "0:1", 8, False)]


def test_mps_as_the_environment_says(tmp_path, monkeypatch):
    from ringreduce._cuda.policy import mps_active
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    monkeypatch.delenv("RINGREDUCE_CUDA_MPS", raising=False)
    assert not mps_active()
    (tmp_path / "control").touch()
    assert mps_active()
    monkeypatch.setenv("RINGREDUCE_CUDA_MPS", "0")
    assert not mps_active()
    monkeypatch.setenv("RINGREDUCE_CUDA_MPS", "1")
    (tmp_path / "control").unlink()
    assert mps_active()
    monkeypatch.setenv("RINGREDUCE_CUDA_MPS", "maybe")
    with pytest.raises(ValueError, match="RINGREDUCE_CUDA_MPS must be one of 1, true, yes, on .*got 'maybe'"):
        mps_active()


def test_copy_knob_checked(monkeypatch):
    from ringreduce._cuda.policy import p2p_knobs
    monkeypatch.setenv("RINGREDUCE_CUDA_ALGO", "copy")
    monkeypatch.setenv("RINGREDUCE_CUDA_COPY_BYTES", "4096")
    k = p2p_knobs()
    assert k["algo"] == "copy" and k["copy_bytes"] == 4096 and k["config"].endswith("/4096/measured/1")
    monkeypatch.setenv("RINGREDUCE_CUDA_IMPORT", "off")
    assert p2p_knobs()["imports"] == 0 and p2p_knobs()["config"].endswith("/0")
    monkeypatch.setenv("RINGREDUCE_CUDA_IMPORT", "maybe")
    with pytest.raises(ValueError, match="RINGREDUCE_CUDA_IMPORT must be one of 1, true, yes, on"):
        p2p_knobs()
    monkeypatch.delenv("RINGREDUCE_CUDA_IMPORT")
    monkeypatch.setenv("RINGREDUCE_CUDA_COPY_BYTES", "100")
    with pytest.raises(ValueError, match="RINGREDUCE_CUDA_COPY_BYTES must be a multiple of 16 >= 16 .*got '100'"):
        p2p_knobs()


def test_mps_pipe_found_where_cuda_looks(tmp_path, monkeypatch):
    from ringreduce._cuda.policy import mps_pipe_present
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    assert not mps_pipe_present()
    (tmp_path / "control").touch()
    assert mps_pipe_present()


def test_checked_in_table_follows_from_its_medians():
    """Every entry of ringreduce/gpu_tuning.json: its threshold is what gpu_tune.threshold
    makes of the medians it records (an entry edited by hand, or by an older rule, fails here)."""
    import json
    from ringreduce._cuda.policy import TUNING_PATH
    with open(TUNING_PATH) as f:
        entries = json.load(f)["entries"]
    for e in entries:
        times = {a: {int(s): v for s, v in ts.items()} for a, ts in e["median_us"].items()}
        sizes = sorted({s for a in tune.MEASURED for s in times.get(a, {})})
        assert tune.threshold(times, sizes) == e["oneshot_max"], e["device"]
        variants = {}
        for label, ts in times.items():
            algo, blocks = roof.split_algo(label)
            if blocks:
                variants.setdefault(blocks, {})[algo] = ts
        if variants:  # the blocks it took, from the runs recorded beside it
            plain = {a: times[a] for a in ("twoshot", "registered") if a in times}
            assert tune.sym_blocks(plain, variants, e["plain_sym_blocks"]) == e.get("sym_blocks"), e["device"]


def test_python_block_constants_match_the_kernels():
    import re
    from ringreduce._cuda import policy
    header = (pathlib.Path(__file__).resolve().parents[1] / "csrc" / "cuda" / "p2p" / "layout.h").read_text()
    value = lambda name: int(re.search(rf"constexpr int {name} = (\d+);", header).group(1))  # noqa: E731
    assert roof.MAX_BLOCKS == policy.MAX_SYM_BLOCKS
    assert (policy.DEFAULT_SYM_BLOCKS, policy.MAX_SYM_BLOCKS) == (value("kDefaultSymBlocks"),
                                                                  value("kMaxSymBlocks"))


def test_p2p_knobs_checked_and_agreed_on(monkeypatch):
    """The p2p knobs every rank must set alike: their defaults, the string ranks compare, and a
    clear error for a value the kernels cannot run (no GPU needed: read before CUDA is touched)."""
    from ringreduce._cuda.policy import p2p_knobs
    for name in ("RINGREDUCE_CUDA_CHANNELS", "RINGREDUCE_CUDA_SLICE_BYTES", "RINGREDUCE_CUDA_CHUNK_BYTES",
                 "RINGREDUCE_CUDA_ALGO", "RINGREDUCE_CUDA_MAX_BLOCKS", "RINGREDUCE_CUDA_COPY_BYTES",
                 "RINGREDUCE_CUDA_SYM_BLOCKS", "RINGREDUCE_CUDA_IMPORT"):
        monkeypatch.delenv(name, raising=False)
    k = p2p_knobs()
    assert (k["chunk_bytes"], k["blocks_cap"], k["algo"]) == (16 << 20, 0, "auto")
    # Blocks unset: the measured table's for the device, else the default (the ranks compare that).
    assert k["config"] == "16/524288/16777216/auto/0/8388608/measured/1" and k["sym_blocks_set"] is None
    monkeypatch.setenv("RINGREDUCE_CUDA_CHUNK_BYTES", "4096")
    monkeypatch.setenv("RINGREDUCE_CUDA_ALGO", " OneShot ")
    assert p2p_knobs()["config"] == "16/524288/4096/oneshot/0/8388608/measured/1"
    monkeypatch.setenv("RINGREDUCE_CUDA_SYM_BLOCKS", "24")  # set: not the table's, even at the default
    assert p2p_knobs()["config"].endswith("/24/1") and p2p_knobs()["sym_blocks_set"] == 24
    monkeypatch.setenv("RINGREDUCE_CUDA_SYM_BLOCKS", "64")
    assert p2p_knobs()["config"].endswith("/64/1")
    for value in ("0", "65", "-1"):
        monkeypatch.setenv("RINGREDUCE_CUDA_SYM_BLOCKS", value)
        with pytest.raises(ValueError, match=f"RINGREDUCE_CUDA_SYM_BLOCKS must be an integer 1..64 .*got '{value}'"):
            p2p_knobs()
    monkeypatch.delenv("RINGREDUCE_CUDA_SYM_BLOCKS")
    for value in ("0", "24"):
        monkeypatch.setenv("RINGREDUCE_CUDA_CHUNK_BYTES", value)
        with pytest.raises(ValueError, match=f"RINGREDUCE_CUDA_CHUNK_BYTES must be a multiple of 16 >= 16 .*got '{value}'"):
            p2p_knobs()
    monkeypatch.setenv("RINGREDUCE_CUDA_CHUNK_BYTES", "two")
    with pytest.raises(ValueError, match="RINGREDUCE_CUDA_CHUNK_BYTES must be a multiple of 16 >= 16 .*got 'two'"):
        p2p_knobs()
    monkeypatch.setenv("RINGREDUCE_CUDA_CHUNK_BYTES", "4096")
    monkeypatch.setenv("RINGREDUCE_CUDA_MAX_BLOCKS", "-1")
    with pytest.raises(ValueError, match="RINGREDUCE_CUDA_MAX_BLOCKS must be an integer >= 0 .*got '-1'"):
        p2p_knobs()
    monkeypatch.setenv("RINGREDUCE_CUDA_MAX_BLOCKS", "16")
    monkeypatch.setenv("RINGREDUCE_CUDA_ALGO", "tree")
    with pytest.raises(ValueError, match="RINGREDUCE_CUDA_ALGO must be one of auto, ring, oneshot, twoshot, copy, ll .*got 'tree'"):
        p2p_knobs()


# -- the peer in the roofline: torch's SymmetricMemory all-reduces (issue 50 item 6) -------------
PRINTED_WITH_PEER = "\n".join([
    "# note: torch/symm-oneshot-sym skipped: rendezvous refused",
    "        4096         1024    float    sum   ringreduce/p2p        25.0    0.164    0.164      0        20.0    0.205    0.205      0",
    "        4096         1024    float    sum   torch/symm-oneshot        12.0    0.341    0.341      0        11.0    0.372    0.372      0",
    "        4096         1024    float    sum   torch/symm-twoshot        14.0    0.293    0.293      0        13.0    0.315    0.315      2",
    "     1048576       262144    float    sum   torch/symm-twoshot        44.0    23.83    23.83      0        40.0    26.21    26.21      0",
])


def test_rows_parsed_per_backend():
    assert roof.parse_rows(PRINTED_WITH_PEER, "ringreduce/p2p") == {4096: 20.0}
    assert roof.parse_rows(PRINTED_WITH_PEER, "torch/symm-oneshot") == {4096: 11.0}
    assert roof.parse_rows(PRINTED_WITH_PEER, "torch/symm-twoshot") == {1 << 20: 40.0}  # 4 KiB wrong
    assert roof.parse_rows(PRINTED_WITH_PEER, "torch/symm-oneshot-sym") == {}
    assert roof.parse_rows(PRINTED_WITH_PEER) == {4096: 11.0, 1 << 20: 40.0}  # every row, as before


def test_the_peer_runs_beside_auto_and_registered_first():
    assert roof.PEERS == {"auto": ("torch/symm-oneshot", "torch/symm-twoshot"),
                          "registered": ("torch/symm-oneshot-sym", "torch/symm-twoshot-sym")}
    assert roof.DEFAULT_ORDER[:2] == ("auto", "registered")
    assert sorted(roof.DEFAULT_ORDER) == sorted(roof.ALGOS)
    names = roof.row_names()
    assert names.index("torch/symm-twoshot") == names.index("auto") + 2
    assert names.index("torch/symm-oneshot-sym") == names.index("registered") + 1


def test_peer_rows_with_their_fraction_of_the_limit():
    s = 256 << 20
    results = {("on", 2, "auto"): {s: 740.4}, ("on", 2, "torch/symm-twoshot"): {s: 1480.8},
               ("off", 2, "torch/symm-twoshot"): {s: 4442.4}, ("on", 2, "registered"): {s: 500.0}}
    rows = [line for line in roof.table(results, 2900, [s]).splitlines() if line.startswith("| 2 |")]
    assert rows == ["| 2 | 256 MiB | auto | 740.4 | 0.50 | - | - |",
                    "| 2 | 256 MiB | torch/symm-twoshot | 1,480.8 | 0.25 | 4,442.4 | 3.0x |",
                    "| 2 | 256 MiB | registered | 500.0 | 0.74 | - | - |"]


def test_peer_table_takes_the_faster_op_over_ours():
    K = 1 << 10
    results = {("on", 2, "auto"): {4 * K: 20.0, 64 * K: 30.0},
               ("on", 2, "torch/symm-oneshot"): {4 * K: 10.0, 64 * K: 45.0},
               ("on", 2, "torch/symm-twoshot"): {4 * K: 12.0, 64 * K: 60.0},
               ("on", 2, "registered"): {4 * K: 8.0},
               ("on", 2, "torch/symm-twoshot-sym"): {4 * K: 16.0},
               ("off", 2, "auto"): {4 * K: 2000.0}}  # no peer without MPS: no row
    lines = roof.peer_table(results, [4 * K, 64 * K]).splitlines()
    assert lines[2:] == ["| on | 2 | 4 KiB | 20.0 | 10.0 (oneshot) | 0.50 | 8.0 | 16.0 (twoshot) | 2.00 |",
                         "| on | 2 | 64 KiB | 30.0 | 45.0 (oneshot) | 1.50 | - | - | - |"]
    assert roof.peer_table({("on", 2, "auto"): {4 * K: 20.0}}, [4 * K]) == ""  # --peers off


def test_json_gives_each_row_its_fraction_and_the_peer_what_it_ran_beside():
    s = 256 << 20
    out = roof.json_results({("on", 2, "auto"): {s: 740.4},
                             ("on", 2, "torch/symm-oneshot-sym"): {s: 370.2}}, 2900)
    assert out[0] == {"mps": "on", "world": 2, "algo": "auto", "median_us": {str(s): 740.4},
                      "fraction_of_hbm_limit": {str(s): pytest.approx(0.5, abs=1e-3)}}
    assert out[1]["peer_of"] == "registered"
    assert out[1]["fraction_of_hbm_limit"] == {str(s): pytest.approx(1.0, abs=1e-3)}


def test_a_stopped_roofline_takes_the_bench_ranks_with_it(tmp_path):
    """timeout(1) ends gpu_roofline.py with SIGTERM while a bench run (a session of its own) is
    going: its processes go too, not left spinning on the GPU into the lease's next step."""
    import os
    import signal
    import subprocess
    import sys
    import time
    pidfile = tmp_path / "pid"
    fake = tmp_path / "fake_python"  # stands for the bench: a child that would outlive it
    fake.write_text(f"#!/bin/sh\nsleep 60 &\necho $! > {pidfile}\nwait\n")
    fake.chmod(0o755)
    script = (f"import importlib.util, types\n"
              f"spec = importlib.util.spec_from_file_location('r', {str(spec.origin)!r})\n"
              f"r = importlib.util.module_from_spec(spec); spec.loader.exec_module(r)\n"
              f"r.sys = types.SimpleNamespace(executable={str(fake)!r})\n"
              f"r.run_bench_rows(2, 'auto', [4096], 60, peers=r.PEERS['auto'])\n")
    p = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 60
    while not (pidfile.exists() and pidfile.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(pidfile.read_text())
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 128 + signal.SIGTERM
    for _ in range(100):  # gone, or a zombie waiting for init
        try:
            with open(f"/proc/{child}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":
                    break
        except FileNotFoundError:
            break
        time.sleep(0.05)
    else:
        os.kill(child, signal.SIGKILL)
        raise AssertionError("the bench's child outlived the roofline")


def test_measured_blocks_applied_on_every_rank_unless_set(tmp_path, monkeypatch):
    """Communicator._tune with a real store: rank 0 reads the table, every rank applies its
    entry (auto's threshold for auto only; the blocks unless RINGREDUCE_CUDA_SYM_BLOCKS set them)."""
    import copy
    import types
    import torch
    import torch.distributed as dist
    from ringreduce import _cuda, _lifecycle
    table = tmp_path / "gpu_tuning.json"
    table.write_text('{"about": "", "entries": []}')
    tune.update_table(str(table), {"device": "NVIDIA H200", "world": 2, "ranks_per_device": 2,
                                   "oneshot_max": 262144, "sym_blocks": 64, "date": "x",
                                   "command": "a | b"})
    real = _cuda.policy.tuned  # its path argument's default binds at definition: pass the table in
    monkeypatch.setattr(_cuda.policy, "tuned", lambda d, w, p: real(d, w, p, str(table)))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")

    class Native:
        def __init__(self):
            self.calls = []

        def set_threshold(self, b):
            self.calls.append(("threshold", b))

        def set_sym_blocks(self, b):
            self.calls.append(("blocks", b))

    def tuned_on(setup, rank, algo, sym_blocks):
        c = object.__new__(_cuda.Communicator)
        c.rank, c.world_size, c.device = rank, 2, torch.device("cpu")
        c._bus_ids = ["h|0000:01:00.0"] * 2
        c._setup = copy.copy(setup)  # the same keys on both ranks
        c._setup.rank = rank
        native = Native()
        c._tune(native, algo, sym_blocks)
        return native.calls

    for algo, sym_blocks, want in (("auto", None, [("threshold", 262144), ("blocks", 64)]),
                                   ("twoshot", None, [("blocks", 64)]),
                                   ("auto", 24, [("threshold", 262144)])):
        member = types.SimpleNamespace(store=dist.HashStore(), rank=0, name="0-1")
        setup = _lifecycle.Bootstrap(member, "p2p-test", 5.0)
        assert tuned_on(setup, 0, algo, sym_blocks) == want
        assert tuned_on(setup, 1, algo, sym_blocks) == want  # rank 0's entry, read from the store


def test_python_reads_the_vocabulary_and_defaults_from_the_native_code():
    import torch
    from ringreduce import _C, collectives
    from ringreduce._cuda import policy
    assert [str(d).replace("torch.", "") for d in collectives.SUPPORTED_DTYPES] == list(_C.DTYPES)
    assert collectives.WIRE_TENSOR_DTYPES == (torch.float32, torch.float16, torch.bfloat16)
    assert policy.DEFAULT_STAGING_BYTES == _C.CUDA_DEFAULTS["staging_bytes"] == 16 << 20
    import re
    pkg = pathlib.Path(__file__).resolve().parents[1] / "ringreduce"
    for path in (pkg / "collectives.py", pkg / "_cuda" / "policy.py"):
        text = path.read_text()
        assert not re.search(r"=\s*\(?torch\.float32,", text), path.name  # no dtype list spelled out
        assert not re.search(r"DEFAULT_\w+\s*=\s*\d", text), path.name    # no default spelled out


def _load(name):
    spec_ = importlib.util.spec_from_file_location(
        name, pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(mod)
    return mod


def test_ddp_step_gpu_table_against_the_floor():
    """Issue 70's GPU training-step benchmark (it needs a GPU to run): its table's ratios to the
    noop_hook floor, paired per iteration, and the variants that could not run, with why."""
    step = _load("ddp_step_gpu")
    slowest = {"ringreduce": [0.011, 0.012, 0.013], "noop_hook": [0.010, 0.010, 0.010],
               "gloo": [0.5, 0.6, 0.7]}
    text = step.table(slowest, {"nccl": "RuntimeError: no NCCL"}, lambda n: n)
    rows = {line.split()[0]: line.split() for line in text.splitlines()[1:]}
    assert rows["ringreduce"][1] == "12.00" and rows["ringreduce"][3] == "1.200x", text
    assert rows["ringreduce"][4] == "1.200x" and rows["gloo"][3] == "60.000x", text
    assert rows["nccl"][1:3] == ["not", "run:"] and "no NCCL" in text, text
    with pytest.raises(SystemExit) as e:
        step.main(["--help"])
    assert e.value.code == 0


def test_gpu_overlap_rows_take_the_slowest_rank():
    ov = _load("gpu_overlap")
    results = {("ours@24", 16 << 20): [
        {"gemm_alone_ms": 1.0, "gemm_with_ms": 1.2, "ar_alone_us": 40.0, "ar_with_us": 55.0},
        {"gemm_alone_ms": 1.1, "gemm_with_ms": 1.5, "ar_alone_us": 42.0, "ar_with_us": 50.0}]}
    (row,) = ov.rows_of(results)
    assert row["gemm_with_ms"] == 1.5 and row["ar_with_us"] == 55.0
    assert row["slowdown"] == pytest.approx(1.5 / 1.1)
    assert "ours@24" in ov.table([row]) and "1.364x" in ov.table([row])
    for argv in (["--help"], ["--blocks", "8,65"]):
        with pytest.raises(SystemExit) as e:
            ov.main(argv)
        assert e.value.code == (0 if argv == ["--help"] else 2)


FAKE_MPS = """#!{python}
# A stand-in for nvidia-cuda-mps-control as documented: `-d` starts the daemon and fails while one
# runs; without arguments it reads commands and fails when no daemon answers.
import os, sys
state, log = os.environ["FAKE_MPS_STATE"], os.environ["FAKE_MPS_LOG"]
with open(log, "a") as f:
    f.write(" ".join(sys.argv[1:]) or sys.stdin.read().strip())
    f.write("\\n")
if sys.argv[1:] == ["-d"]:
    if os.path.exists(state):
        sys.exit("An instance of this daemon is already running")
    open(state, "w").close()
    sys.exit(0)
if not os.path.exists(state):
    sys.exit("Cannot find MPS control daemon process")
with open(log) as f:
    last = f.read().splitlines()[-1]
if last == "quit":
    os.remove(state)
"""


def test_mps_set_from_any_state(tmp_path, monkeypatch):
    """Issue 71 item 3: the roofline turns MPS on or off whatever state it finds (a daemon left
    running by an earlier step made its own `-d` fail with CalledProcessError), and says why when
    MPS cannot start. The control program is a stand-in here (no GPU, no MPS)."""
    import sys
    tool = tmp_path / "bin" / "nvidia-cuda-mps-control"
    tool.parent.mkdir()
    tool.write_text(FAKE_MPS.replace("{python}", sys.executable))
    tool.chmod(0o755)
    state, log = tmp_path / "running", tmp_path / "log"
    monkeypatch.setenv("PATH", f"{tool.parent}:/usr/bin:/bin")
    monkeypatch.setenv("FAKE_MPS_STATE", str(state))
    monkeypatch.setenv("FAKE_MPS_LOG", str(log))
    roof.set_mps(True, settle_s=0)
    assert state.exists()
    roof.set_mps(True, settle_s=0)  # already running: used, not an error
    assert state.exists()
    roof.set_mps(False, settle_s=0)
    assert not state.exists()
    roof.set_mps(False, settle_s=0)  # off already: no quit sent
    assert log.read_text().splitlines() == ["-d", "-d", "get_server_list", "get_server_list",
                                            "quit", "get_server_list"]
    monkeypatch.setenv("FAKE_MPS_STATE", str(tmp_path / "no" / "such" / "dir"))  # -d cannot start
    with pytest.raises(SystemExit, match="failed .exit 1. and no daemon answers"):
        roof.set_mps(True, settle_s=0)
    monkeypatch.setenv("PATH", str(tmp_path))  # no MPS at all: off is a no-op, on says so
    roof.set_mps(False, settle_s=0)
    with pytest.raises(SystemExit, match="not found"):
        roof.set_mps(True, settle_s=0)


from dist_utils import run_ranks  # noqa: E402


def _agree_worker(rank, world, verdicts):
    """policy.agree_imports over the group's real store, each rank with its own allocator verdict."""
    import types
    from ringreduce import _lifecycle
    from ringreduce._cuda import policy
    store = dist.distributed_c10d._get_default_store()
    member = types.SimpleNamespace(store=store, rank=rank, name="imports-test")
    setup = _lifecycle.Bootstrap(member, "p2p-imports-test", 10.0)  # a rank left waiting fails in 10 s
    return policy.agree_imports(setup, rank, world, verdicts[rank])


def test_imports_agreed_by_every_rank_when_one_allocator_cannot_share():
    """Issue 81 item 1: a rank whose allocator is not torch's native one (cudaMallocAsync) turns
    imported memory off for the whole group; every rank learns it at setup, with the rank and why,
    and none waits (each publishes its verdict before reading the others')."""
    why = "torch's CUDA allocator is cudaMallocAsync (PYTORCH_CUDA_ALLOC_CONF backend or a pluggable allocator)"
    results = run_ranks(3, _agree_worker, ["", why, ""], timeout=120)
    for rank, (on, note) in enumerate(results):
        assert on is False, (rank, note)
        assert "rank 1: " + why in note and "imported memory is off" in note, (rank, note)
    assert run_ranks(2, _agree_worker, ["", ""], timeout=120) == [(True, ""), (True, "")]


@pytest.mark.skipif(not getattr(_C, "cuda_compiled", False), reason="this build has no CUDA code (RINGREDUCE_CUDA=1 builds it)")
@pytest.mark.parametrize("conf", ["", "backend:native", "backend:cudaMallocAsync"])
def test_allocator_backend_read_without_a_gpu(conf):
    """Issue 81 item 1: with PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync every p2p group hung
    at setup (torch refuses attachAllocatorTraceTracker there, and rank 0 threw before publishing
    the board). The binding now asks which allocator torch runs, which needs no GPU: the check
    every rank publishes at setup says why imports are off, or "" on the native one."""
    import subprocess
    import sys
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=conf)
    out = subprocess.run([sys.executable, "-c", "from ringreduce import _C; print(repr(_C.cuda_allocator_why_not()))"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    why = eval(out.stdout.strip())
    if conf.endswith("cudaMallocAsync"):
        assert "cudaMallocAsync" in why and "not the native caching allocator" in why, why
    else:
        assert why == "", why


def test_no_allocator_callback_in_the_binding():
    """Issue 81 items 1, 3 and 9: imported memory is kept allocated by holds on the tensors'
    storages (csrc/cuda/p2p/imports.cpp), so the binding attaches no allocator trace tracker (a
    callback torch runs under its allocator lock, refused by cudaMallocAsync) and takes no
    allocator snapshot (a copy of every segment, and of the trace buffer when history is on)."""
    csrc = pathlib.Path(__file__).resolve().parents[1] / "csrc"
    for path in sorted(csrc.rglob("*.[ch]*")):
        text = path.read_text()
        for call in ("attachAllocatorTraceTracker", "snapshot("):
            assert call not in text, f"{path.relative_to(csrc)} calls {call}"
