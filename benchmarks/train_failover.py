"""A whole host of three lost mid-epoch under torchrun, and how the job goes on (issue 84): with
`--on-failure shrink` the survivors drop it and go on in place (no restart), against the elastic
recipe (torchrun --nnodes=2:3 restarts the survivors, which resume from the checkpoint at world 4).

    python benchmarks/train_failover.py  # as root [--runs 3] [--modes shrink,restart] [--lab]

Hosts are simulated on this machine: one torchrun agent per host, each in its own mount namespace
with a private /dev/shm (root and unshare needed) and RINGREDUCE_HOST_ID=host<h>, so ringreduce
plans two levels (shared memory inside a host, Gloo between hosts). examples/train_ddp.py's rank 5
(host 2) SIGKILLs its agent and both of its workers between forward and backward of --die-at-step.
Prints, per run, the seconds from the kill to the next completed step on every survivor, and the
medians, with the load average.

Shrink: a static rendezvous (--nnodes=3 --node-rank=h --master-addr/--master-port), the store in
host 0's agent, --max-restarts=0. The agents watch their own workers only (a static rendezvous
never reports nodes waiting), so they leave the survivors alone; but at the end each waits in
torchrun's exit barrier for all three agents, 300 s (not settable from the command line): once a
surviving host's agent logs that its worker group finished (every worker exited 0), this script
SIGKILLs it (a SIGTERM was not acted on there for over a minute: Python runs torchrun's handler
once the store's wait returns). Restart: c10d rendezvous, --max-restarts=1, last_call_timeout=5
(torchrun's default is 30 s), hosts started 1 s apart so that host 0's agent holds the store
and host 2 has ranks 4-5.

--lab: each host's agent runs in a network namespace of a ringreduce.bench.netlab.Lab (unshaped
veth pairs on a bridge, a private /dev/shm each), the store at host 0's lab address, so the
ranks talk real TCP between hosts instead of loopback.
"""
import argparse
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from ringreduce.bench import netlab  # noqa: E402
EXAMPLE = os.path.join(REPO, "examples", "train_ddp.py")
HOSTS, PER_HOST = 3, 2
DEAD_HOST, DIE_RANK = 2, 5
FINISHED = "worker group successfully finished"  # torchrun's agent, at LOGLEVEL=INFO
# A private /dev/shm per host; what is left in it is printed as the host's last line.
SCRIPT = ('mount -t tmpfs -o size=256m tmpfs /dev/shm && "$@"; rc=$?; '
          'echo "leftover: $(ls /dev/shm)"; exit $rc')


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def ours(marker):
    """Pids of processes whose command line mentions marker."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def launch(workdir, mode, epochs=2, die_step=20, timeout=240, lab=None):
    """One job of HOSTS simulated hosts, host DEAD_HOST killed in step die_step. Returns
    {"rcs", "outs", "leftovers", "stopped"}: per host, the launcher's return code, its output
    (agent and workers), what was left in its /dev/shm, and whether this function SIGKILLed its
    agent in the exit barrier (shrink mode only); and "stray", the pids it had to kill at the end.
    With lab (a netlab.Lab of HOSTS hosts) each agent runs in its host's namespace."""
    os.makedirs(workdir, exist_ok=True)
    port = free_port()
    master = lab.address(0) if lab else "127.0.0.1"
    example = [EXAMPLE, "--events", "--backend", "ringreduce", "--epochs", str(epochs),
               "--checkpoint", os.path.join(workdir, "ck.pt"), "--die-at-step", str(die_step),
               "--die-rank", str(DIE_RANK), "--die-node"]
    procs, outs = [], [[] for _ in range(HOSTS)]
    for h in range(HOSTS):
        if mode == "shrink":
            rdzv = [f"--nnodes={HOSTS}", f"--node-rank={h}", f"--master-addr={master}",
                    f"--master-port={port}", "--max-restarts=0"]
            job = example + ["--on-failure", "shrink"]
        else:
            rdzv = [f"--nnodes=2:{HOSTS}", "--rdzv-backend=c10d",
                    f"--rdzv-endpoint={master}:{port}", "--rdzv-id=rr-failover",
                    "--max-restarts=1", "--rdzv-conf=last_call_timeout=5" +
                    # torchrun guesses the store's host from its hostname, which a namespace
                    # shares with the machine: no agent in the lab would host it.
                    (f",is_host={int(h == 0)}" if lab else "")]
            job = example + ["--checkpoint-every", "10"]
        # Else rank 0's agent tells the workers MASTER_ADDR=localhost, their own namespace.
        local = [f"--local-addr={lab.address(h)}"] if lab else []
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={PER_HOST}",
               "--monitor-interval=0.1", *local, *rdzv, *job]
        env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL="ERROR", LOGLEVEL="INFO",
                   PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
                   RINGREDUCE_HOST_ID=f"host{h}",
                   RINGREDUCE_TRACE_DIR=os.path.join(workdir, "trace"),
                   TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=workdir)
        if lab:  # Lab.env sets the host identity and the sockets' interface
            p = lab.popen(h, cmd, private_shm=True, env=env, **pipes)
        else:
            p = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c",
                                  SCRIPT, "sh"] + cmd, env=env, **pipes)
        threading.Thread(target=lambda p=p, out=outs[h]: out.extend(p.stdout),
                         daemon=True).start()
        procs.append(p)
        if mode == "restart":
            time.sleep(1.0)
    stopped = [False] * HOSTS
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            for h, p in enumerate(procs):
                # The survivors' agents wait 300 s for the dead one at their exit barrier, deaf
                # to SIGTERM meanwhile (Python runs its handler once the store's wait returns).
                if mode == "shrink" and p.poll() is None and not stopped[h] and \
                        any(FINISHED in line for line in outs[h]):
                    # The lab's shell execs the agent; SCRIPT's shell waits for it.
                    for agent in [p.pid] if lab else children(p.pid):
                        os.kill(agent, signal.SIGKILL)
                    stopped[h] = True
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        stray = ours(workdir)
        for pid in stray:
            os.kill(pid, signal.SIGKILL)
    time.sleep(0.2)  # the reader threads' last lines
    texts = ["".join(o) for o in outs]
    leftovers = []
    for text in texts:
        found = re.findall(r"^leftover: ?(.*)$", text, re.M)
        leftovers.append(found[-1].split() if found else None)
    return {"rcs": [p.returncode for p in procs], "outs": texts, "leftovers": leftovers,
            "stopped": stopped, "stray": stray}


