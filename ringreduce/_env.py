"""Every RINGREDUCE_* environment variable ringreduce and its build read, in one table: name, type,
what it accepts, default. Everything reads them through get(), so that a bad value raises the same
way for every knob: the variable, what it accepts, the value given. Imports nothing of ringreduce
(setup.py loads this file by path, before torch is importable).
docs/environment.md is the same table in words (tests/test_env.py keeps the two alike)."""
import math
import os
import re
from typing import Any, NamedTuple, Optional

# Every boolean knob takes these spellings (any case).
ON, OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_TC_SIZE = re.compile(r"^[0-9]+(\.[0-9]+)?(b|k|kb|m|mb|g|gb|kbit|mbit|gbit)?$", re.I)


class Knob(NamedTuple):
    name: str
    kind: str          # int, number, seconds, bool, choice, text, path, tc_size
    what: str          # what it sets, as the error message says it
    default: str       # as docs/environment.md says it (the code's default may depend on the group)
    lo: Optional[int] = None       # int: the least value
    hi: Optional[int] = None       # int: the largest value
    multiple: int = 1              # int: values are multiples of this
    choices: Any = ()  # choice: the values (or a function of none returning them); bool: (what on
    # means, what off means)
    unset: str = ""                # bool: what unset means where it is neither on nor off
    bad: Optional[str] = None      # a value it refuses (tests/test_env.py walks them)


def _shm_algos():
    from . import _C  # csrc/shm/protocol.h's kForcedAlgos, spelled once; never read by setup.py
    return tuple(_C.SHM_ALGOS)


def _p2p_algos():
    from . import _C  # csrc/cuda/p2p/plan.h's kForcedAlgos, spelled once; never read by setup.py
    return tuple(_C.P2P_ALGOS)


def _knobs(*ks):
    return {k.name: k for k in ks}


KNOBS = _knobs(
    # every transport
    Knob("RINGREDUCE_TIMEOUT", "seconds", "seconds any wait may take", "300", bad="soon"),
    Knob("RINGREDUCE_TRANSPORT", "choice", "the transport", "auto",
         choices=("auto", "shm", "p2p", "hier", "nccl"), bad="tcp"),
    Knob("RINGREDUCE_DEBUG", "bool", "log choices and checks", "off",
         choices=("log", "do not log"), bad="verbose"),
    Knob("RINGREDUCE_DETERMINISTIC", "bool", "rank-order reductions", "off",
         choices=("on", "off"), bad="maybe"),
    Knob("RINGREDUCE_HOST_ID", "text", "this process's host identity", "host name and boot id"),
    Knob("RINGREDUCE_HIER_PIECE_KB", "int", "the two-level plan's pipeline piece, KiB",
         "CPU: a quarter of the tensor, 4-16 MiB; CUDA: 8 MiB", lo=1, bad="0"),
    Knob("RINGREDUCE_HIER_PLAN", "choice", "the plan of a group across hosts", "auto",
         choices=("auto", "leaders"), bad="ring"),
    Knob("RINGREDUCE_LAB_BURST", "tc_size", "the emulated hosts' token bucket depth",
         "2 ms of the rate", bad="lots"),
    # flight recorder
    Knob("RINGREDUCE_TRACE_BUFFER", "int", "calls each flight recorder keeps; 0 turns it off",
         "2000", lo=0, bad="-1"),
    Knob("RINGREDUCE_TRACE_SIGNAL", "bool", "SIGUSR1 dumps the flight recorders", "off",
         choices=("dump on SIGUSR1", "do not"), bad="usr1"),
    Knob("RINGREDUCE_TRACE_DIR", "text", "where flight recorder dumps go",
         "$TMPDIR/ringreduce-trace"),
    # CPU (shared memory)
    Knob("RINGREDUCE_ALGO", "choice", "the CPU all-reduce algorithm", "auto",
         choices=_shm_algos, bad="tree"),
    Knob("RINGREDUCE_CALIBRATE", "choice", "where auto's CPU steps from 1 MiB up come from", "auto",
         choices=("auto", "off", "0", "force"), bad="sometimes"),
    Knob("RINGREDUCE_CPU_TUNING", "path", "the measured CPU table auto follows",
         "ringreduce/cpu_tuning.json", bad="/nonexistent/cpu_tuning.json"),
    Knob("RINGREDUCE_ONESHOT_MAX_BYTES", "int", "the largest one-shot all-reduce, bytes",
         "the table's entry, else 1 KiB at world 2, 32 KiB above", lo=0, bad="-1"),
    Knob("RINGREDUCE_SLICE_BYTES", "int", "the CPU ring's pipeline slice, bytes", "128 KiB",
         lo=64, bad="-5"),
    Knob("RINGREDUCE_CMA_BLOCK_BYTES", "int", "what cma reads from a peer at a time, bytes; 0: the "
         "whole chunk", "the slice", lo=0, bad="-1"),
    Knob("RINGREDUCE_SPIN_NS", "int", "busy-poll before waiting, ns",
         "50,000 (0 when ranks outnumber cores)", lo=0, bad="-1"),
    Knob("RINGREDUCE_YIELD_NS", "int", "sched_yield polling before sleeping, ns",
         "1 ms when ranks outnumber cores, else 0", lo=0, bad="1ms"),
    Knob("RINGREDUCE_STREAM", "choice", "non-temporal stores into shared memory", "auto",
         choices=("auto", "0", "1"), bad="sometimes"),
    # CUDA
    Knob("RINGREDUCE_BLOCKING_WAIT", "bool", "every synchronous CUDA call waits for the GPU", "off",
         choices=("wait", "do not"), bad="always"),
    Knob("RINGREDUCE_CUDA_ALGO", "choice", "the p2p algorithm", "auto",
         choices=_p2p_algos, bad="tree"),
    Knob("RINGREDUCE_CUDA_IMPORT", "bool", "reduce ordinary tensors where they lie", "on",
         choices=("reduce ordinary tensors where they lie", "copy them through the workspace"),
         bad="sometimes"),
    Knob("RINGREDUCE_CUDA_MPS", "bool", "whether an MPS daemon runs", "guessed",
         choices=("MPS runs", "it does not"), unset="look for the daemon's pipe", bad="maybe"),
    Knob("RINGREDUCE_CUDA_COPY_BYTES", "int", "the copy algorithm's largest piece, bytes", "8 MiB",
         lo=16, multiple=16, bad="100"),
    Knob("RINGREDUCE_CUDA_MAX_BLOCKS", "int", "a call's most thread blocks; 0: from the device",
         "the SM count over the ranks sharing a GPU", lo=0, bad="-1"),
    Knob("RINGREDUCE_CUDA_SYM_BLOCKS", "int", "a workspace call's most thread blocks",
         "the device's entry in ringreduce/gpu_tuning.json, else 24", lo=1, hi=64, bad="65"),
    Knob("RINGREDUCE_CUDA_CHANNELS", "int", "the most ring channels", "16", lo=1, hi=32, bad="0"),
    Knob("RINGREDUCE_CUDA_SLICE_BYTES", "int", "the largest p2p ring slice, bytes", "512 KiB",
         lo=16, multiple=16, bad="8"),
    Knob("RINGREDUCE_CUDA_CHUNK_BYTES", "int", "the symmetric workspace's largest piece, bytes",
         "16 MiB", lo=16, multiple=16, bad="two"),
    Knob("RINGREDUCE_NCCL_STAGING_BYTES", "int", "the nccl transport's staging buffer, bytes",
         "16 MiB", lo=16, bad="8"),
    # set by `python -m ringreduce.bench --link` for the ranks it starts, not by users
    Knob("RINGREDUCE_BENCH_LAB", "text", "the emulated hosts' lab the rank runs in", "unset"),
    Knob("RINGREDUCE_BENCH_LAB_GBPS", "number", "the GB/s one TCP stream got across the link",
         "unset", bad="fast"),
    # building (setup.py)
    Knob("RINGREDUCE_CUDA", "bool", "build the CUDA kernels",
         "CUDA when torch is a CUDA build, a toolkit is found and a GPU is visible",
         choices=("build the CUDA kernels", "do not"), unset="build them when a GPU is visible",
         bad="maybe"),
    Knob("RINGREDUCE_DEBUG_INFO", "bool", "build with debug info", "off",
         choices=("-g", "no debug info"), bad="full"),
)


