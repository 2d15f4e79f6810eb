"""A lab of emulated hosts on one machine: H Linux network namespaces on a bridge, each host's link
shaped both ways by a token bucket (`tc ... tbf rate R`), so that ranks started inside them talk
over a real TCP stack and a link slower than memory.

    with Lab(hosts=2, rate="10gbit") as lab:
        lab.popen(0, ["torchrun", "--nnodes", "2", "--node-rank", "0", ...])
        lab.address(0)      # host 0's address, the rendezvous (--master-addr)

Layout: namespaces `<tag>-h<k>` (host k, interface `eth0`, address 10.213.<n>.<k+1>/24) and
`<tag>-sw` (the switch: a bridge `br0` and one port `p<k>` per host). Each host's `eth0` is shaped
on its way out and the switch's `p<k>` on the way in, so the rate holds in both directions; no
delay is added (this kernel has no netem). Nothing is made outside the lab's namespaces:
deleting them (close(), the end of `with`, SIGINT/SIGTERM, atexit) removes every interface, and
the processes still inside them are killed first. A lab left by a killed process is removed by the
next Lab() (its owner's pid is in the tag). Ranks keep the machine's /dev/shm unless started with
private_shm=True; the host identity comes from RINGREDUCE_HOST_ID and NCCL_HOSTID, which popen()
sets.

Needs CAP_NET_ADMIN (root): Lab() raises LabUnavailable with one line saying so, and
lab_unavailable() returns that line (or None) without making anything.
"""
import atexit
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

from .. import _env

PREFIX = "rrlab"  # every lab's namespaces start with this, then the owner's pid
# Host addresses: 10.213.<lab index>.<host + 1>; nothing outside the lab's namespaces routes there.
SUBNET = "10.213"
RATE_RE = re.compile(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit|tbit)$")
# The token bucket's depth: 2 ms of the rate (at least 64 KiB). A socket then gets the rate
# (measured: 0.120 GB/s at 1gbit, 1.197 at 10gbit: the payload of 1500-byte frames), while a deep
# bucket lets each call's first bytes through at memory speed (4mb: 16 MiB calls at 1gbit ran
# 15-20% under the link's time). RINGREDUCE_LAB_BURST overrides it (a tc size, e.g. 4mb).
BURST_S = 0.002
LATENCY = "50ms"  # how long a packet may queue in the bucket before it is dropped


class LabUnavailable(RuntimeError):
    pass


def _cap_net_admin():
    try:
        with open("/proc/self/status") as f:
            caps = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    except (OSError, StopIteration, ValueError):
        return False
    return bool(caps >> 12 & 1)  # CAP_NET_ADMIN is capability 12


