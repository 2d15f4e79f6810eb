"""Every code block of README.md and docs/*.md runs as written (issue 53).

What runs:
  - each ```python block, as a script: saved under the name its `# torchrun ... NAME.py ARGS`
    comment lines give (among its first lines; each such line is a run of its own; without one,
    as snippet.py) and started as that line starts it;
  - each torchrun command line of the other blocks (```bash and the like; `\\` continuations
    joined; `VAR=value` assignments before it are set).
Both at world 2 and at world 3 (--nproc-per-node replaced by the world), on the CPU, in a fresh
folder that holds links to the repository's examples/ and benchmarks/ (commands name them as from
the repository's root). Every rank must exit with status 0 within RUN_TIMEOUT; a failure names the
block's file and line, the command, and every rank's last lines of output.
Not run: the other shell lines (installs, pytest, cmake: CI runs those) and output (```text).

Marks: a block (or a torchrun line) that contains "# needs a GPU" is skipped where torch sees no
CUDA device ("# needs a GPU per rank": fewer GPUs than ranks), and runs where it does. A block that
imports a module not installed (lightning, accelerate: the test extra) is skipped, unless
RINGREDUCE_REQUIRE_FRAMEWORKS=1 (CI), as in tests/test_frameworks.py.

How the ranks start: as torchrun starts them, by default on the tests' prefork harness
(tests/dist_utils.py: forked from a server that imported torch once, a whole process each, exit
included; this file's server also imports what the snippets import that costs seconds, PRELOAD):
each rank gets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR/MASTER_PORT, TORCHELASTIC_*, OMP_NUM_THREADS=1), sys.argv, and runs the script as
__main__. A real torchrun launch costs ~10 s on the 2-core CI machine (its agent and every rank
import torch), so RR_SNIPPETS_TORCHRUN=1 asks for it (python -m torch.distributed.run, the line's
options kept, --standalone added); RR_TEST_SPAWN=1 starts each rank as a fresh `python` instead of
a fork. The whole file: about 75 s of CPU, 100 s on the 2-core machine beside other builds.

Also checked, cheaply: a broken snippet fails with its place and output; the README has a runnable
block per entry point; every Python block is tagged ```python; every docs/*.md is linked from the
README, and every relative link (and #anchor) of the pages reached resolves.
"""
import dataclasses
import os
import pathlib
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
WORLDS = (2, 3)
RUN_TIMEOUT = 120  # seconds per run; a snippet takes 1-10 s (a real torchrun launch 10-20 s)
LINKED = ("examples", "benchmarks")  # what the commands name as from the repository's root
GPU_MARK = "# needs a GPU"
PYTHON_TAGS = {"python", "py", "python3"}
# What the snippets import that costs seconds a rank (DDP imports torch._dynamo): imported once, by
# the prefork server the snippets' ranks are forked from (missing ones are left out).
PRELOAD = ("torch._dynamo", "lightning.pytorch", "accelerate")


@dataclasses.dataclass
class Snippet:
    path: pathlib.Path
    line: int          # of the block's first line (or the command's) in its file
    command: str       # the torchrun line that runs it
    code: str = None   # a Python block's text, saved as the command's script; None: a shell line
    gpu: bool = False  # marked "# needs a GPU"
    gpu_per_rank: bool = False  # marked "# needs a GPU per rank" (ranks cannot share one)

    @property
    def where(self):
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def id(self):
        words = _words(self.command)
        return f"{self.where} {' '.join(words[words.index('torchrun') + 1:])}"


def blocks(path):
    """(info string, first line number, text) of each fenced block of a markdown file."""
    out, fence, info, start, body = [], None, "", 0, []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        m = re.match(r"^\s{0,3}(`{3,}|~{3,})\s*(.*)$", line)
        if fence is None:
            if m:
                fence, info, start, body = m.group(1), m.group(2).strip(), n + 1, []
        elif m and m.group(1).startswith(fence) and not m.group(2):
            out.append((info, start, "\n".join(body) + "\n"))
            fence = None
        else:
            body.append(line)
    return out


def command_lines(text, first_line):
    """(line number, command) for each command of a shell block, `\\` continuations joined."""
    out, parts, start = [], [], None
    for n, line in enumerate(text.splitlines(), first_line):
        if start is None:
            start = n
        if line.rstrip().endswith("\\"):
            parts.append(line.rstrip()[:-1])
            continue
        parts.append(line)
        out.append((start, " ".join(p.strip() for p in parts)))
        parts, start = [], None
    return out


