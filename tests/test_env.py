"""The table of environment knobs (ringreduce/_env.py): every RINGREDUCE_* read goes through it,
docs/environment.md lists every row, and a bad value of every knob raises naming the variable, the
value and what it accepts, where the code reads it (issue 83 item 4)."""
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import ringreduce as rr
from ringreduce import _C, _env
from dist_utils import run_ranks

REPO = pathlib.Path(__file__).resolve().parents[1]
# A read of a RINGREDUCE_ variable that does not go through the table (writes and pops are fine).
BYPASS = re.compile(r"""environ\.get\(\s*["']RINGREDUCE_|environ\[\s*["']RINGREDUCE_\w+["']\s*\](?!\s*=[^=])|"""
                    r"""["']RINGREDUCE_\w+["']\s+(not\s+)?in\s+os\.environ|getenv\(\s*"RINGREDUCE_""")


def sources():
    files = [REPO / "setup.py", *(REPO / "ringreduce").rglob("*.py")]
    files += [p for p in (REPO / "csrc").rglob("*") if p.suffix in (".cpp", ".h", ".cu", ".cuh")]
    return [p for p in files if p.name != "_env.py"]


def test_every_read_goes_through_the_table():
    bypass = [f"{p.relative_to(REPO)}:{n}: {line.strip()}" for p in sources()
              for n, line in enumerate(p.read_text().splitlines(), 1) if BYPASS.search(line)]
    assert bypass == [], "\n".join(bypass)
    text = "\n".join(p.read_text() for p in sources())
    read = set(re.findall(r"""_env\.(?:get|is_set)\(\s*["'](RINGREDUCE_\w+)["']""", text))
    assert read - set(_env.KNOBS) == set()  # get() would raise KeyError at run time anyway
    # Every row is read somewhere (by name or through a constant holding it).
    unread = [n for n in _env.KNOBS if n not in read and f'"{n}"' not in text]
    assert unread == [], unread


def test_docs_list_every_knob():
    """docs/environment.md's rows above its tests' section are the table's rows."""
    doc = (REPO / "docs" / "environment.md").read_text().split("| **tests** |")[0]
    rows = {name for line in doc.splitlines() if line.startswith("| `")
            for name in re.findall(r"`(RINGREDUCE_\w+)`", line.split(" | ")[0])}
    assert rows == set(_env.KNOBS), rows ^ set(_env.KNOBS)


def test_table_agrees_with_the_code():
    from ringreduce import collectives
    from ringreduce._cuda import policy
    k = _env.KNOBS
    assert _env.choices(k["RINGREDUCE_ALGO"]) == tuple(_C.SHM_ALGOS)
    assert k["RINGREDUCE_TRANSPORT"].choices == collectives.TRANSPORTS
    assert _env.choices(k["RINGREDUCE_CUDA_ALGO"]) == policy.ALGOS == tuple(_C.P2P_ALGOS)
    assert k["RINGREDUCE_CUDA_SYM_BLOCKS"].hi == _C.CUDA_DEFAULTS["max_sym_blocks"]
    layout = (REPO / "csrc" / "cuda" / "p2p" / "layout.h").read_text()
    assert f"kMaxChannels = {k['RINGREDUCE_CUDA_CHANNELS'].hi};" in layout
    assert _env.OFF == ("0", "false", "no", "off") and _env.ON == ("1", "true", "yes", "on")


def test_every_boolean_takes_the_same_spellings(monkeypatch):
    bools = [k for k in _env.KNOBS.values() if k.kind == "bool"]
    assert len(bools) >= 8
    for k in bools:
        for raw, want in [(s, True) for s in _env.ON] + [(s, False) for s in _env.OFF]:
            for spelled in (raw, raw.upper(), f" {raw} "):
                monkeypatch.setenv(k.name, spelled)
                assert _env.get(k.name) is want, (k.name, spelled)
        monkeypatch.setenv(k.name, "  ")
        assert _env.get(k.name, "unset") == "unset"  # blank: unset


def test_every_knob_but_free_text_has_a_bad_value():
    for k in _env.KNOBS.values():
        assert (k.bad is None) == (k.kind == "text"), k.name
        if k.bad is not None:
            with pytest.raises(ValueError) as e:
                _env.parse(k, k.bad)
            assert str(e.value) == (f"ringreduce: {k.name} must be {_env.accepts(k)}"
                                    f"{'' if k.kind == 'bool' else f' ({k.what})'}, got {k.bad!r}")


def _cpu_comm():
    from ringreduce import _shm
    _shm.Communicator(dist.new_group()).close()


def _hier_plan():
    from ringreduce import _hier
    _hier.plan_for(["a", "a", "b", "b"])


def _piece():
    from ringreduce._hier import two_level
    two_level.piece_bytes(1 << 20)


def _lab():
    from ringreduce.bench import netlab
    netlab.Lab(2, "1gbit")