def lab_unavailable():
    """None when this process can build a lab, else the reason in one line."""
    if not _cap_net_admin():
        return ("emulated hosts need CAP_NET_ADMIN (run as root): network namespaces, veth pairs "
                "and tc shaping")
    for tool in ("ip", "tc"):
        if shutil.which(tool, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") is None:
            return f"emulated hosts need `{tool}` (Debian's iproute2)"
    return None


def rate_bits(rate):
    """'10gbit' -> 1e10 (bits per second); ValueError for anything tc's tbf would not take."""
    if not isinstance(rate, str) or not RATE_RE.match(rate):
        raise ValueError(f"a link rate like 1gbit, 10gbit or 500mbit, got {rate!r}")
    unit = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
    num = re.match(r"[\d.]+", rate).group(0)
    return float(num) * unit[rate[len(num):]]


def _run(*cmd, check=True):
    res = subprocess.run(cmd, capture_output=True, text=True)
    if check and res.returncode != 0:
        raise LabUnavailable(f"emulated hosts: `{' '.join(cmd)}` failed: "
                             f"{(res.stderr or res.stdout).strip().splitlines()[-1:]}")
    return res


def _namespaces():
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_inside(ns):
    """Kills every process inside namespace ns (SIGKILL) and waits for them to go."""
    for _ in range(50):
        pids = [int(p) for p in _run("ip", "netns", "pids", ns, check=False).stdout.split()]
        if not pids:
            return
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def _delete(ns):
    _kill_inside(ns)
    _run("ip", "netns", "del", ns, check=False)


def remove_stale():
    """Removes the labs whose owner process is gone; returns their namespaces."""
    gone = []
    for ns in _namespaces():
        m = re.match(rf"^{PREFIX}(\d+)x\d+-", ns)
        if m and not _pid_alive(int(m.group(1))):
            _delete(ns)
            gone.append(ns)
    return gone


class Lab:
    """H emulated hosts joined by a shaped link; see the module docstring."""

    def __init__(self, hosts, rate=None):
        if not isinstance(hosts, int) or hosts < 2:
            raise ValueError(f"Lab: hosts must be an int >= 2, got {hosts!r}")
        if rate is not None:
            rate_bits(rate)
        # The setting is checked first, with or without the rights to make a lab.
        self.burst = _env.get("RINGREDUCE_LAB_BURST") or (
            f"{max(64 << 10, int(rate_bits(rate) / 8 * BURST_S)) >> 10}kb" if rate else None)
        why = lab_unavailable()
        if why:
            raise LabUnavailable(why)
        remove_stale()
        self.hosts, self.rate = hosts, rate
        self._procs = []
        self._closed = False
        # One lab per process at a time is the common case; the index keeps two apart.
        taken = {ns.split("-")[0] for ns in _namespaces() if ns.startswith(PREFIX)}
        index = next(i for i in range(1, 250) if f"{PREFIX}{os.getpid()}x{i}" not in taken)
        self.tag = f"{PREFIX}{os.getpid()}x{index}"
        self.subnet = f"{SUBNET}.{(os.getpid() + index) % 250 + 1}"
        self.switch = f"{self.tag}-sw"
        self.names = [f"{self.tag}-h{k}" for k in range(hosts)]
        self._prev = {}
        atexit.register(self.close)
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._prev[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread: atexit and close() still clean up
                pass
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _on_signal(self, sig, frame):
        self.close()
        prev = self._prev.get(sig)
        if callable(prev):
            prev(sig, frame)
        elif sig == signal.SIGINT:
            raise KeyboardInterrupt
        else:
            sys.exit(128 + sig)

    def _build(self):
        sw = self.switch
        _run("ip", "netns", "add", sw)
        _run("ip", "-n", sw, "link", "set", "lo", "up")
        _run("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", sw, "link", "set", "br0", "up")
        for k, ns in enumerate(self.names):
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            # Made inside the host, the far end moved into the switch: nothing in this namespace.
            _run("ip", "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"p{k}",
                 "netns", sw)
            _run("ip", "-n", ns, "addr", "add", f"{self.address(k)}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", sw, "link", "set", f"p{k}", "master", "br0")
            _run("ip", "-n", sw, "link", "set", f"p{k}", "up")
            if self.rate:
                for where, dev in ((ns, "eth0"), (sw, f"p{k}")):
                    _run("tc", "-n", where, "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                         self.rate, "burst", self.burst, "latency", LATENCY)

    def address(self, host):
        return f"{self.subnet}.{host + 1}"

    def exists(self):
        names = set(_namespaces())
        return [n for n in [self.switch] + self.names if n in names]

    def command(self, host, argv, private_shm=False):
        """argv run inside host's namespace (and, with private_shm, a mount namespace of its own
        with a fresh /dev/shm, as a real host has)."""
        cmd = ["ip", "netns", "exec", self.names[host]]
        if private_shm:
            cmd += ["unshare", "-m", "--propagation", "private", "sh", "-c",
                    'mount -t tmpfs -o size=2g tmpfs /dev/shm && exec "$@"', "sh"]
        return cmd + list(argv)

    def env(self, host, base=None):
        """The environment a rank on host needs: its host identity (to ringreduce and to NCCL,
        which would otherwise take every namespace of this machine for one host) and the
        interface of Gloo's and NCCL's sockets (NCCL without InfiniBand, which would bypass the
        shaped link)."""
        env = dict(os.environ if base is None else base)
        env.update(RINGREDUCE_HOST_ID=f"lab-h{host}", NCCL_HOSTID=f"lab-h{host}",
                   GLOO_SOCKET_IFNAME="eth0", NCCL_SOCKET_IFNAME="eth0", NCCL_IB_DISABLE="1")
        return env

    def popen(self, host, argv, private_shm=False, env=None, **kw):
        p = subprocess.Popen(self.command(host, argv, private_shm), env=self.env(host, env), **kw)
        self._procs.append(p)
        return p

    def measure(self, src=0, dst=1, nbytes=256 << 20):
        """GB/s of one plain TCP stream from host src to host dst (what the link gives a socket)."""
        port = 29400 + os.getpid() % 500
        code = ("import socket,sys,time\n"
                "s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
                f"s.bind(('0.0.0.0',{port})); s.listen(1); c,_=s.accept(); n=0\n"
                "buf=bytearray(1<<20)\n"
                "t=None\n"
                "while True:\n"
                "    k=c.recv_into(buf)\n"
                "    if not k: break\n"
                "    t=t or time.perf_counter(); n+=k\n"
                "print(n, time.perf_counter()-t)\n")
        rx = self.popen(dst, [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        send = (f"import socket,time\nfor i in range(200):\n"
                f"    try: s=socket.create_connection(('{self.address(dst)}',{port})); break\n"
                f"    except OSError: time.sleep(0.05)\n"
                f"b=bytes(1<<20)\nfor i in range({nbytes >> 20}): s.sendall(b)\ns.close()\n")
        tx = self.popen(src, [sys.executable, "-c", send])
        tx.wait(timeout=300)
        out, _ = rx.communicate(timeout=60)
        n, secs = out.split()
        return int(n) / float(secs) / 1e9

    def describe(self):
        return (f"{self.hosts} emulated hosts (network namespaces on a bridge), each link "
                + (f"shaped to {self.rate} both ways (tc tbf, burst {self.burst})" if self.rate
                   else "unshaped (veth)"))

    def close(self):
        """Kills what runs inside and deletes the namespaces (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for p in self._procs:
            if p.poll() is None:
                p.kill()
        for ns in self.names + [self.switch]:
            _delete(ns)
        for p in self._procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        for sig, prev in self._prev.items():
            try:
                signal.signal(sig, prev)
            except (ValueError, TypeError):
                pass
        atexit.unregister(self.close)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