def is_torchrun(command):
    words = _words(command)
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
        words = words[1:]
    return bool(words) and words[0] == "torchrun"


def _words(command):
    try:
        return shlex.split(command, comments=True)
    except ValueError:
        return []


def torchrun_comments(code):
    """The `# torchrun ...` lines among a Python block's first comment lines."""
    out = []
    for line in code.splitlines():
        if not line.startswith("#"):
            break
        if is_torchrun(line[1:].strip()):
            out.append(line[1:].strip())
    return out


def _marks(text):
    return GPU_MARK in text, GPU_MARK + " per rank" in text


def find_snippets():
    out = []
    for path in DOC_FILES:
        for info, start, text in blocks(path):
            lang = info.split()[0].lower() if info else ""
            if lang in PYTHON_TAGS:
                for cmd in torchrun_comments(text) or ["torchrun --nproc-per-node=2 snippet.py"]:
                    out.append(Snippet(path, start, cmd, text, *_marks(text)))
            elif lang not in ("text", "console-output"):
                marks = [l for l in text.splitlines() if l.strip().startswith(GPU_MARK)]
                for n, cmd in command_lines(text, start):
                    if is_torchrun(cmd):
                        out.append(Snippet(path, n, cmd, None, *_marks(" ".join(marks + [cmd]))))
    return out


SNIPPETS = find_snippets()


def have_gpu():
    # Not at import: the ranks import this module too, and must not start CUDA before the script.
    return torch.cuda.is_available()


# -- a torchrun line, understood -----------------------------------------------------------------
@dataclasses.dataclass
class Launch:
    env: dict          # the line's VAR=value assignments
    options: list      # torchrun's options, --nproc-per-node left out
    max_restarts: int
    script: str
    args: list


def parse_torchrun(command):
    words = _words(command)
    env = {}
    while re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    assert words.pop(0) == "torchrun"
    options, max_restarts = [], 0
    while words and words[0].startswith("-"):
        w = words.pop(0)
        name, eq, value = w.partition("=")
        norm = name.replace("_", "-")
        if not eq and norm not in ("--standalone",):
            value = words.pop(0)
        if norm == "--nproc-per-node":
            continue
        if norm == "--nnodes" and value.split(":")[0] != "1":
            raise ValueError(f"a torchrun line for more than one node cannot run here: {command}")
        if norm == "--max-restarts":
            max_restarts = int(value)
        if norm not in ("--standalone", "--max-restarts", "--nnodes", "--monitor-interval",
                        "--rdzv-conf", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id"):
            raise ValueError(f"the snippet test does not know torchrun's option {name}: {command}")
        options.append(w if eq or norm == "--standalone" else f"{w}={value}")
    if not words:
        raise ValueError(f"no script in the torchrun line: {command}")
    return Launch(env, options, max_restarts, words[0], words[1:])


# -- running it -----------------------------------------------------------------------------------
def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_env(rank, world, port, max_restarts):
    """What torchrun's agent sets for a worker of a one-node job (torch/distributed/elastic)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
            "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world), "ROLE_NAME": "default",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
            "TORCHELASTIC_RUN_ID": "snippet-" + uuid.uuid4().hex[:8],
            "TORCHELASTIC_USE_AGENT_STORE": "False", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def rank_main(script, argv, env, cwd):
    """In a rank (forked by the harness, or a fresh python): what `python script argv` under
    torchrun does."""
    import faulthandler
    import runpy
    os.environ.update(env)
    os.chdir(cwd)
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # the stacks at a timeout
    import ringreduce
    ringreduce._read_environment()  # the server imported it in its own environment
    sys.argv = [script] + list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


class _Fresh:
    """A rank started as a fresh python (RR_TEST_SPAWN=1), with _Forked's interface."""

    def __init__(self, script, argv, env, cwd, output):
        code = (f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); import test_snippets; "
                f"test_snippets.rank_main(*{(script, list(argv), env, cwd)!r})")
        with open(output, "ab") as out:
            self.p = subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=out,
                                      stdin=subprocess.DEVNULL, cwd=cwd)
        self.pid = self.p.pid

    @property
    def exitcode(self):
        return self.p.poll()

    def kill(self):
        self.p.kill()


def _tail(path, lines=40):
    try:
        text = pathlib.Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return "(no output)"
    return "\n".join(text[-lines:]) or "(no output)"


def _signal_name(code):
    if code is not None and code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"status {code}"