def _bench_args():
    from ringreduce.bench import cli
    cli.parse_args(["--no-results"])


def _p2p():
    from ringreduce._cuda import policy
    policy.p2p_knobs()


def _cuda(fn):
    def read():
        from ringreduce._cuda import policy
        getattr(policy, fn)()
    return read


# What reads each knob in a rank (the first call that does, or the function the call runs);
# the build's two are setup.py's (test_build_knobs_checked below).
READERS = {
    "RINGREDUCE_TIMEOUT": _cpu_comm,
    "RINGREDUCE_TRANSPORT": lambda: rr.all_reduce(torch.ones(4), group=dist.new_group()),
    "RINGREDUCE_DEBUG": rr._read_environment,
    "RINGREDUCE_DETERMINISTIC": rr._read_environment,
    "RINGREDUCE_HIER_PIECE_KB": _piece,
    "RINGREDUCE_HIER_PLAN": _hier_plan,
    "RINGREDUCE_LAB_BURST": _lab,
    "RINGREDUCE_TRACE_BUFFER": _cpu_comm,
    "RINGREDUCE_TRACE_SIGNAL": lambda: rr._lifecycle.install_trace_signal(),
    "RINGREDUCE_ALGO": _cpu_comm,
    "RINGREDUCE_CALIBRATE": _cpu_comm,
    "RINGREDUCE_CPU_TUNING": _cpu_comm,
    "RINGREDUCE_ONESHOT_MAX_BYTES": _cpu_comm,
    "RINGREDUCE_SLICE_BYTES": _cpu_comm,
    "RINGREDUCE_CMA_BLOCK_BYTES": _cpu_comm,
    "RINGREDUCE_SPIN_NS": _cpu_comm,
    "RINGREDUCE_YIELD_NS": _cpu_comm,
    "RINGREDUCE_STREAM": _cpu_comm,
    "RINGREDUCE_BLOCKING_WAIT": _cuda("blocking_wait"),
    "RINGREDUCE_CUDA_MPS": _cuda("mps_active"),
    "RINGREDUCE_NCCL_STAGING_BYTES": _cuda("staging_bytes"),
    "RINGREDUCE_BENCH_LAB_GBPS": _bench_args,
    **{n: _p2p for n in ("RINGREDUCE_CUDA_ALGO", "RINGREDUCE_CUDA_IMPORT", "RINGREDUCE_CUDA_COPY_BYTES",
                         "RINGREDUCE_CUDA_MAX_BLOCKS", "RINGREDUCE_CUDA_SYM_BLOCKS",
                         "RINGREDUCE_CUDA_CHANNELS", "RINGREDUCE_CUDA_SLICE_BYTES",
                         "RINGREDUCE_CUDA_CHUNK_BYTES")},
}
BUILD = ("RINGREDUCE_CUDA", "RINGREDUCE_DEBUG_INFO")


def bad_values_worker(rank, world):
    """Each knob's bad value, set in turn, through the code that reads it: its error message."""
    out = {}
    for name, read in READERS.items():
        before = os.environ.get(name)
        os.environ[name] = _env.KNOBS[name].bad
        try:
            read()
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
        finally:
            if before is None:
                del os.environ[name]
            else:
                os.environ[name] = before
    rr.all_reduce(torch.ones(4))  # the process still works with the knobs back
    return out


def test_bad_value_of_every_knob_named_where_it_is_read():
    checked = {n for n, k in _env.KNOBS.items() if k.bad is not None}
    assert set(READERS) | set(BUILD) == checked
    (out,) = run_ranks(1, bad_values_worker, timeout=120)
    for name, msg in out.items():
        k = _env.KNOBS[name]
        assert msg.startswith(f"ringreduce: {name} must be {_env.accepts(k)}"), (name, msg)
        assert msg.endswith(f"got {k.bad!r}"), (name, msg)


def test_build_knobs_checked():
    """setup.py reads its two knobs from the same table (RINGREDUCE_CUDA: test_build.py)."""
    env = dict(os.environ, RINGREDUCE_CUDA="0", RINGREDUCE_DEBUG_INFO="full")
    p = subprocess.run([sys.executable, "setup.py", "--name"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    k = _env.KNOBS["RINGREDUCE_DEBUG_INFO"]
    assert f"RINGREDUCE_DEBUG_INFO must be {_env.accepts(k)}, got 'full'" in p.stderr, p.stderr[-2000:]


def test_unsupported_op_named_by_name():
    t = torch.ones(4)
    with pytest.raises(ValueError, match=r"op must be ReduceOp\.SUM, .*got ReduceOp\.PREMUL_SUM$"):
        rr.all_reduce(t, op=dist._make_nccl_premul_sum(2.0))
    with pytest.raises(ValueError, match=r"got ReduceOp\.BAND$"):
        rr.all_reduce(t, op=dist.ReduceOp.BAND)
