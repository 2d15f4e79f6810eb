"""Builds ringreduce._C with torch.utils.cpp_extension (ninja).

CUDA sources in csrc/cuda/ are compiled when torch is a CUDA build and a CUDA toolkit is found (no GPU
is needed to compile). RINGREDUCE_CUDA=0/1 forces either way. The toolkit is found from CUDA_HOME,
then from the real path of the `nvcc` on PATH (which may be a symlink outside the toolkit), then
/usr/local/cuda. Architectures: TORCH_CUDA_ARCH_LIST, default "8.0;9.0+PTX" (sm_80, sm_90, PTX).
No debug info unless RINGREDUCE_DEBUG_INFO=1: Python's flags add -g, which made the torch-heavy files
a third slower to compile and the library ~3x larger (CUDA build: 66 MB, 23 MB without);
symbols (function names) stay either way.
"""
import glob
import os
import shutil

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def find_cuda_home():
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:  # /usr/local/bin/nvcc -> /usr/local/cuda-13.0/bin/nvcc: follow the link
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates.append("/usr/local/cuda")
    for c in candidates:
        # A toolkit has headers too: /usr/local/bin/nvcc may be a wrapper script, not a link.
        if c and os.path.isfile(os.path.join(c, "bin", "nvcc")) and os.path.isfile(
                os.path.join(c, "include", "cuda_runtime_api.h")):
            return c
    return None


def want_cuda(torch_cuda, cuda_home, cuda_sources):
    flag = os.environ.get("RINGREDUCE_CUDA", "").strip()
    if flag == "0":
        return False
    ok = bool(torch_cuda and cuda_home and cuda_sources)
    if flag == "1" and not ok:
        raise RuntimeError(
            "RINGREDUCE_CUDA=1 but CUDA cannot be built: torch CUDA version=%r, toolkit=%r, "
            "sources=%d" % (torch_cuda, cuda_home, len(cuda_sources)))
    return ok


cuda_home = find_cuda_home()
if cuda_home:
    # cpp_extension reads CUDA_HOME when it is imported; set it first.
    os.environ["CUDA_HOME"] = cuda_home
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")

import torch  # noqa: E402
from torch.utils import cpp_extension  # noqa: E402

cpu_sources = ["csrc/bindings.cpp", "csrc/backend.cpp", "csrc/shm_comm.cpp", "csrc/ops.cpp",
               "csrc/cpu/reduce.cpp",
               "csrc/shm/protocol.cpp", "csrc/shm/segment.cpp", "csrc/host/peers.cpp", "csrc/host/recorder.cpp"]
cuda_sources = sorted(glob.glob("csrc/cuda/*.cu")) + sorted(glob.glob("csrc/cuda/*.cpp"))
with_cuda = want_cuda(torch.version.cuda, cuda_home, cuda_sources)
print("ringreduce: building %s (torch %s, CUDA toolkit %s)" % (
    "CPU + CUDA" if with_cuda else "CPU only", torch.__version__, cuda_home))

cxx_flags = ["-O3", "-Wall", "-Wno-unused-function"]
if os.environ.get("RINGREDUCE_DEBUG_INFO", "").strip() != "1":
    cxx_flags.append("-g0")
include_dirs = [os.path.join(HERE, "csrc")]
if with_cuda:
    import sysconfig
    nccl_include = os.path.join(sysconfig.get_paths()["purelib"], "nvidia", "nccl", "include")
    include_dirs.append(nccl_include)
    ext = cpp_extension.CUDAExtension(
        "ringreduce._C", cpu_sources + cuda_sources, include_dirs=include_dirs,
        define_macros=[("RINGREDUCE_WITH_CUDA", "1")],
        extra_compile_args={"cxx": cxx_flags,
                            "nvcc": ["-O3", "--expt-relaxed-constexpr",
                                     # one thread per architecture: the kernels' file is the
                                     # build's longest step, and each arch compiles alone
                                     "--threads", "2"]})
else:
    ext = cpp_extension.CppExtension("ringreduce._C", cpu_sources, include_dirs=include_dirs,
                                     extra_compile_args={"cxx": cxx_flags})

setup(
    packages=find_packages(include=["ringreduce", "ringreduce.*"]),
    package_data={"ringreduce": ["gpu_tuning.json"]},  # auto's measured thresholds (_cuda.py)
    ext_modules=[ext],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
)
