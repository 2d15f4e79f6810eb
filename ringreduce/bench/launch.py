"""Starting the ranks: processes forked (CPU) or from a fork server (GPU), joined on a FileStore (no
ports), or one rank under torchrun.

Exit status: 0 when every checked element was right, 1 when some were wrong or a rank failed,
2 for bad flags (argparse), 130 when interrupted.
"""
import copy
import importlib.util
import json
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback

import torch
import torch.distributed as dist

from .. import _env
from . import header, load, plot, report, runner
from .cli import mpi_launchers, parse_args

GRACE_S = 3.0  # after one rank fails, how long the others get to report before they are killed


def emulated_host(rank, world, hosts):
    """The host id of a spawned GPU rank with --hosts H: blocks of world / H consecutive ranks."""
    return f"bench-h{rank * hosts // world}"


def _device_setup(device_kind, local_rank, local_world, host=None, host_ranks=None):
    """Threads per rank (local_world ranks share the cores), this rank's GPU, and NCCL's and
    SymmetricMemory's consent to share a GPU between the host_ranks ranks (default local_world)
    that have this rank's host id. host: this GPU rank's emulated host (--hosts, --link), told to
    ringreduce and to NCCL (its sockets between hosts, not InfiniBand, which would bypass the
    lab's link; loopback unless the lab named an interface); set before any communicator exists,
    as both read it when one is made."""
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // max(1, local_world)))
    if device_kind != "cuda":
        return torch.device("cpu")
    count = torch.cuda.device_count()
    device = torch.device("cuda", local_rank % count)
    torch.cuda.set_device(device)
    if host is not None:
        os.environ["RINGREDUCE_HOST_ID"] = os.environ["NCCL_HOSTID"] = host
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_IB_DISABLE", "1")
    if (host_ranks or local_world) > count:  # ranks of a host share a GPU (DESIGN.md, "Machines")
        os.environ.setdefault("NCCL_MULTI_RANK_GPU_ENABLE", "1")
        # torch's SymmetricMemory refuses a rendezvous of ranks on one device without it (read
        # at each rendezvous, so setting it here, before any, is enough)
        os.environ.setdefault("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")
        if torch.cuda.nccl.version() < (2, 30):  # older NCCL: pretend to be hosts, use sockets
            if host is not None:  # every rank a host of its own to NCCL, still `host` to ours
                os.environ["NCCL_HOSTID"] = f"{host}-{local_rank}"
            os.environ.setdefault("NCCL_HOSTID", f"ringreduce-bench-{local_rank}")
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    return device


def _close_ringreduce():
    """Closes ringreduce's communicators (CPU and CUDA, every group) while the process group (their
    store) still exists."""
    from ringreduce import _lifecycle
    _lifecycle.REGISTRY.destroy_all()


def socket_label(label):
    """The row label of a backend on NCCL when the ranks share a GPU and pose as hosts (distinct
    NCCL_HOSTID): NCCL's socket transport, named as such in the table and results.json."""
    return label + "-socket" if label in ("torch/nccl", "ps/nccl") else label


def _backend(device_kind):
    return "cpu:gloo,cuda:nccl" if device_kind == "cuda" else "gloo"


def run_rank(args, rank, world, device, local_world):
    """This rank's whole run (process group already initialized); rank 0 returns the run.
    local_world: the ranks with this rank's host id on this machine (who share its GPUs)."""
    ctrl = dist.new_group(backend="gloo") if device.type == "cuda" else dist.group.WORLD
    ctx = runner.Context(args, rank, world, device, ctrl)
    info = report.machine() if rank == 0 else None  # here, so the launcher never touches a GPU
    if rank == 0:
        report.print_machine(info, args, world)
    if device.type == "cuda" and local_world > torch.cuda.device_count():
        if torch.cuda.nccl.version() < (2, 30):
            ctx.note("ranks share a GPU and NCCL < 2.30: torch/nccl and ps/nccl run over sockets, "
                     "their rows labelled -socket (correct, but their times say nothing about "
                     "NCCL's GPU transports)")
            for b in ctx.backends:
                b.label = socket_label(b.label)
    membw = [runner.peak_membw(ctx)]
    runner.probe_backends(ctx)
    rows = runner.sweep(ctx)
    membw.append(runner.peak_membw(ctx))  # before and after: the peak is the larger
    for b in ctx.backends:
        if hasattr(b, "close"):
            b.close()
    if rank != 0:
        return None
    method = (f"{runner.MEMBW_BYTES >> 20} MiB device-to-device copy" if device.type == "cuda"
              else f"{runner.MEMBW_BYTES >> 20} MiB torch copy, all cores") + ", read+write counted"
    labels = [b.label for b in ctx.backends]
    run = {"nranks": world, "device": device.type, "machine": info, "backends": labels,
           "hosts": args.hosts, "link_GBps": getattr(args, "link_gbps", None), "notes": ctx.notes,
           "peak_membw_GBps": max(membw), "membw_samples_GBps": membw, "membw_method": method,
           "rows": rows,
           "summary": report.summarize(rows, labels)}
    if not getattr(args, "merged_later", False):
        report.print_summary(run)
    return run


