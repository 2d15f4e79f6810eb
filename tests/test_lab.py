"""Emulated hosts on a real, shaped link (ringreduce/bench/netlab.py): the lab's teardown, its
shaping, ranks started by `torchrun --nnodes 2` inside each host's network namespace (the real
multi-node path: TCPStore at host 0's address, GLOO_SOCKET_IFNAME), exact wire results there, a
host lost mid-call, and the benchmark's --link rows. Needs CAP_NET_ADMIN (root, as CI runs)."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from ringreduce.bench import netlab

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
WHY = netlab.lab_unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=WHY or "")


def _lab_names():
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(netlab.PREFIX)]


def test_lab_builds_shapes_and_tears_down():
    """Three hosts on a bridge reach each other; a socket gets no more than the shaped rate; close()
    kills what runs inside and leaves no namespace (and so no interface) behind."""
    netlab.remove_stale()  # what an earlier, killed run left (Lab() would remove it below)
    before = set(_lab_names())
    links = subprocess.run(["ip", "link"], capture_output=True, text=True).stdout
    with netlab.Lab(3, "200mbit") as lab:
        assert set(lab.exists()) == {lab.switch, *lab.names}
        gbps = lab.measure(src=2, dst=0, nbytes=16 << 20)
        assert 0 < gbps <= 0.2 / 8 * 1.1, gbps  # 200 Mbit/s is 0.025 GB/s; the bucket holds 2 ms
        sleeper = lab.popen(1, [sys.executable, "-c", "import time; time.sleep(600)"])
    assert sleeper.wait(timeout=10) is not None
    assert set(_lab_names()) == before
    assert subprocess.run(["ip", "link"], capture_output=True, text=True).stdout == links


def test_lab_removed_after_its_owner_dies():
    """A lab whose process was killed (SIGKILL: no handler runs) is removed by the next Lab();
    one whose process got SIGTERM or Ctrl-C removes itself."""
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {REPO!r})
        from ringreduce.bench.netlab import Lab
        lab = Lab(2, "1gbit")
        print(lab.tag, flush=True)
        time.sleep(600)
    """)
    for sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        tag = p.stdout.readline().strip()
        assert any(n.startswith(tag + "-") for n in _lab_names()), (sig, tag)
        p.send_signal(sig)
        p.wait(timeout=30)
        if sig == signal.SIGKILL:
            assert any(n.startswith(tag + "-") for n in _lab_names())
            netlab.remove_stale()
        assert not any(n.startswith(tag + "-") for n in _lab_names()), (sig, _lab_names())


