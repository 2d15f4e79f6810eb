"""dist.shrink_group on the ringreduce backend: the survivors agree on who is lost, the parent's
communicators end, and a new backend of the survivors takes over (ringreduce/backend.py's
RingBackend.shrink).

Nothing of the parent is reused: the new backend creates its communicators (and its Gloo/NCCL
delegate) on first use, like any new group, on a prefix of the parent's store that no other group
uses. That works on every transport the parent could run (shared memory, two-level, CUDA p2p and
nccl) without a native shrink, at the cost of one setup; it needs the store, which is why the loss
of the store's holder is refused by name. Agreement: each survivor writes the ranks it excludes
under one key and reads every other survivor's; a mismatch, or a survivor that never comes, is an
error on every rank that sees it (within the timeout), never a new group of ranks that disagree.
"""
import json
import os
import time

import torch.distributed as dist

from ._lifecycle import REGISTRY, RingReduceError

SHRINK_ABORT = getattr(dist.distributed_c10d, "SHRINK_ABORT", 1)
_POLL_S = 0.005

STORE_LOST = ("the rendezvous store cannot be reached ({err}): it is held by one process (rank "
              "0's, or torchrun's agent on the first host), and the survivors agree on the lost "
              "ranks through it, so a group cannot shrink once its holder is gone; restart from the "
              "last checkpoint (the elastic recipe, docs/failures.md)")


def _store_call(rank, fn, *args):
    try:
        return fn(*args)
    except (RuntimeError, OSError) as e:  # the TCPStore's "Connection reset", "Broken pipe", ...
        raise RingReduceError(f"ringreduce: rank {rank}: shrink_group: " +
                              STORE_LOST.format(err=str(e).splitlines()[0][:200])) from None


def agree(store, prefix, rank, excluded, size, timeout):
    """Every survivor (in this rank's view) must exclude the same ranks. Returns the survivors."""
    survivors = [r for r in range(size) if r not in excluded]
    mine = json.dumps(sorted(excluded))
    _store_call(rank, store.set, f"{prefix}/excludes/{rank}", mine)
    waiting = [q for q in survivors if q != rank]
    deadline = time.monotonic() + timeout
    while waiting:
        _refused = f"{prefix}/refused"
        if _store_call(rank, store.check, [_refused]):
            why = _store_call(rank, store.get, _refused).decode()
            raise RingReduceError(f"ringreduce: rank {rank}: shrink_group refused: {why}")
        for q in list(waiting):
            key = f"{prefix}/excludes/{q}"
            if not _store_call(rank, store.check, [key]):
                continue
            theirs = _store_call(rank, store.get, key).decode()
            waiting.remove(q)
            if theirs != mine:
                why = (f"rank {rank} excludes ranks {sorted(excluded)} but rank {q} excludes "
                       f"{json.loads(theirs)}: every survivor must call shrink_group with the same "
                       f"ranks_to_exclude")
                _store_call(rank, store.set, _refused, why)
                raise RingReduceError(f"ringreduce: rank {rank}: shrink_group refused: {why}")
        if waiting and time.monotonic() > deadline:
            raise RingReduceError(
                f"ringreduce: rank {rank}: shrink_group timed out after {timeout:g} s waiting for "
                f"survivor(s) {waiting} to call it too (excluding {sorted(excluded)}): every rank "
                f"not excluded must call shrink_group; a rank that died must be in "
                f"ranks_to_exclude")
        if waiting:
            time.sleep(_POLL_S)
    return survivors


def shrink_group(ranks_to_exclude=None, group=None, shrink_flags=SHRINK_ABORT):
    """dist.shrink_group after a failure, in one call: the lost ranks found (lost_ranks) unless
    given, calls in flight aborted (SHRINK_ABORT unless told otherwise), and the new group served on
    every device the old one was (torch registers a shrunk group's backend for its bound device
    only, else the CPU). Returns the new group; after shrinking the default group it is the default."""
    g = group if group is not None else dist.group.WORLD
    devices = list(g._device_types)
    if ranks_to_exclude is None:
        ranks_to_exclude = lost_ranks(group)
    new = dist.shrink_group(list(ranks_to_exclude), group=group, shrink_flags=shrink_flags)
    served = new._device_types
    if served:
        backend = new._get_backend(served[0])  # ours: one backend for every device type
        for d in devices:
            if all(d.type != s.type for s in served):
                new._register_backend(d, dist.ProcessGroup.BackendType.CUSTOM, backend)
    return new


def abort_parent(comms, excluded):
    """SHRINK_ABORT: the parent's calls in flight end now, with an error naming the shrink."""
    for comm in comms:
        if not comm.closed:
            try:
                comm.abort(f"aborted by shrink_group excluding ranks {sorted(excluded)} (SHRINK_ABORT)")
            except Exception:  # noqa: BLE001  (already broken: its calls are ending anyway)
                pass


