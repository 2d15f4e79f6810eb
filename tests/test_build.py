"""What the build decides about CUDA and says (setup.py, run as `python setup.py --name`: it decides
and prints, then compiles nothing), and what a build without CUDA says when it meets a CUDA tensor."""
import os
import subprocess
import sys

import pytest
import torch

from ringreduce import _C

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def decide(flag):
    """(exit status, stdout, stderr) of setup.py's decision with RINGREDUCE_CUDA=flag (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k != "RINGREDUCE_CUDA"}
    if flag is not None:
        env["RINGREDUCE_CUDA"] = flag
    p = subprocess.run([sys.executable, "setup.py", "--name"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout, p.stderr


def test_build_builds_cuda_only_where_a_gpu_is_visible_or_asked():
    status, out, err = decide(None)
    assert status == 0, err[-2000:]
    line = next(x for x in out.splitlines() if x.startswith("ringreduce: building "))
    if torch.version.cuda is None:
        assert line.startswith("ringreduce: building CPU only (torch is a CPU-only build;"), line
    elif torch.cuda.device_count() == 0:  # a toolkit may be missing too; never CUDA here
        assert line.startswith("ringreduce: building CPU only (no "), line
        assert "no GPU visible; RINGREDUCE_CUDA=1 builds the CUDA kernels anyway" in line or \
            "no CUDA toolkit found" in line, line
    else:
        assert line.startswith("ringreduce: building CPU + CUDA (") or "no CUDA toolkit" in line
    status, out, _ = decide("0")
    assert status == 0 and "ringreduce: building CPU only (RINGREDUCE_CUDA=0;" in out, out


def test_build_flag_checked():
    status, _, err = decide("maybe")
    assert status != 0
    assert "RINGREDUCE_CUDA must be one of 1, true, yes, on (build the CUDA kernels) or 0, false, " \
           "no, off (do not), or unset (build them when a GPU is visible), got 'maybe'" in err, err[-2000:]
    status, out, err = decide("1")
    if torch.version.cuda is None:
        assert status != 0
        assert "RINGREDUCE_CUDA=1 but CUDA cannot be built: torch is a CPU-only build" in err, err
    elif status == 0:
        assert "ringreduce: building CPU + CUDA (RINGREDUCE_CUDA=1;" in out, out
    else:
        assert "RINGREDUCE_CUDA=1 but CUDA cannot be built: no CUDA toolkit" in err, err[-2000:]


@pytest.mark.skipif(getattr(_C, "cuda_compiled", False), reason="this build has CUDA kernels")
def test_build_without_cuda_says_how_to_rebuild():
    """The first CUDA call of a build without CUDA names the command that builds the kernels."""
    from ringreduce import _cuda
    with pytest.raises(RuntimeError) as e:
        _cuda.get_communicator(None, torch.device("cuda", 0))
    assert str(e.value).startswith("ringreduce: this build has no CUDA kernels: "), e.value
    assert str(e.value).endswith(": RINGREDUCE_CUDA=1 pip install --no-build-isolation -e ."), e.value
    if torch.version.cuda is None:
        assert f"torch {torch.__version__}, a CPU-only build" in str(e.value), e.value
