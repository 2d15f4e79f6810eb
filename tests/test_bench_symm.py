"""The bench's peer on one GPU, torch's SymmetricMemory all-reduces (torch/symm-*, issue 50 item
6): the labels, the line that says why they are skipped without a GPU, supports(), and the backend's
calls checked against stand-ins for torch.ops.symm_mem (no GPU needed). The last test runs the
real ops and needs a GPU."""
import os
import subprocess
import sys
import types

import pytest
import torch
import torch.distributed as dist

from ringreduce.bench import backends as bk
from ringreduce.bench import cli, runner

LABELS = ["torch/symm-oneshot", "torch/symm-twoshot", "torch/symm-oneshot-sym",
          "torch/symm-twoshot-sym"]
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the run without a GPU")


@no_gpu
def test_default_run_skips_the_peer_with_one_line(capsys):
    a = cli.parse_args([])
    assert not [b for b in a.backends if b.startswith("torch/symm")]
    assert a.skipped == ["torch/symm-* skipped: no GPU"]
    assert "torch/gloo" in a.backends  # the rest of the default set is untouched


@no_gpu
def test_skip_line_printed_and_in_the_json(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    res = subprocess.run([sys.executable, "-m", "ringreduce.bench", "--quick", "--nranks", "2",
                          "-e", "1K", "--collectives", "all_reduce", "--backends",
                          "torch,torch/symm", "--json", str(tmp_path / "r.json"), "--no-results"],
                         capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("# note: torch/symm-* skipped: no GPU") == 1
    import json
    run = json.loads((tmp_path / "r.json").read_text())["runs"][0]
    assert "torch/symm-* skipped: no GPU" in run["notes"]
    assert run["backends"] == ["torch/gloo"]


@no_gpu
@pytest.mark.parametrize("argv,message", [
    (["--backends", "torch/symm"], "no backend to run: torch/symm-* skipped: no GPU"),
    (["--backends", "torch/symm-twoshot-sym"], "--backends torch/symm-twoshot-sym: no GPU"),
])
def test_nothing_or_a_named_peer_without_gpu_is_an_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_labels_where_the_ops_exist(monkeypatch):
    monkeypatch.setattr(cli, "symm_unavailable", lambda device: None)
    parser = cli.build_parser()
    skipped = []
    out = cli.expand_backends(["ringreduce", "torch", "torch/symm", "torch/symm-oneshot"], "cuda",
                              parser, 1, skipped)
    # the umbrella name is all four labels, after the GPU's other rows; a repeat is dropped
    assert out == ["ringreduce/p2p", "ringreduce/nccl", "torch/nccl"] + LABELS
    assert skipped == []


def test_default_set_on_a_gpu_includes_the_peer(monkeypatch):
    monkeypatch.setattr(cli, "symm_unavailable", lambda device: None)
    monkeypatch.setattr(cli.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cli.torch.cuda, "device_count", lambda: 1)
    a = cli.parse_args([])
    assert a.device == "cuda" and a.skipped == []
    assert [b for b in a.backends if b.startswith("torch/symm")] == LABELS


def test_why_the_peer_cannot_run(monkeypatch):
    assert cli.symm_unavailable("cpu") == "no GPU"
    monkeypatch.setattr(cli.torch, "ops", types.SimpleNamespace(
        symm_mem=types.SimpleNamespace(one_shot_all_reduce_out=object())))
    why = cli.symm_unavailable("cuda")
    assert why == f"torch {torch.__version__} has no torch.ops.symm_mem.two_shot_all_reduce_"
    monkeypatch.setattr(cli.torch, "ops", types.SimpleNamespace(symm_mem=types.SimpleNamespace(
        one_shot_all_reduce_out=object(), two_shot_all_reduce_=object())))
    assert cli.symm_unavailable("cuda") is None


@pytest.mark.parametrize("gpus,ranks,allowed", [(1, 2, "1"), (2, 2, None)])
def test_ranks_sharing_a_gpu_may_rendezvous(gpus, ranks, allowed, monkeypatch):
    """The launcher's consent for SymmetricMemory's rendezvous of ranks on one device, set before
    any rank touches it; ranks on GPUs of their own are left to torch's check."""
    from ringreduce.bench import launch
    for name in ("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "NCCL_MULTI_RANK_GPU_ENABLE",
                 "NCCL_HOSTID", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 28, 9))
    threads = torch.get_num_threads()
    try:
        assert launch._device_setup("cuda", 1, ranks) == torch.device("cuda", 1 % gpus)
    finally:
        torch.set_num_threads(threads)
    assert os.environ.get("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES") == allowed


# -- the backend against stand-ins for torch.distributed._symmetric_memory and torch.ops.symm_mem --
class FakeSymm:
    """empty() gives CPU tensors; every rendezvous is recorded."""

    def __init__(self):
        self.rendezvous_of = []

    def empty(self, numel, dtype, device):
        return torch.empty(numel, dtype=dtype, device=device)

    def rendezvous(self, tensor, group_name):
        self.rendezvous_of.append((tensor.data_ptr(), tensor.numel(), group_name))


class FakeOps:
    """The two ops on rank 0 of two: the sum is the input plus the peer's (peer(input); by default
    a peer with the same input). Every call is recorded as (op, input data_ptr, reduce_op, group,
    output data_ptr). broken: the ops write nothing."""

    def __init__(self, peer=lambda inp: inp, broken=False):
        self.peer, self.broken, self.calls = peer, broken, []

    def one_shot_all_reduce_out(self, inp, reduce_op, group_name, out):
        self.calls.append(("one_shot", inp.data_ptr(), reduce_op, group_name, out.data_ptr()))
        if not self.broken:
            torch.add(inp, self.peer(inp), out=out)
        return out

    def two_shot_all_reduce_(self, inp, reduce_op, group_name):
        self.calls.append(("two_shot", inp.data_ptr(), reduce_op, group_name, inp.data_ptr()))
        if not self.broken:
            inp.add_(self.peer(inp))
        return inp


@pytest.fixture
def world_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def make(label, monkeypatch, op="sum", **fake):
    symm = FakeSymm()
    monkeypatch.setattr(bk, "_symm_mem", lambda: symm)
    b = bk.make(label, op, 0, 1)
    assert isinstance(b, bk.TorchSymm)
    b.ops = FakeOps(**fake)
    return b, symm


@pytest.mark.parametrize("label", LABELS)
def test_supports_all_reduce_sum_of_float_and_bfloat16(label, monkeypatch, world_one):
    b, _ = make(label, monkeypatch)
    assert b.supports("all_reduce", torch.float32) is None
    assert b.supports("all_reduce", torch.bfloat16) is None
    assert "all-reduces" in b.supports("reduce_scatter", torch.float32)
    assert "all-reduces" in b.supports("all_gather", torch.float32)
    assert b.supports("all_reduce", torch.float16) == \
        "torch.ops.symm_mem's kernels are built for float and bfloat16, not float16"
    assert "not int32" in b.supports("all_reduce", torch.int32)
    for op in ("avg", "max", "prod", "min"):
        assert make(label, monkeypatch, op=op)[0].supports("all_reduce", torch.float32) == \
            "torch.ops.symm_mem's all-reduces sum only"


@pytest.mark.parametrize("label,op", [("torch/symm-oneshot", "one_shot"),
                                      ("torch/symm-twoshot", "two_shot")])
def test_ordinary_tensor_goes_through_one_symmetric_buffer(label, op, monkeypatch, world_one):
    b, symm = make(label, monkeypatch)
    t = torch.arange(8, dtype=torch.float32)
    assert b.own_tensor(t) is t  # the buffer is made here, untimed
    assert len(symm.rendezvous_of) == 1
    buf_ptr, numel, group = symm.rendezvous_of[0]
    assert (numel, group) == (8, dist.group.WORLD.group_name) and buf_ptr != t.data_ptr()
    assert b.result_tensor(t) is t
    b.all_reduce(t)
    b.all_reduce(t)
    assert torch.equal(t, torch.arange(8, dtype=torch.float32) * 4)  # copied in and out each call
    assert len(symm.rendezvous_of) == 1  # one buffer per size, kept
    kind, inp, reduce_op, g, out = b.ops.calls[0]
    assert (kind, inp, reduce_op, g) == (op, buf_ptr, "sum", group)
    # one-shot writes the tensor itself; two-shot reduces in the buffer, copied back after
    assert out == (t.data_ptr() if op == "one_shot" else buf_ptr)
    b.release()
    b.own_tensor(t)
    assert len(symm.rendezvous_of) == 2  # released: the next size gets its own


@pytest.mark.parametrize("label", ["torch/symm-oneshot-sym", "torch/symm-twoshot-sym"])
def test_symmetric_tensor_reduced_where_it_is(label, monkeypatch, world_one):
    b, symm = make(label, monkeypatch)
    like = torch.empty(6, dtype=torch.bfloat16)
    t = b.own_tensor(like)
    assert t is not like and t.data_ptr() == symm.rendezvous_of[0][0]
    assert b.own_tensor(like).data_ptr() == t.data_ptr()  # the same buffer every iteration
    t.copy_(torch.arange(6))
    res = b.result_tensor(t)
    b.all_reduce(t)
    kind, inp, _, _, out = b.ops.calls[0]
    assert inp == t.data_ptr()
    if label.startswith("torch/symm-oneshot"):  # its kernel reads every input while it writes
        assert kind == "one_shot" and res is not t and out == res.data_ptr()
        assert torch.equal(t, torch.arange(6, dtype=torch.bfloat16))
    else:
        assert kind == "two_shot" and res is t
    assert torch.equal(res, torch.arange(6, dtype=torch.bfloat16) * 2)


@pytest.mark.parametrize("label", LABELS)
@pytest.mark.parametrize("inplace", [False, True])
def test_the_sweep_checks_where_the_result_lands(label, inplace, monkeypatch, world_one):
    """runner.Buffers as rank 0 of two, the ops adding rank 1's input: right with working ops; with
    ops that write nothing, the check sees it in the tensor the result should be in."""
    from ringreduce.bench.data import value
    args = types.SimpleNamespace(dtype=torch.float32, op="sum", check=1)
    ctx = types.SimpleNamespace(args=args, rank=0, world=2, device=torch.device("cpu"))
    rank_one = lambda inp: value(1, torch.arange(inp.numel()), 2, inp.dtype, "sum").to(inp.dtype)  # noqa: E731
    for broken in (False, True):
        b, _ = make(label, monkeypatch, peer=rank_one, broken=broken)
        buffers = runner.Buffers("all_reduce", 100, ctx)
        call, result = buffers.prepare(b, inplace)
        call()
        wrong = buffers.ref.wrong(result)
        assert (wrong > 0) == broken, (broken, wrong)
        b.release()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_peer_quick_sweep_on_the_gpu(tmp_path):
    """The real ops, two ranks (on one GPU where there is one: the launcher sets
    TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1): every row checked, the run exits 0."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    res = subprocess.run([sys.executable, "-m", "ringreduce.bench", "--quick", "--nranks", "2",
                          "--collectives", "all_reduce", "--backends", "torch/symm", "--no-results"],
                         capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = [line.split() for line in res.stdout.splitlines()
            if line.strip() and not line.startswith("#")]
    assert sorted({f[4] for f in rows}) == sorted(LABELS), res.stdout[-3000:]
    assert all(f[8] == "0" and f[12] == "0" for f in rows), res.stdout[-3000:]
