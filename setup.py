"""Builds ringreduce._C with torch.utils.cpp_extension (ninja).

CUDA sources in csrc/cuda/ are compiled when torch is a CUDA build, a CUDA toolkit is found and a GPU
is visible. RINGREDUCE_CUDA=1 compiles them without a GPU (a login node building for GPU nodes; CI,
so the kernels compile every run), RINGREDUCE_CUDA=0 never. GPUs are counted with
torch.cuda.device_count(): it asks NVML, so the build starts no CUDA context, and it honours
CUDA_VISIBLE_DEVICES (nvidia-smi is often missing from containers that have GPUs, and /dev/nvidia*
exist where the GPUs are hidden from this process). The toolkit is found from CUDA_HOME,
then from the real path of the `nvcc` on PATH (which may be a symlink outside the toolkit), then
/usr/local/cuda. Architectures: TORCH_CUDA_ARCH_LIST, default "8.0;9.0+PTX" (sm_80, sm_90, PTX).
No debug info unless RINGREDUCE_DEBUG_INFO=1: Python's flags add -g, which made the torch-heavy files
a third slower to compile and the library ~3x larger (CUDA build: 66 MB, 23 MB without);
symbols (function names) stay either way.

What the build does is said in lines starting "ringreduce:" (what it compiles, for which
architectures, one line per file compiled). pip shows a build's output only with -v, so these lines
also go to the terminal (/dev/tty) when there is one.
"""
import glob
import importlib.util
import os
import re
import shutil
import sys
import threading
import time

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))
# The table of environment knobs, by path: the package itself needs torch and the built library.
_spec = importlib.util.spec_from_file_location("_rr_env", os.path.join(HERE, "ringreduce", "_env.py"))
_env = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_env)


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


def cuda_flag():
    """RINGREDUCE_CUDA: "1", "0" or "" (unset), checked before torch is imported (seconds)."""
    try:
        on = _env.get("RINGREDUCE_CUDA")
    except ValueError as e:
        raise RuntimeError(str(e)) from None
    return "" if on is None else "1" if on else "0"


def cuda_choice(flag, torch_cuda, cuda_home, cuda_sources, count_gpus):
    """(build the CUDA sources?, why): RINGREDUCE_CUDA=1 or 0 decides; unset, a visible GPU does."""
    if flag == "0":
        return False, "RINGREDUCE_CUDA=0"
    missing = ("torch is a CPU-only build" if not torch_cuda else
               "no CUDA toolkit found (CUDA_HOME, the nvcc on PATH, /usr/local/cuda)"
               if not cuda_home else "no CUDA sources" if not cuda_sources else None)
    if flag == "1":
        if missing:
            raise RuntimeError("RINGREDUCE_CUDA=1 but CUDA cannot be built: %s (torch CUDA version "
                               "%r, toolkit %r)" % (missing, torch_cuda, cuda_home))
        return True, "RINGREDUCE_CUDA=1"
    if missing:
        return False, missing
    gpus = count_gpus()
    if gpus == 0:
        return False, "no GPU visible; RINGREDUCE_CUDA=1 builds the CUDA kernels anyway"
    return True, "%d GPU%s visible" % (gpus, "s" if gpus > 1 else "")


_stdout = 1  # where say() writes without a terminal: our stdout (ninja_steps: not its own pipe)


def say(text):
    """A line the user sees: on the terminal when there is one (pip hides our stdout without -v),
    else on stdout."""
    try:
        with open("/dev/tty", "w") as tty:
            tty.write(text + "\n")
            return
    except OSError:  # no controlling terminal (CI, a batch job)
        pass
    sys.stdout.flush()
    os.write(_stdout, (text + "\n").encode())


def architectures():
    """The targets nvcc compiles for, e.g. "sm_80, sm_90, PTX compute_90"."""
    try:
        flags = cpp_extension._get_cuda_arch_flags()
    except Exception:  # a private helper of torch: fall back to the setting itself
        return "TORCH_CUDA_ARCH_LIST=" + os.environ["TORCH_CUDA_ARCH_LIST"]
    codes = re.findall(r",code=\[?([\w,]+)", " ".join(flags))
    names = list(dict.fromkeys(c for group in codes for c in group.split(",")))
    return ", ".join([n for n in names if n.startswith("sm_")] +
                     ["PTX " + n for n in names if not n.startswith("sm_")])


flag = cuda_flag()
cuda_home = find_cuda_home()
if cuda_home:
    # cpp_extension reads CUDA_HOME when it is imported; set it first.
    os.environ["CUDA_HOME"] = cuda_home
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")

import torch  # noqa: E402
from torch.utils import cpp_extension  # noqa: E402