def choices(k):
    return k.choices() if callable(k.choices) else k.choices


def accepts(k):
    """What knob k accepts, in words."""
    if k.kind == "int":
        s = "an integer"
        if k.multiple > 1:
            s = f"a multiple of {k.multiple}"
        if k.lo is not None and k.hi is not None:
            return f"{s} {k.lo}..{k.hi}"
        return f"{s} >= {k.lo}" if k.lo is not None else s
    if k.kind in ("seconds", "number"):
        return f"a finite number{' of seconds' if k.kind == 'seconds' else ''} > 0"
    if k.kind == "bool":
        s = f"one of {', '.join(ON)} ({k.choices[0]}) or {', '.join(OFF)} ({k.choices[1]})"
        return f"{s}, or unset ({k.unset})" if k.unset else s
    if k.kind == "choice":
        return f"one of {', '.join(choices(k))}"
    if k.kind == "path":
        return "none or the path of an existing file"
    if k.kind == "tc_size":
        return "a size as tc writes it (e.g. 4mb, 512kb)"
    return "any text"


def _refuse(k, raw):
    what = "" if k.kind == "bool" else f" ({k.what})"  # a boolean's accepts() says what it means
    return ValueError(f"ringreduce: {k.name} must be {accepts(k)}{what}, got {raw!r}")


def parse(k, raw):
    """raw (set, not blank) as knob k's value; ValueError naming k, what it accepts and raw."""
    v = raw.strip()
    if k.kind == "int":
        try:
            n = int(v)
        except ValueError:
            raise _refuse(k, raw) from None
        if (k.lo is not None and n < k.lo) or (k.hi is not None and n > k.hi) or n % k.multiple:
            raise _refuse(k, raw)
        return n
    if k.kind in ("seconds", "number"):
        try:
            x = float(v)
        except ValueError:
            raise _refuse(k, raw) from None
        if not x > 0 or math.isinf(x):  # nan, inf: no deadline at all
            raise _refuse(k, raw)
        return x
    if k.kind == "bool":
        if v.lower() in ON or v.lower() in OFF:
            return v.lower() in ON
        raise _refuse(k, raw)
    if k.kind == "choice":
        if v.lower() not in choices(k):
            raise _refuse(k, raw)
        return v.lower()
    if k.kind == "path":
        if v.lower() == "none":
            return "none"
        if not os.path.isfile(v):
            raise _refuse(k, raw)
        return v
    if k.kind == "tc_size":
        if not _TC_SIZE.match(v):
            raise _refuse(k, raw)
        return v
    return v


def is_set(name):
    """Whether name is set to something other than blanks."""
    if name not in KNOBS:
        raise KeyError(f"ringreduce: {name} is not in ringreduce/_env.py's table")
    return bool(os.environ.get(name, "").strip())


def get(name, default=None):
    """name's value from the environment, checked against the table; default when unset or blank
    (the caller's: many defaults depend on the group, the device or the tensor)."""
    if not is_set(name):
        return default
    return parse(KNOBS[name], os.environ[name])