def test_refused_without_cap_net_admin():
    """Without CAP_NET_ADMIN the benchmark's --link refuses with one line, before any rank."""
    cmd = ["setpriv", "--inh-caps=-net_admin", "--bounding-set=-net_admin", "--",
           sys.executable, "-m", "ringreduce.bench", "--quick", "--nranks", "2", "--hosts", "2",
           "--link", "1gbit", "--no-results"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    ours = [line for line in res.stderr.splitlines() if "ringreduce" in line or "Traceback" in line]
    assert ours == ["ringreduce.bench: --link: emulated hosts need CAP_NET_ADMIN (run as root): "
                    "network namespaces, veth pairs and tc shaping"], res.stderr
    assert res.stdout == ""


def _torchrun(lab, nproc, mode, out, env=None, timeout=300):
    """`torchrun --nnodes H --node-rank h` in every host of lab (its own /dev/shm, which it
    lists at the end); returns (exit codes, outputs)."""
    procs = []
    for h in range(lab.hosts):
        script = (f'"$0" -m torch.distributed.run --nnodes {lab.hosts} --node-rank {h} '
                  f'--nproc-per-node {nproc} --master-addr {lab.address(0)} --master-port 29500 '
                  f'{HERE}/lab_worker.py {out} {mode}; rc=$?; echo "leftover: $(ls /dev/shm)"; '
                  f'exit $rc')
        procs.append(lab.popen(h, ["sh", "-c", script, sys.executable], private_shm=True,
                               env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def _results(out, world):
    got = {}
    for r in range(world):
        path = os.path.join(out, f"rank{r}.json")
        assert os.path.exists(path), f"rank {r} wrote no result"
        with open(path) as f:
            res = json.load(f)
        assert "ok" in res, res["error"]
        got[r] = res["ok"]
    return got


def test_torchrun_two_hosts_exact_wire(tmp_path):
    """2 hosts x 2 ranks, each host's ranks started by its own torchrun inside its namespace: every
    wire, op and dtype gives the hosts reference's bits on every rank (the two-level plan chose
    from the ranks' own host ids), every process exits 0, and no /dev/shm keeps anything."""
    with netlab.Lab(2, "10gbit") as lab:
        procs = _torchrun(lab, 2, "exact", tmp_path)
        outs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]
        assert out.rstrip().splitlines()[-1] == "leftover:", out[-2000:]
    got = _results(tmp_path, 4)
    for r, res in got.items():
        assert res["failures"] == [], (r, res["failures"][:5])
        assert res["digests"] == got[0]["digests"]
        assert res["plan"] == ["hier", "two-level"], res
        assert res["hosts"] == ["lab-h0", "lab-h0", "lab-h1", "lab-h1"]


def test_host_lost_mid_call(tmp_path):
    """Host 1 vanishes during a wire all_reduce (its link goes down, then its processes are
    killed: no connection is closed, as when a machine loses power): both ranks of host 0 raise
    RingReduceError within the timeout, naming the step and the lost host with its ranks, and a
    later call raises at once."""
    timeout = 15
    with netlab.Lab(2, "10gbit") as lab:
        procs = _torchrun(lab, 2, "victim", tmp_path, env={"RINGREDUCE_TIMEOUT": str(timeout)})
        deadline = time.monotonic() + 240
        while not all(os.path.exists(tmp_path / f"calls{r}") for r in range(4)):
            assert time.monotonic() < deadline, "the ranks never got going"
            assert procs[0].poll() is None, procs[0].communicate()[0][-4000:]
            time.sleep(0.1)
        lost = time.monotonic()
        subprocess.run(["ip", "-n", lab.names[1], "link", "set", "eth0", "down"], check=True)
        netlab._kill_inside(lab.names[1])
        # Host 0's ranks report and leave; its torchrun would then wait 300 s in its exit barrier
        # for the lost host's agent (torchrun's own), so the lab's close ends it.
        while not all(os.path.exists(tmp_path / f"rank{r}.json") for r in (0, 1)):
            assert time.monotonic() - lost < timeout + 60, "a survivor never reported"
            time.sleep(0.2)
        elapsed = time.monotonic() - lost
    for r in (0, 1):
        with open(tmp_path / f"rank{r}.json") as f:
            res = json.load(f)
        assert "ok" in res, res.get("error")
        res = res["ok"]
        assert res["error"] is not None, f"rank {r} never failed"
        name, msg = res["error"]
        assert name == "RingReduceError", (r, msg)
        assert res["took"] < timeout + 10, (r, res["took"], msg)
        assert "inter-host step" in msg or "intra-host step" in msg, msg
        assert "host 1 (ranks 2, 3)" in msg, msg  # the lost host, named on every survivor
        assert "broken by an earlier failure" in res["again"] and res["again_took"] < 1, res
    assert elapsed < timeout + 60, elapsed


def test_bench_rows_on_emulated_hosts(tmp_path):
    """python -m ringreduce.bench --hosts 2 --link 1gbit: Gloo, ringreduce/hier and the wire rows
    on the same link, every result checked, the link and a measured socket rate in the header,
    and nothing left behind."""
    netlab.remove_stale()
    before = set(_lab_names())
    res = subprocess.run(
        [sys.executable, "-m", "ringreduce.bench", "--quick", "--nranks", "4", "--hosts", "2",
         "--link", "1gbit", "--collectives", "all_reduce", "--wire", "bf16",
         "--json", str(tmp_path / "run.json"), "--no-results"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "Out of bounds values : 0 OK" in res.stdout
    with open(tmp_path / "run.json") as f:
        doc = json.load(f)
    assert "shaped to 1gbit" in doc["args"]["lab"] and "GB/s" in doc["args"]["lab"]
    labels = {row["backend"] for run in doc["runs"] for row in run["rows"]}
    assert {"torch/gloo", "ringreduce/hier", "ringreduce/wire-bf16"} <= labels, labels
    assert "# link: 2 emulated hosts" in res.stdout
    # hier against the link's bound, at the socket rate the lab measured (in results.json too)
    gbps = doc["args"]["link_gbps"]
    assert 0.05 < gbps < 0.2 and f"at {gbps:.3f} GB/s" in res.stdout, res.stdout[-3000:]
    assert "hier/bound" in res.stdout
    assert set(_lab_names()) == before