def run_harness(launch, world, cwd, timeout):
    """Starts the ranks; (ok, report)."""
    import dist_utils
    port = _free_port()
    script = os.path.join(cwd, launch.script)
    if not os.path.isfile(script):
        return False, f"the script {launch.script} does not exist (run from the repository's root)"
    procs, outputs = [], []
    for r in range(world):
        env = {**launch.env, **torchrun_env(r, world, port, launch.max_restarts)}
        out = os.path.join(cwd, f"rank{r}.out")
        outputs.append(out)
        if os.environ.get("RR_TEST_SPAWN") == "1":
            procs.append(_Fresh(script, launch.args, env, cwd, out))
        else:
            procs.append(dist_utils._Forked(dist_utils._Server.get(PRELOAD), rank_main,
                                            (script, launch.args, env, cwd), out))
    deadline = time.monotonic() + timeout
    failed_at, why = None, None
    while True:
        codes = [p.exitcode for p in procs]
        if all(c is not None for c in codes):
            break
        bad = [c for c in codes if c not in (None, 0)]
        if bad and failed_at is None:
            failed_at = time.monotonic()  # the others get a few seconds to fail on their own
        now = time.monotonic()
        if (failed_at is not None and now - failed_at > 10) or now > deadline:
            why = (f"ranks still running {timeout} s after the start" if failed_at is None
                   else "ranks still running 10 s after another rank failed")
            for p in procs:
                if p.exitcode is None:
                    os.kill(p.pid, signal.SIGUSR2)
            time.sleep(1.0)
            for p in procs:
                p.kill()
            time.sleep(0.5)
            break
        time.sleep(0.05)
    codes = [p.exitcode for p in procs]
    ok = why is None and all(c == 0 for c in codes)
    report = [why] if why else []
    for r, (c, out) in enumerate(zip(codes, outputs)):
        state = "still running (killed)" if c is None else f"exited with {_signal_name(c)}"
        report.append(f"--- rank {r} {state}; its output, last lines ---\n{_tail(out)}")
    return ok, "\n".join(report)


def run_torchrun(launch, world, cwd, timeout):
    """The real launcher (RR_SNIPPETS_TORCHRUN=1); (ok, report)."""
    options = list(launch.options)
    if "--standalone" not in options:
        options.append("--standalone")  # a port of its own: never the default 29500
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}", *options,
           launch.script, *launch.args]
    out = os.path.join(cwd, "torchrun.out")
    with open(out, "wb") as f:
        p = subprocess.Popen(cmd, cwd=cwd, env={**os.environ, **launch.env}, stdout=f,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True)
        try:
            code = p.wait(timeout=timeout)
            why = None
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            code, why = None, f"torchrun still running {timeout} s after the start"
    report = f"{why or 'torchrun exited with ' + _signal_name(code)}\n" \
             f"--- torchrun's output, last lines ---\n{_tail(out, 60)}"
    return why is None and code == 0, report


def run_snippet(snippet, world, cwd, timeout=RUN_TIMEOUT):
    """Runs a snippet at a world size in folder cwd; (ok, report with the command)."""
    cwd = str(cwd)
    for name in LINKED:
        if not os.path.exists(os.path.join(cwd, name)):
            os.symlink(ROOT / name, os.path.join(cwd, name))
    line = snippet.command
    launch = parse_torchrun(line)
    if snippet.code is not None:
        pathlib.Path(cwd, launch.script).write_text(snippet.code)
    if os.environ.get("RR_SNIPPETS_TORCHRUN") == "1":
        ok, report = run_torchrun(launch, world, cwd, timeout)
    else:
        ok, report = run_harness(launch, world, cwd, timeout)
    return ok, f"$ {line}   (at --nproc-per-node={world}, in {cwd})\n{report}"


def missing_modules(snippet):
    """The top-level modules a Python block imports that are not installed."""
    import importlib.util
    names = re.findall(r"^\s*(?:import|from)\s+(\w+)", snippet.code or "", re.M)
    return sorted({n for n in names if importlib.util.find_spec(n) is None})


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("snippet", SNIPPETS, ids=lambda s: s.id)
def test_snippet_runs(snippet, world, tmp_path):
    if snippet.gpu and not have_gpu():
        pytest.skip(f"{snippet.where} is marked '{GPU_MARK}' and torch sees no CUDA device")
    if snippet.gpu_per_rank and torch.cuda.device_count() < world:
        pytest.skip(f"{snippet.where} is marked '{GPU_MARK} per rank': {world} ranks, "
                    f"{torch.cuda.device_count()} GPUs")
    missing = missing_modules(snippet)
    if missing and os.environ.get("RINGREDUCE_REQUIRE_FRAMEWORKS") != "1":
        pytest.skip(f"{snippet.where} imports {', '.join(missing)}, not installed (the test extra "
                    f"installs them: pip install -e '.[test]'; CI sets RINGREDUCE_REQUIRE_FRAMEWORKS=1 "
                    f"so that this never skips there)")
    ok, report = run_snippet(snippet, world, tmp_path)
    if not ok:
        what = "block" if snippet.code is not None else "command"
        pytest.fail(f"{snippet.where}: this {what} fails at world {world}\n{report}", pytrace=False)


