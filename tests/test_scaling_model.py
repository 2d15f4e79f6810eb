"""Properties of the alpha-beta scaling model (benchmarks/scaling_model.py). No torch, no matplotlib."""
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "scaling_model.py"
spec = importlib.util.spec_from_file_location("scaling_model", SCRIPT)
sm = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sm)

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30


@pytest.mark.parametrize("profile", ["gpu", "cpu"])
def test_one_host_two_level_is_the_flat_ring(profile):
    m = sm.make_model(profile)
    for p in range(2, m.ranks_per_host + 1):
        c = sm.costs(p, m)
        assert c["two-level"] == pytest.approx(c["flat ring"], rel=1e-12), p


def test_one_host_ring_busbw_is_the_link_bandwidth():
    m = sm.make_model("gpu")
    t = sm.times(m.ranks_per_host, 1 << 40, m)["flat ring"]
    assert sm.busbw(m.ranks_per_host, 1 << 40, t) == pytest.approx(m.bw_intra_GBps, rel=1e-3)


def test_large_messages_across_hosts_two_level_beats_flat_ring():
    m = sm.make_model("gpu")
    for hosts in (2, 4, 16, 128):
        for size in (16 * MIB, GIB):
            t = sm.times(hosts * m.ranks_per_host, size, m)
            assert t["two-level"] < t["flat ring"] / 3, (hosts, size)  # 8 NICs at once vs one


def test_one_nic_per_host_two_level_needs_pipelining_for_large_messages():
    # One NIC: both rings push the same bytes through it, so the sequential two-level pays its
    # intra phases on top; overlapping them makes it at least as fast as the flat ring again.
    m = sm.make_model("cpu")
    p = 64 * m.ranks_per_host
    t = sm.times(p, GIB, m)
    assert t["two-level"] > t["flat ring"]
    t = sm.times(p, GIB, sm.make_model("cpu", pipelined=True))
    assert t["two-level"] < t["flat ring"]


def test_tiny_messages_at_scale_tree_wins():
    for profile in ("gpu", "cpu"):
        m = sm.make_model(profile)
        for p in (256, 1024):
            t = sm.times(p, 4 * KIB, m)
            assert t["tree"] < t["two-level"] < t["flat ring"], (profile, p)


def test_crossovers_are_where_the_times_meet():
    m = sm.make_model("gpu")
    env = sm.envelope(1024, m)
    assert [k for _, k in env] == ["tree", "two-level"]
    s = env[1][0]
    below, above = sm.times(1024, s * 0.99, m), sm.times(1024, s * 1.01, m)
    assert below["tree"] < below["two-level"] and above["two-level"] < above["tree"]


def test_more_channels_only_help_flat_ring_and_tree():
    one, eight = sm.make_model("gpu"), sm.make_model("gpu", channels=8)
    a, b = sm.times(64, GIB, one), sm.times(64, GIB, eight)
    assert b["flat ring"] < a["flat ring"] and b["tree"] < a["tree"]
    assert b["two-level"] == a["two-level"]


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=60)


def test_default_table_has_a_row_per_rank_count_and_size():
    r = run()
    assert r.returncode == 0, r.stderr
    blocks = r.stdout.split("\n## ")[1:-1]  # one per size; the last block is the crossovers
    assert len(blocks) == len(sm.DEFAULT_SIZES)
    for block in blocks:
        rows = [int(x) for x in re.findall(r"^\s*(\d+)\s+\d+\s+\|", block, re.M)]
        assert rows == sm.DEFAULT_RANKS, block


def test_cpu_profile_and_odd_counts():
    r = run("--profile", "cpu", "--ranks", "1,2,3,4", "--sizes", "4K")
    assert r.returncode == 0, r.stderr
    assert "skipped" in r.stdout and "[1, 3]" in r.stdout


def test_plot_without_matplotlib_says_how_to_get_it(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    assert sm.main(["--sizes", "4K", "--ranks", "2", "--plot", str(tmp_path / "x.png")]) == 2
    assert "pip install matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_leaders_pays_for_its_broadcast_and_equals_two_level_with_one_rank_per_host():
    """Leaders (uneven hosts' plan): with one NIC per host its inter-host traffic is the two-level
    plan's (the L rings share the NIC), plus a broadcast inside the host; with one rank per host
    the two plans are the same ring among the hosts."""
    m = sm.make_model("cpu", bw_inter_GBps=0.12, alpha_inter_us=500)
    a2, b2 = sm.costs(4, m)["two-level"]
    al, bl = sm.leaders_cost(4, m)
    assert bl == pytest.approx(b2 + 1 / (m.bw_intra_GBps * 1e9)) and al > a2
    one = sm.replace(m, ranks_per_host=1)
    assert sm.leaders_cost(4, one) == pytest.approx(sm.costs(4, one)["two-level"])


def test_compare_reads_a_lab_run(tmp_path):
    """--compare prints the model beside a bench --link run's measured medians."""
    import json
    rows = [{"collective": "all_reduce", "backend": b, "size_bytes": 16 * MIB, "inplace": True,
             "time_us": t} for b, t in (("torch/gloo", 170000.0), ("ringreduce/hier", 150000.0))]
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"args": {"lab": "2 emulated hosts, 1gbit"},
                                "runs": [{"nranks": 4, "rows": rows}]}))
    r = run("--profile", "cpu", "--bw-inter-GBps", "0.12", "--compare", str(path))
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.strip().startswith("4 "))
    cells = line.split("|")
    model = [float(x) for x in cells[1].split()]
    m = sm.make_model("cpu", bw_inter_GBps=0.12)
    a, b = sm.costs(4, m)["two-level"]
    assert model[0] == pytest.approx((a + b * 16 * MIB) * 1e3, abs=0.05)
    assert cells[2].split() == ["170.0", "150.0"]