# csrc/binding/ is the torch side (every file that includes torch or Python); the folders beside it
# are torch-free. cuda_comm*.cpp are the CUDA communicator's binding, built with the kernels.
cpu_sources = (sorted(f for f in glob.glob("csrc/binding/*.cpp") if "cuda_" not in f) +
               sorted(glob.glob("csrc/cpu/*.cpp")) + sorted(glob.glob("csrc/shm/*.cpp")) +
               sorted(glob.glob("csrc/runtime/*.cpp")))
cuda_sources = (sorted(glob.glob("csrc/cuda/**/*.cu", recursive=True)) +
                sorted(glob.glob("csrc/cuda/**/*.cpp", recursive=True)) +
                sorted(glob.glob("csrc/binding/cuda_*.cpp")))
with_cuda, why = cuda_choice(flag, torch.version.cuda, cuda_home, cuda_sources,
                             torch.cuda.device_count)
print("ringreduce: building %s (%s; torch %s, CUDA toolkit %s)" % (
    "CPU + CUDA" if with_cuda else "CPU only", why, torch.__version__, cuda_home))

cxx_flags = ["-O3", "-Wall", "-Wno-unused-function"]
if not _env.get("RINGREDUCE_DEBUG_INFO", False):
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


class Build(cpp_extension.BuildExtension.with_options(use_ninja=True)):
    """torch's build, saying what it compiles: a line first, one per file compiled, one at the end."""

    def build_extensions(self):
        start = time.monotonic()
        cu = [f for f in cuda_sources if f.endswith(".cu")] if with_cuda else []
        plan = "%d C++ files" % (len(ext.sources) - len(cu))
        if cu:
            plan += " and %d CUDA files for %s (nvcc %s; the CUDA files are the long steps)" % (
                len(cu), architectures(), os.path.join(cuda_home, "bin", "nvcc"))
        say("ringreduce: building %s (%s): %s" % (
            "CPU + CUDA" if with_cuda else "CPU only", why, plan))
        with ninja_steps(ext.sources, start):
            super().build_extensions()
        say("ringreduce: built ringreduce._C in %.0f s" % (time.monotonic() - start))


class ninja_steps:
    """Says "[k/n] compiled <file>" for each "[k/n] ... -c <file>" line ninja writes to stdout (torch
    runs ninja with our stdout, fd 1), passing every line on unchanged, and every HEARTBEAT_S that
    it is still building (nvcc's files take minutes each: no line for minutes looks like a hang)."""

    HEARTBEAT_S = 60

    def __init__(self, sources, start):
        self.pending = [os.path.relpath(os.path.abspath(f), HERE) for f in sources]
        self.total = len(self.pending)
        self.done = None  # (k, n) of ninja's last line
        self.start = start
        self.quiet = threading.Event()  # set: the build is over

    def __enter__(self):
        global _stdout
        sys.stdout.flush()
        self.saved = _stdout = os.dup(1)
        read, write = os.pipe()
        os.dup2(write, 1)
        os.close(write)
        self.threads = [threading.Thread(target=self._pump, args=(read,), daemon=True),
                        threading.Thread(target=self._heartbeat, daemon=True)]
        for t in self.threads:
            t.start()

    def _pump(self, read):
        with os.fdopen(read, "rb") as pipe:
            for raw in pipe:
                os.write(self.saved, raw)
                m = re.match(rb"\[(\d+)/(\d+)\] .* -c (\S+)", raw)
                if m:
                    src = os.path.relpath(m.group(3).decode(errors="replace"), HERE)
                    if src in self.pending:
                        self.pending.remove(src)
                    self.done = int(m.group(1)), int(m.group(2))
                    say("ringreduce: [%d/%d] compiled %s (%.0f s)" % (
                        self.done + (src, self.elapsed())))

    def _heartbeat(self):
        while not self.quiet.wait(self.HEARTBEAT_S):
            text = "ringreduce: still building (%.0f s" % self.elapsed()
            if self.done:
                text += "; %d of %d files compiled" % self.done
                if self.done[1] == self.total and self.pending:  # a full build: these remain
                    text += "; left: " + ", ".join(self.pending[:3]) + (
                        ", ..." if len(self.pending) > 3 else "")
            say(text + ")")

    def elapsed(self):
        return time.monotonic() - self.start

    def __exit__(self, *exc):
        global _stdout
        sys.stdout.flush()
        self.quiet.set()
        os.dup2(self.saved, 1)  # the pipe's last writer closes: the reader sees its end
        for t in self.threads:
            t.join()
        _stdout = 1
        os.close(self.saved)


setup(
    packages=find_packages(include=["ringreduce", "ringreduce.*"]),
    package_data={"ringreduce": ["gpu_tuning.json", "cpu_tuning.json"]},  # auto's measured tables (_cuda/policy.py, _shm.py)
    ext_modules=[ext],
    cmdclass={"build_ext": Build},
)