# -- the test's own checks (cheap) ---------------------------------------------------------------
def test_a_broken_snippet_fails_with_its_place_and_output(tmp_path):
    code = ("# torchrun --nproc-per-node=2 broken.py\nimport os\n"
            "print('rank', os.environ['RANK'], 'was here')\n"
            "raise SystemExit(3 if os.environ['RANK'] == '1' else 0)\n")
    broken = Snippet(ROOT / "README.md", 1, torchrun_comments(code)[0], code)
    ok, report = run_snippet(broken, 2, tmp_path, timeout=60)
    assert not ok
    assert "rank 1 exited with status 3" in report, report
    assert "rank 1 was here" in report and "rank 0 exited with status 0" in report, report
    assert report.startswith("$ torchrun --nproc-per-node=2 broken.py"), report


def test_snippets_are_found():
    readme = [s for s in SNIPPETS if s.path.name == "README.md"]
    cpu = "\n".join(s.code for s in readme if s.code is not None and not s.gpu)
    # one runnable example per entry point
    for needle in ("rr.all_reduce(", 'init_process_group("ringreduce")', "register_comm_hook(",
                   "GradientBucketer("):
        assert needle in cpu, f"no runnable README block uses {needle}"
    assert any(s.gpu for s in readme), "the README's GPU quickstart block is not marked"
    assert any(s.code is None for s in SNIPPETS), "no torchrun command line found"


def test_torchrun_lines_are_understood():
    for s in SNIPPETS:
        parse_torchrun(s.command)  # raises on what the runner cannot start as written


def test_python_code_is_tagged():
    """A block of Python code without ```python would be skipped silently."""
    for path in DOC_FILES:
        for info, start, text in blocks(path):
            lang = info.split()[0].lower() if info else ""
            if lang not in PYTHON_TAGS and re.search(r"^\s*(import|from) \w+", text, re.M):
                pytest.fail(f"{path.relative_to(ROOT)}:{start}: Python code in a block tagged "
                            f"{info or 'nothing'!r}; tag it ```python so that this test runs it")


def slug(heading):
    """GitHub's anchor of a heading."""
    text = re.sub(r"[`*]", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page):
    return {slug(m.group(1)) for b in [page.read_text()]
            for m in re.finditer(r"^#{1,6}\s+(.*?)\s*$", _without_blocks(b), re.M)}


def _without_blocks(text):
    return re.sub(r"^\s{0,3}(```|~~~).*?^\s{0,3}\1\s*$", "", text, flags=re.M | re.S)


def test_docs_are_linked_and_links_resolve():
    """Every docs/*.md is reachable from README.md; every relative link of the pages reached points
    at a file, and at a heading of it where it names one."""
    reach, todo = set(), [ROOT / "README.md"]
    while todo:
        page = todo.pop()
        if page in reach:
            continue
        reach.add(page)
        text = _without_blocks(page.read_text())
        for target, anchor in re.findall(r"\]\(([^)\s#]*)(?:#([^)\s]*))?\)", text):
            if re.match(r"^[a-z]+:", target):
                continue
            dest = (page.parent / target).resolve() if target else page
            where = f"{page.relative_to(ROOT)}: the link {target}{'#' + anchor if anchor else ''}"
            assert dest.exists(), f"{where} points nowhere"
            if anchor and dest.suffix == ".md":
                assert anchor in anchors(dest), f"{where}: no such heading in {dest.name}"
            if dest.suffix == ".md":
                todo.append(dest)
    missing = [p.name for p in DOC_FILES if p not in reach]
    assert not missing, f"docs not linked from README.md (directly or through a linked doc): {missing}"


def _collected(*args, env=None):
    """The lines `pytest --collect-only` prints for tests/ with these extra arguments."""
    res = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          *args, str(ROOT / "tests")], capture_output=True, text=True, timeout=300,
                         cwd=ROOT, env=env)
    assert "::" in res.stdout, res.stdout[-2000:] + res.stderr[-2000:]
    return res.stdout.splitlines()