def _spawned_rank(rank, world, tmpdir, args):
    hosts = args.hosts if args.device == "cuda" else 1  # GPU ranks on emulated hosts
    host = emulated_host(rank, world, hosts) if hosts > 1 else None
    device = _device_setup(args.device, rank, world, host, world // hosts)
    ran = False
    try:
        store = dist.FileStore(os.path.join(tmpdir, "store"), world)
        dist.init_process_group(_backend(args.device), store=store, rank=rank, world_size=world)
        run = run_rank(args, rank, world, device, world // hosts)
        if rank == 0:
            with open(os.path.join(tmpdir, "result.tmp"), "w") as f:
                json.dump(run, f)
            os.replace(os.path.join(tmpdir, "result.tmp"), os.path.join(tmpdir, "result.json"))
        ran = True
    except BaseException:
        with open(os.path.join(tmpdir, f"error-{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        sys.exit(1)
    finally:
        _close_ringreduce()
        if ran:  # the sweep and ringreduce's close ended cleanly (see _collect)
            open(os.path.join(tmpdir, f"done-{rank}"), "w").close()
        if dist.is_initialized():
            dist.destroy_process_group()
    if args.crash_at_exit_for_test == rank:
        os.abort()


def _spawn_world(args, world):
    """Runs one sweep on world spawned ranks; returns rank 0's run or raises RuntimeError."""
    # CPU ranks are forked from this process, which imported torch and ran no torch op (no thread
    # pool to copy): a rank starts in milliseconds, not after the 2-3 s of CPU an import of torch
    # takes. GPU ranks come from a fork server that imported torch (before any CUDA call: what spawn
    # gives), since this process asked torch.cuda.is_available(), which starts the CUDA driver, and
    # a driver started before fork() does not work in the child.
    if args.device == "cpu":
        ctx = mp.get_context("fork")
    else:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed"])
    tmpdir = tempfile.mkdtemp(prefix="ringreduce-bench-")
    procs = [ctx.Process(target=_spawned_rank, args=(r, world, tmpdir, args), daemon=True)
             for r in range(world)]
    try:
        for p in procs:
            p.start()
        failed_at = None
        while any(p.exitcode is None for p in procs):
            mp.connection.wait([p.sentinel for p in procs if p.exitcode is None], timeout=0.5)
            if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
                break
        return _collect(tmpdir, world, [p.exitcode for p in procs])
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        shutil.rmtree(tmpdir, ignore_errors=True)


def _collect(tmpdir, world, exitcodes, whole_job=False):
    """Rank 0's run from tmpdir, or RuntimeError with every rank's error. whole_job: exitcodes[0]
    is mpirun's status for every rank. A rank that dies after its sweep and ringreduce's close ended
    (its done marker; so in torch.distributed's teardown or the interpreter's exit, which are not
    ours: DeepSpeed's ranks once aborted there in CI) is a warning on stderr, not a failed run."""
    died, errors = [], []  # ranks that died without a word come first: they are the cause
    done = {r for r in range(world) if os.path.exists(os.path.join(tmpdir, f"done-{r}"))}
    for r, code in enumerate(exitcodes):
        path = os.path.join(tmpdir, f"error-{r}.txt")
        how = f"signal {-code}" if code is not None and code < 0 else f"status {code}"
        if os.path.exists(path):
            with open(path) as f:
                errors.append(f"--- rank {r} ---\n{f.read()}")
        elif code not in (None, 0) and (len(done) == world if whole_job else r in done):
            who = "mpirun" if whole_job else f"rank {r}"
            print(f"ringreduce.bench: warning: nranks {world}: {who} exited with {how} after the "
                  f"sweep had finished (in torch.distributed's teardown or at exit); its results "
                  f"are complete and kept", file=sys.stderr, flush=True)
        elif code not in (None, 0):
            died.append(f"--- rank {r} --- died ({how}) without reporting an error")
    errors = died + errors
    result = os.path.join(tmpdir, "result.json")
    if errors or not os.path.exists(result):
        raise RuntimeError("benchmark failed at nranks %d:\n%s" % (world, "\n".join(errors)))
    with open(result) as f:
        return json.load(f)


def _mpirun_world(args, world, kind):
    """As _spawn_world, with the ranks started by kind's mpirun (MPI is a backend: its ranks must be
    MPI's own); every backend runs in them the same way. Ranks are not bound to cores, as spawned
    ones."""
    path = mpi_launchers()[kind]
    tmpdir = tempfile.mkdtemp(prefix="ringreduce-bench-")
    try:
        with open(os.path.join(tmpdir, "args.pkl"), "wb") as f:
            pickle.dump(args, f)
        cmd = [path, "-n", str(world)]
        if kind == "openmpi":
            cmd += ["--oversubscribe", "--bind-to", "none"]
            if os.geteuid() == 0:
                cmd.append("--allow-run-as-root")
        cmd += [sys.executable, "-m", "ringreduce.bench.mpi_rank", tmpdir]
        code = subprocess.run(cmd, env=_mpi4py_env(kind, tmpdir)).returncode
        return _collect(tmpdir, world, [code] + [0] * (world - 1), whole_job=True)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def _mpi4py_env(kind, tmpdir):
    """The environment that makes mpi4py load kind's library. Its PyPI wheel carries one extension
    per MPI ABI and dlopens libmpi.so (whichever MPI the system's alternatives chose) unless told;
    its MPICH extension links libmpi.so.12, which Debian and Ubuntu ship only as libmpich.so.12."""
    env = dict(os.environ)
    if kind == "openmpi":
        env.setdefault("MPI4PY_LIBMPI", "libmpi.so.40")
    elif kind == "mpich":
        env.setdefault("MPI4PY_LIBMPI", "libmpi.so.12")
        real = _shared_library("libmpich.so.12")
        if _shared_library("libmpi.so.12") is None and real is not None:
            libdir = os.path.join(tmpdir, "mpich-abi")
            os.makedirs(libdir)
            os.symlink(real, os.path.join(libdir, "libmpi.so.12"))
            env["LD_LIBRARY_PATH"] = os.pathsep.join(
                p for p in (libdir, env.get("LD_LIBRARY_PATH")) if p)
    return env


def _shared_library(soname):
    """The path the dynamic linker's cache gives soname, or None."""
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        name, _, path = line.strip().partition(" => ")
        if name.split(" ")[0] == soname and os.path.exists(path):
            return path
    return None


def _world_run(args, world):
    """One sweep at world ranks. With several MPIs each needs its own launch (a process loads one
    MPI): the first runs every backend, each other one only its MPI row; the rows are merged and
    the summary printed once."""
    mpis = [b for b in args.backends if b.startswith("mpi/")]
    if not mpis:
        return _spawn_world(args, world)
    if len(mpis) == 1:
        return _mpirun_world(args, world, mpis[0].split("/", 1)[1])
    first = copy.copy(args)
    first.backends = [b for b in args.backends if not b.startswith("mpi/") or b == mpis[0]]
    first.merged_later = True
    run = _mpirun_world(first, world, mpis[0].split("/", 1)[1])
    for label in mpis[1:]:
        print(f"[bench] N={world}: {label} in its own launch (one MPI per process)",
              file=sys.stderr, flush=True)
        only = copy.copy(first)
        only.backends = [label]
        extra = _mpirun_world(only, world, label.split("/", 1)[1])
        run["rows"] += extra["rows"]
        run["notes"] += extra["notes"]
        run["membw_samples_GBps"] += extra["membw_samples_GBps"]
        run["peak_membw_GBps"] = max(run["membw_samples_GBps"])
    run["backends"] = [b for b in args.backends if any(r["backend"] == b for r in run["rows"])]
    run["summary"] = report.summarize(run["rows"], run["backends"])
    report.print_summary(run)
    return run


def mpi_rank_main(tmpdir):
    """A rank started by _mpirun_world (python -m ringreduce.bench.mpi_rank TMPDIR)."""
    with open(os.path.join(tmpdir, "args.pkl"), "rb") as f:
        args = pickle.load(f)
    env = os.environ
    rank = env.get("OMPI_COMM_WORLD_RANK", env.get("PMI_RANK"))
    world = env.get("OMPI_COMM_WORLD_SIZE", env.get("PMI_SIZE"))
    if rank is None or world is None:
        from mpi4py import MPI
        rank, world = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    _spawned_rank(int(rank), int(world), tmpdir, args)


def _start():
    """What _finish compares the end of the run with: (load average, CPU time sample, tree root)."""
    root = load.bench_root()
    return header.load_average(), load.sample(root), root


def _finish(args, runs, start, ranks):
    """The run's closing lines and files; ranks: the bench's ranks on this machine."""
    if len(runs) > 1:
        report.print_vs_n(runs)
    load_start, _, root = start
    load_end = header.load_average()
    print(header.load_line("end", load_end))
    other, how, busy = header.other_work(start[:2], (load_end, load.sample(root)), ranks)
    if other is not None:
        print(f"# other work during the run: {other:.2f} cores on average ({how}; the bench's "
              f"{ranks} ranks aside)")
    if busy:
        print("\n".join(textwrap.wrap(busy, header.WIDTH, initial_indent="# note: ",
                                       subsequent_indent="#   ", break_on_hyphens=False)))
    extra = {"load_average": {"start": load_start, "end": load_end, "busy": busy is not None,
                              "other_cores": None if other is None else round(other, 3),
                              "other_how": how},
             "left_out": header.left_out(args),
             "legend": {b: header.legend(b) for b in args.backends}}
    if args.json:
        report.write_json(args.json, args, runs[0]["machine"], runs, extra)
        print(f"# wrote {args.json}")
    if args.plot:
        plot.busbw_vs_size(args.plot, runs)
        print(f"# wrote {args.plot}")
        if len(runs) > 1:
            plot.time_vs_n(plot.vs_n_path(args.plot), runs)
            print(f"# wrote {plot.vs_n_path(args.plot)}")
    wrong = sum(r["wrong"] or 0 for run in runs for r in run["rows"])
    # nccl-tests' closing line: every result was checked against the expected reduction
    print(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'} (results that "
          f"differ from the expected reduction, every row and rank checked)", flush=True)
    if args.results:
        print(f"# results: {_write_results(args, runs, extra)}", flush=True)
    return 0 if wrong == 0 else 1


def _write_results(args, runs, extra):
    """results.json, summary.md and busbw.png (with matplotlib) in args.results; returns what was
    written, for the last line."""
    folder = args.results
    os.makedirs(folder, exist_ok=True)
    doc = report.write_json(os.path.join(folder, "results.json"), args, runs[0]["machine"], runs,
                            extra)
    with open(os.path.join(folder, "summary.md"), "w") as f:
        f.write(report.markdown(doc))
    wrote = ["results.json", "summary.md"]
    if importlib.util.find_spec("matplotlib") is None:
        wrote.append("no plot: matplotlib is not installed (pip install matplotlib)")
    else:
        plot.busbw_vs_size(os.path.join(folder, "busbw.png"), runs)
        wrote.append("busbw.png")
        if len(runs) > 1:
            plot.time_vs_n(os.path.join(folder, "time_vs_n.png"), runs)
            wrote.append("time_vs_n.png")
    return f"{folder}{os.sep} ({', '.join(wrote)})"


def _torchrun_main(args):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    # Emulated hosts (--link) share this machine's cores: threads per rank as for world ranks
    # (with local_world, 2 hosts x 1 rank on 2 cores ran 2 intra-op threads per rank, and every
    # small parallel copy waited a time slice for a descheduled thread: 1.6x slower calls).
    # On GPUs in the lab every rank is told its host (the lab's) and takes GPU rank % count.
    device = (_device_setup(args.device, rank, world, _env.get("RINGREDUCE_HOST_ID"),
                            local_world)
              if args.lab and args.device == "cuda" else
              _device_setup(args.device, local_rank, world if args.lab else local_world))
    start = _start()
    if rank == 0:
        print("\n".join(header.lines(args, start[0], local_world)), flush=True)
        if args.lab:
            print(f"# ranks: {world} on {args.hosts} emulated hosts x {local_world} "
                  f"(torchrun per host)", flush=True)
    dist.init_process_group(_backend(args.device), init_method="env://")
    try:
        run = run_rank(args, rank, world, device, local_world)
        # --link: every emulated host's ranks run on this machine
        return _finish(args, [run], start, world if args.lab else local_world) if rank == 0 else 0
    finally:
        _close_ringreduce()
        dist.destroy_process_group()


def _prepare_deepspeed():
    """Builds DeepSpeed's shm op once, here, before any rank starts (its first build takes minutes;
    ranks would queue on its build lock inside the sweep), and names the run's /dev/shm segments:
    the ranks inherit MASTER_ADDR/MASTER_PORT (spawned ranks use a FileStore, not these). Returns
    the segments' name prefix."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(os.getpid()))
    print("[bench] loading DeepSpeed's shm op (built on first use: ~2 min on 2 cores)",
          file=sys.stderr, flush=True)
    code = ("import os; os.environ['DS_ACCELERATOR'] = 'cpu'; "
            "from deepspeed.comm.torch import build_shm_op; assert build_shm_op() is not None")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError("DeepSpeed's shm op did not build or load:\n" + res.stderr[-3000:])
    from .backends import shm_prefix
    return shm_prefix()


def _child_argv(argv):
    """The command line without --link (the ranks under torchrun run the sweep itself)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--link":
            skip = True
        elif not a.startswith("--link="):
            out.append(a)
    return out


def lab_env(environ, desc, per_host, gbps=None):
    """The environment of each emulated host's torchrun: the lab's description for the report and
    the GB/s a socket got across the link (the bound's unit), no forced transport, and quiet where
    nothing is wrong: torchrun's banner about OMP_NUM_THREADS (set here to the cores per rank, as
    the bench's own ranks use them) and c10d's warnings that a namespace's socket has no host name
    (reverse DNS inside the lab; TORCH_CPP_LOG_LEVEL=ERROR), unless the caller set them."""
    from .cli import LAB_ENV, LAB_GBPS_ENV
    env = dict(environ, **{LAB_ENV: desc})
    if gbps:
        env[LAB_GBPS_ENV] = f"{gbps:.4f}"
    env.pop("RINGREDUCE_TRANSPORT", None)
    env.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // max(1, per_host))))
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    return env


def _lab_main(args, argv):
    """--link: builds the emulated hosts, measures what a socket gets across the link, and starts
    `torchrun --nnodes H --node-rank h` inside each host's namespace (its own /dev/shm) with the
    rendezvous at host 0's address; host 0's output is this run's. Everything is torn down at the
    end, on Ctrl-C and after a failure."""
    from .netlab import Lab
    H, world = args.hosts, args.nranks[0]
    rate = None if args.link == "none" else args.link
    with Lab(H, rate) as lab:
        gbps = lab.measure()
        desc = f"{lab.describe()}; one TCP stream between two hosts: {gbps:.2f} GB/s"
        print(f"# emulated hosts: {desc}", file=sys.stderr, flush=True)
        env = lab_env(os.environ, desc, world // H, gbps)
        logs, procs = [], []
        for h in range(H):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(H),
                   "--node-rank", str(h), "--nproc-per-node", str(world // H),
                   "--master-addr", lab.address(0), "--master-port", "29500",
                   "-m", "ringreduce.bench"] + _child_argv(argv)
            log = None if h == 0 else tempfile.TemporaryFile(mode="w+")
            logs.append(log)
            # CPU ranks get a /dev/shm per host, as real hosts have. GPU ranks keep the machine's:
            # CUDA IPC inside a host and MPS (shared by every emulated host) may use it, and their
            # hosts are told apart by RINGREDUCE_HOST_ID and NCCL_HOSTID (lab.env), not by it.
            procs.append(lab.popen(h, cmd, private_shm=args.device == "cpu", env=env, stdout=log,
                                   stderr=subprocess.STDOUT if log else None))
        failed_at = None
        while any(p.poll() is None for p in procs):
            time.sleep(0.2)
            if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > GRACE_S + 30:
                break  # torchrun stops its own workers; the lab kills what is left
        codes = [p.poll() for p in procs]
        for h, (code, log) in enumerate(zip(codes, logs)):
            if code != 0 and log is not None:
                log.seek(0)
                print(f"--- host {h} (torchrun exited with {code}) ---\n{log.read()[-6000:]}",
                      file=sys.stderr, flush=True)
    return 0 if all(c == 0 for c in codes) else 1


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.link is not None:
        try:
            return _lab_main(args, argv)
        except KeyboardInterrupt:
            return 130
    if args.torchrun:
        return _torchrun_main(args)
    runs = []
    ds_prefix = None
    start = _start()
    # Flushed before any rank is forked: a forked rank would print what is still buffered.
    print("\n".join(header.lines(args, start[0])), flush=True)
    try:
        if any(b.startswith("deepspeed/") for b in args.backends):
            ds_prefix = _prepare_deepspeed()
        for world in args.nranks:
            runs.append(_world_run(args, world))
    except RuntimeError as e:
        print(f"ringreduce.bench: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        if ds_prefix:  # DeepSpeed never removes its segments; a rank that died left its own
            from .backends import remove_shm
            remove_shm(ds_prefix)
    return _finish(args, runs, start, max(args.nranks))  # one world at a time