def times(text, what):
    """{rank: time} from the example's 'rank R restart C <what> ... time T' lines."""
    return {int(r): float(t) for r, t in
            re.findall(rf"^rank (\d+) restart \d+ {what}.*? time ([0-9.]+)", text, re.M)}


def kill_to_next_step(run, mode):
    """Seconds from the kill to the last survivor's first completed step after it."""
    died = times(run["outs"][DEAD_HOST], "dying at step")[DIE_RANK]
    survivors = "".join(run["outs"][h] for h in range(HOSTS) if h != DEAD_HOST)
    what = "first step after shrink" if mode == "shrink" else r"first step \d+ done"
    done = times(survivors, what) if mode == "shrink" else \
        {int(r): float(t) for r, t in re.findall(
            r"^rank (\d+) restart [1-9]\d* first step \d+ done time ([0-9.]+)", survivors, re.M)}
    assert len(done) == (HOSTS - 1) * PER_HOST, survivors[-3000:]
    return max(done.values()) - died


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--modes", default="shrink,restart")
    ap.add_argument("--workdir", default="/tmp/rr-failover")
    ap.add_argument("--lab", action="store_true",
                    help="each host in a network namespace of a netlab.Lab (real TCP)")
    args = ap.parse_args()
    results = {}
    for i in range(args.runs):
        for mode in args.modes.split(","):
            load = os.getloadavg()[0]
            workdir = os.path.join(args.workdir, f"{mode}-{i}-{os.getpid()}")
            lab = netlab.Lab(HOSTS) if args.lab else None
            try:
                run = launch(workdir, mode, lab=lab)
            finally:
                if lab:
                    lab.close()
            for h, out in enumerate(run["outs"]):
                with open(os.path.join(workdir, f"host{h}.out"), "w") as f:
                    f.write(out)
            seconds = kill_to_next_step(run, mode)
            results.setdefault(mode, []).append(seconds)
            print(f"{mode} run {i}: kill to next step {seconds:.2f} s (load average {load:.2f} "
                  f"before, {os.getloadavg()[0]:.2f} after)", flush=True)
    for mode, xs in results.items():
        print(f"{mode}: median {statistics.median(xs):.2f} s, range {min(xs):.2f}-{max(xs):.2f} "
              f"over {len(xs)} runs")


if __name__ == "__main__":
    main()