# Every skipif reason in the suite, by what skips it where the README's test command runs (no GPU;
# its build has no CUDA kernels; the test extra, not the peers). A new reason fails the count
# below until it is put here.
SKIP_REASONS = [
    (r"needs a CUDA device", "gpu"),  # these tests are marked gpu too
    (r"built without CUDA|has no CUDA code", "kernels"),
    (r"^needs mpi4py|^needs DeepSpeed", "peers"),
    (r"need root", "root"),
    # skipped only with a GPU, in a CUDA build, or without the test extra: run there
    (r"without a GPU|this build has CUDA kernels|^needs (lightning|accelerate)", None),
]


def skip_tally():
    """{category: tests} that skip where the README's command runs: gpu (marked gpu), snippets
    (docs blocks marked '# needs a GPU', at every world), kernels (they read the CUDA kernels),
    peers (MPI, DeepSpeed); root (not as root: tests/test_lab.py and simulated hosts). From one
    collection with tests/skip_tally.py; also "all": every test collected."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    lines = [line[len("SKIP-TALLY "):].split("\t") for line in _collected("-p", "skip_tally", env=env)
             if line.startswith("SKIP-TALLY ")]
    tally = {"all": len(lines), "gpu": 0, "snippets": 0, "kernels": 0, "peers": 0, "root": 0}
    for nodeid, gpu, reasons, _ in lines:
        if gpu == "1":
            tally["gpu"] += 1
            continue
        if nodeid.startswith("tests/test_lab.py::"):  # its reason says why only where it skips
            tally["root"] += 1
            continue
        kinds = set()
        for reason in filter(None, reasons.split("|")):
            kind = next((k for pattern, k in SKIP_REASONS if re.search(pattern, reason)), "?")
            assert kind != "?", f"{nodeid}: skip reason {reason!r} not in SKIP_REASONS"
            kinds.add(kind)
        kind = next((k for k in ("kernels", "peers", "root") if k in kinds), None)
        if kind:
            tally[kind] += 1
    tally["snippets"] = sum(s.gpu for s in SNIPPETS) * len(WORLDS)
    return tally


def test_readme_counts_what_the_suite_holds():
    """The README's test counts come from the suite, not from a hand: every test, those that skip
    without a GPU by reason, those that need root; and the README fits 300 lines."""
    text = " ".join((ROOT / "README.md").read_text().split())
    m = re.search(r"Of the suite's (\d+) tests, (\d+) skip without a GPU in this build \(no CUDA "
                  r"kernels\): (\d+) need a GPU, (\d+) run docs blocks marked `# needs a GPU`, (\d+) "
                  r"read the CUDA kernels \(`RINGREDUCE_CUDA=1`\), (\d+) need MPI or DeepSpeed \(the "
                  r"`peers` extra\); not as root, (\d+) more", text)
    assert m, "README.md: the sentence 'Of the suite's N tests, S skip without a GPU in this build " \
              "(no CUDA kernels): ...' is missing"
    t = skip_tally()
    said = tuple(int(g) for g in m.groups())
    found = (t["all"], t["gpu"] + t["snippets"] + t["kernels"] + t["peers"], t["gpu"], t["snippets"],
             t["kernels"], t["peers"], t["root"])
    assert said == found, f"README.md says {said}; the suite holds {found} (all, skipped, gpu, " \
                          f"snippets, kernels, peers, root)"
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines (at most 300)"


def gpu_runs():
    """The GPU runs docs/gpu-runs.md records: its sections '## The ... run (..., <date> ...)', by
    the GPU each names."""
    heads = re.findall(r"^## The [^\n]*\brun \([^)\n]*\b20\d\d-\d\d-\d\d[^\n]*$",
                       (ROOT / "docs" / "gpu-runs.md").read_text(), re.M)
    return [re.search(r"\bH\d00\b", h).group(0) for h in heads]


def test_readme_counts_the_gpu_runs():
    """The README's count of GPU runs is docs/gpu-runs.md's."""
    runs = gpu_runs()
    assert len(runs) >= 4, runs
    text = " ".join((ROOT / "README.md").read_text().split())
    m = re.search(r"What ran on real GPUs so far \((\d+) runs of 15 minutes: (\d+) on an H100, "
                  r"(\d+) on an H200\)", text)
    assert m, "README.md: 'What ran on real GPUs so far (N runs of 15 minutes: A on an H100, B on " \
              "an H200)' is missing"
    assert tuple(int(g) for g in m.groups()) == (len(runs), runs.count("H100"), runs.count("H200")), runs