def close_parent(comms, timeout):
    """The parent's calls in flight end by themselves (a dead peer is noticed in well under a
    second; SHRINK_ABORT ended them already), else at the timeout; then its communicators close,
    aborted first: a close never waits for a lost rank (a CUDA one keeps its memory until exit, as
    after any failure; the shared-memory ones release theirs now)."""
    deadline = time.monotonic() + timeout
    for comm in comms:
        while not comm.closed and comm._inflight and time.monotonic() < deadline:
            time.sleep(_POLL_S)  # native counts notify nobody
        if not comm.closed:
            try:
                comm.abort("closed by shrink_group")
            except Exception:  # noqa: BLE001
                pass
        comm.close()


_lost_attempts = {}


def _give_up_calls(group, me):
    """This rank gives up the group's calls in flight (its rings, and the backend's Gloo/NCCL
    delegate): a peer blocked in one with it fails now (through shared memory, the group's broken
    key, closed connections) and comes to lost_ranks too, instead of at the timeout, too late to be
    counted alive. Say this rank's own failure came from the delegate's broadcast (DDP's buffers)
    while a peer waits for it in an all-reduce."""
    why = f"rank {me} gave up the group's calls in flight (lost_ranks after a failure)"
    for comm in REGISTRY.of_group(group):
        if not comm.closed:
            try:
                comm.abort(why)
            except Exception:  # noqa: BLE001  (already broken)
                pass
    for delegate in _delegates_of(group):
        abort_delegate(delegate)


def _no_delegates(group):
    return []


# group -> the Gloo/NCCL delegates serving it: set by the layer that makes them (backend.register).
_delegates_of = _no_delegates


def set_delegates_of(fn):
    global _delegates_of
    _delegates_of = fn


def abort_delegate(backend):
    """A Gloo/NCCL delegate of a group that lost ranks: its peers may be dead; never wait for them."""
    for name in ("abort", "shutdown"):
        fn = getattr(backend, name, None)
        if fn is not None:
            try:
                fn()
                return
            except Exception:  # noqa: BLE001  (Gloo has neither on some versions)
                continue


def _known_dead(group):
    """Ranks of group whose process this machine knows is gone (the pids its communicators of the
    group recorded at setup; ranks on other machines are unknown here)."""
    dead = set()
    for comm in REGISTRY.of_group(group):
        try:
            pids = comm._pids() or []
        except Exception:  # noqa: BLE001  (closed, or a transport that does not know)
            continue
        dead.update(r for r, pid in enumerate(pids) if pid and _process_dead(pid))
    return dead


def _process_dead(pid):
    """Gone, or a zombie its parent has not reaped yet (as csrc/runtime/peers.cpp judges it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return True
    return stat[stat.rfind(")") + 2:stat.rfind(")") + 3] in ("Z", "X")


def lost_ranks(group=None, wait=5.0):
    """The ranks of group (None: the default group) that are gone, agreed by every survivor: the
    list to hand to dist.shrink_group. Collective over the survivors: each says it is alive through
    the store; a rank is lost when this machine saw its process die, or when it has not said so
    within `wait` seconds (a lost host: nobody is left there to tell). It first gives up this
    rank's calls in flight on the group, so that no survivor stays blocked in one. The first
    survivor to decide decides for all (the store's compare_set), so every survivor returns the
    same list; a rank that finds itself in it (it came later than `wait`) raises RingReduceError."""
    g = group if group is not None else dist.group.WORLD
    store = dist.distributed_c10d._get_default_store()
    ranks = dist.get_process_group_ranks(g)
    me, n = dist.get_rank(g), len(ranks)
    name = g.group_name
    _give_up_calls(g, me)
    _lost_attempts[name] = _lost_attempts.get(name, 0) + 1
    base = f"ringreduce-lost/{name}/{_lost_attempts[name]}"
    _store_call(me, store.set, f"{base}/alive/{me}", "1")
    for r in _known_dead(g):
        _store_call(me, store.set, f"{base}/dead/{r}", "1")
    deadline = time.monotonic() + wait
    unknown = set(range(n)) - {me}
    while unknown and time.monotonic() < deadline:
        for r in list(unknown):
            if _store_call(me, store.check, [f"{base}/alive/{r}"]) or \
                    _store_call(me, store.check, [f"{base}/dead/{r}"]):
                unknown.discard(r)
        if unknown:
            time.sleep(_POLL_S)
    lost = [r for r in range(n) if r != me and not
            _store_call(me, store.check, [f"{base}/alive/{r}"])]
    decided = _store_call(me, store.compare_set, f"{base}/decided", "", json.dumps(lost))
    lost = json.loads(decided)
    if me in lost:
        raise RingReduceError(f"ringreduce: rank {me}: lost_ranks: the other survivors declared this rank "
                   f"lost (it came after their {wait:g} s wait): it is not in the shrunk group; "
                   f"exit, or rejoin with a restart")
    return lost
