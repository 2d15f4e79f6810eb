"""The bench's GPU ranks on emulated hosts (issue 74 item 4: `ringreduce.bench --hosts H [--link
RATE]` with CUDA tensors): the rows such a run chooses and refuses, each rank's host as ringreduce
and NCCL are told it, the wire rows' limits across hosts, and the table against hier and the link's
bound. Parsing and the launcher's setup run here with torch told there is a GPU; the sweep itself
needs one (benchmarks/gpu_lease.sh runs it)."""
import os

import pytest
import torch

from ringreduce.bench import backends as bk
from ringreduce.bench import cli, header, launch, report


@pytest.fixture
def gpu(monkeypatch):
    """parse_args as on a machine with one GPU and SymmetricMemory's ops."""
    monkeypatch.setattr(cli.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cli.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(cli, "symm_unavailable", lambda device: None)


def test_default_rows_across_hosts(gpu):
    """--hosts 2 on GPUs: the two-level plan, the flat ring and NCCL's own all_reduce; p2p and
    SymmetricMemory (one host's) are neither run nor reported as merely not asked for."""
    a = cli.parse_args(["--nranks", "4", "--hosts", "2", "--no-results"])
    assert a.device == "cuda"
    assert a.backends == ["torch/nccl", "ringreduce/hier", "ringreduce/nccl"]
    out = dict(header.left_out(a))
    assert "emulated hosts" in out["ringreduce/p2p"] and "emulated hosts" in out["torch/symm"]


def test_named_rows_across_hosts(gpu):
    """The umbrella names: ringreduce is hier and nccl there; SymmetricMemory is left out with a
    line saying why; the wire rows stay (they run on hier)."""
    a = cli.parse_args(["--nranks", "4", "--hosts", "2", "--backends", "ringreduce,torch/symm,torch",
                        "--wire", "bf16,fp8", "--no-results"])
    assert a.backends == ["ringreduce/hier", "ringreduce/nccl", "torch/nccl",
                          "ringreduce/wire-bf16", "ringreduce/wire-fp8"]
    assert len(a.skipped) == 4 and all("joins the ranks of one host" in s for s in a.skipped)
    assert "--hosts on GPUs puts them on 2 emulated hosts" in a.skipped[0]


@pytest.mark.parametrize("argv,message", [
    (["--nranks", "6", "--hosts", "4"], "--nranks must be multiples of it"),
    (["--nranks", "4", "--hosts", "2", "--backends", "ringreduce/p2p"],
     "no backend to run: ringreduce/p2p skipped: it joins the ranks of one host"),
    (["--nranks", "2", "--backends", "ringreduce/hier"], "needs --hosts H"),
])
def test_refused_across_hosts(gpu, argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(argv + ["--no-results"])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_refused_under_torchrun(gpu, monkeypatch, capsys):
    """Under torchrun (outside the lab) every rank keeps its node's host id, so --hosts on GPUs
    would label one host's rows as hosts': refused, naming torchrun's nodes."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.delenv(cli.LAB_ENV, raising=False)
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(["--hosts", "2", "--no-results"])
    assert exc.value.code == 2 and "torchrun's nodes" in capsys.readouterr().err
    monkeypatch.setenv(cli.LAB_ENV, "2 emulated hosts")  # the lab's own torchrun: its hosts
    assert cli.parse_args(["--hosts", "2", "--no-results"]).backends[1] == "ringreduce/hier"


def test_cpu_hosts_unchanged():
    """On CPU tensors --hosts still adds ringreduce/hier beside the flat rows."""
    if torch.cuda.is_available():
        pytest.skip("checks the CPU's rows")
    a = cli.parse_args(["--nranks", "4", "--hosts", "2", "--backends", "ringreduce", "--no-results"])
    assert a.backends == ["ringreduce/shm", "ringreduce/ring", "ringreduce/oneshot", "ringreduce/hier"]


H0H1 = ["bench-h0", "bench-h0", "bench-h1", "bench-h1"]


@pytest.mark.parametrize("gpus,nccl,expect_nccl,shared", [
    (1, (2, 30, 7), H0H1, "1"),
    (1, (2, 28, 9), ["bench-h0-0", "bench-h0-1", "bench-h1-2", "bench-h1-3"], "1"),
    (2, (2, 28, 9), H0H1, None),  # a GPU per rank of a host: nothing to consent to
])
def test_each_rank_told_its_host(gpus, nccl, expect_nccl, shared, monkeypatch):
    """A spawned GPU rank's host (blocks of consecutive ranks) goes to ringreduce and NCCL before
    any communicator; NCCL's sockets on loopback, not InfiniBand; where a host's ranks share a GPU,
    NCCL's consent, and NCCL < 2.30, which refuses that, sees a host per rank while ringreduce
    still sees the emulated host. Ranks of different hosts on one GPU are no concern of NCCL's."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: nccl)
    threads = torch.get_num_threads()
    got = []
    try:
        for rank in range(4):
            for name in ("RINGREDUCE_HOST_ID", "NCCL_HOSTID", "NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE",
                         "NCCL_MULTI_RANK_GPU_ENABLE", "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"):
                monkeypatch.delenv(name, raising=False)
            host = launch.emulated_host(rank, 4, 2)
            assert launch._device_setup("cuda", rank, 4, host, 2) == torch.device("cuda", rank % gpus)
            got.append((os.environ["RINGREDUCE_HOST_ID"], os.environ["NCCL_HOSTID"]))
            assert os.environ["NCCL_SOCKET_IFNAME"] == "lo" and os.environ["NCCL_IB_DISABLE"] == "1"
            assert os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") == shared
    finally:
        torch.set_num_threads(threads)
    assert [h for h, _ in got] == ["bench-h0", "bench-h0", "bench-h1", "bench-h1"]
    assert [n for _, n in got] == expect_nccl


def test_lab_tells_nccl_the_host_and_the_link():
    """The lab's hosts: NCCL told the host and the interface (it would take every namespace for one
    host and pick any interface), the socket rate passed to the ranks for the bound."""
    from ringreduce.bench.netlab import Lab
    env = Lab.env(object.__new__(Lab), 1, {"PATH": "/bin"})
    assert env["NCCL_HOSTID"] == env["RINGREDUCE_HOST_ID"] == "lab-h1"
    assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "eth0"
    assert env["NCCL_IB_DISABLE"] == "1"  # InfiniBand would bypass the shaped link
    assert launch.lab_env({}, "lab", 2, 1.19712)[cli.LAB_GBPS_ENV] == "1.1971"
    assert cli.LAB_GBPS_ENV not in launch.lab_env({}, "lab", 2)


def test_wire_rows_on_gpu_hosts(monkeypatch):
    """The wire across hosts on GPUs is the hier transport's: all_reduce only, bf16 and fp8."""
    monkeypatch.setattr(bk, "DEVICE", "cuda")
    monkeypatch.setattr(bk, "HOSTS", 2)
    bf16 = bk.make("ringreduce/wire-bf16", "sum", 0, 4)
    assert bf16.transport == "hier" and bf16.group is None
    assert bf16.supports("all_reduce", torch.float32) is None
    assert "all_reduce only" in bf16.supports("reduce_scatter", torch.float32)
    assert "float16" in bk.make("ringreduce/wire-fp16", "avg", 0, 4).supports("all_reduce",
                                                                              torch.float32)
    assert bk.make("ringreduce/hier", "sum", 0, 4).transport == "hier"
    monkeypatch.setattr(bk, "HOSTS", 1)  # one host: the p2p transport's wire, reduce_scatter too
    assert bk.make("ringreduce/wire-bf16", "sum", 0, 2).supports("reduce_scatter", torch.float32) is None


def _row(backend, size, us):
    return {"backend": backend, "size_bytes": size, "time_us": us, "inplace": True,
            "collective": "all_reduce"}


def test_table_against_hier_and_the_link(capsys):
    """Each row's time over hier's, and hier's over the link's bound: 2(H-1)/H x size at the
    measured rate (16 MiB across 2 hosts at 1.2 GB/s: 13,981 us)."""
    M = 1 << 20
    assert report.link_bound_us(16 * M, 2, 1.2) == pytest.approx(16 * M / 1.2e3)
    assert report.link_bound_us(16 * M, 4, 1.2) == pytest.approx(1.5 * 16 * M / 1.2e3)
    rows = [_row("ringreduce/hier", 16 * M, 15000.0), _row("ringreduce/nccl", 16 * M, 30000.0),
            _row("torch/nccl", 16 * M, 18000.0), _row("ringreduce/wire-bf16", 16 * M, 8000.0)]
    report.print_hosts({"hosts": 2, "link_GBps": 1.2, "rows": rows})
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "16 MiB" in x).split()
    assert line[3:] == ["15000.0", "13981.0", "1.07", "2.00", "1.20"], line
    assert "wire" not in out  # print_wire's table has those
    report.print_hosts({"hosts": 1, "link_GBps": None, "rows": rows})
    assert capsys.readouterr().out == ""
