// An in-process stand-in for the NCCL calls of csrc/cuda/nccl/ (tests only), built as libnccl.so.2
// and loaded by path as cuda/nccl/library.cpp loads torch's NCCL. Ranks are threads of one
// process. What it keeps of NCCL's semantics:
// - communicators from one unique id form a clique once all nranks have joined; non-blocking
//   communicators report ncclInProgress until then; two ranks on one device are refused with
//   ncclInvalidUsage ("Duplicate GPU detected") unless NCCL_MULTI_RANK_GPU_ENABLE=1;
// - the k-th send from rank a to rank b meets the k-th receive at b from a, whatever the buffers;
//   a send larger than the receive is an error ("message truncated") on the receiver's communicator
//   only: the sender's send completes (NCCL 2.28 over sockets did so on the first H200 run, and a
//   rank whose call succeeded is the case a transport must still fail);
// - the sends and receives of one group run as one operation on their stream: all sends are posted
//   before any receive waits, so a ring of send+recv groups does not deadlock; an unmatched
//   operation waits forever, as NCCL's kernels do, until its communicator is aborted;
// - calls inside an open group are deferred to ncclGroupEnd (per thread).
// It moves bytes with memcpy on the stream's thread; it does not model NCCL's protocols or speed.
#include <nccl.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

namespace {

struct Clique;

}  // namespace

struct ncclComm {
  Clique* clique = nullptr;
  int rank = 0, nranks = 0, device = 0;
  bool blocking = true;
  std::atomic<int> async{ncclInProgress};
  std::atomic<bool> aborted{false}, finalizing{false}, destroyed{false};
  int outstanding = 0;  // operations enqueued and not finished (clique mutex)
  std::string last_error;
};

namespace {

using Clock = std::chrono::steady_clock;

// One matched pair: the k-th send from a to b and the k-th receive at b from a.
struct Slot {
  const void* src = nullptr;
  size_t send_bytes = 0;
  bool posted = false, received = false;
};

struct Clique {
  std::mutex mu;
  std::condition_variable cv;
  int nranks = 0, joined = 0, gone = 0;
  std::vector<std::unique_ptr<ncclComm>> comms;
  std::map<std::tuple<int, int, uint64_t>, Slot> slots;  // (from, to, k)
  std::map<std::pair<int, int>, uint64_t> sends, recvs;  // issued per (from, to)
};

struct Op {
  bool send;
  void* buf;
  size_t bytes;
  int peer;
  ncclComm* comm;
  cudaStream_t stream;
};

std::mutex g_mu;
std::map<std::string, std::shared_ptr<Clique>> g_cliques;  // by unique id
std::map<std::string, ncclResult_t> g_fail_next;
std::atomic<uint64_t> g_ids{0};
std::atomic<uint64_t> g_groups{0};  // operations enqueued (standin_groups)
std::atomic<uint64_t> g_sent{0};    // bytes of every ncclSend posted, all ranks (standin_sent_bytes)
thread_local int tl_depth = 0;
thread_local std::vector<Op> tl_group;
std::string g_last_error;

ncclResult_t injected(const char* fn) {
  std::lock_guard<std::mutex> lk(g_mu);
  auto it = g_fail_next.find(fn);
  if (it == g_fail_next.end()) return ncclSuccess;
  const ncclResult_t r = it->second;
  g_fail_next.erase(it);
  g_last_error = std::string(fn) + ": failure injected by the test";
  return r;
}

std::shared_ptr<Clique> clique_of(ncclComm* c) {
  std::lock_guard<std::mutex> lk(g_mu);
  for (auto& kv : g_cliques)
    if (kv.second.get() == c->clique) return kv.second;
  return nullptr;
}

size_t type_size(ncclDataType_t t) {
  switch (t) {
    case ncclInt8: case ncclUint8: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    default: return 8;
  }
}

void set_error(ncclComm* c, ncclResult_t r, const std::string& why) {
  c->last_error = why;
  c->async = r;
}

// The body of one group on one stream (runs on the stream's thread): post the sends, take the
// receives as they arrive, then wait until the receivers have taken the sends.
struct GroupRun {
  std::shared_ptr<Clique> clique;
  std::vector<Op> ops;
  std::vector<uint64_t> keys;  // k of each op
};

void run_group(void* p) {
  std::unique_ptr<GroupRun> g(static_cast<GroupRun*>(p));
  Clique& cl = *g->clique;
  ncclComm* me = g->ops.front().comm;
  std::unique_lock<std::mutex> lk(cl.mu);
  auto slot = [&](size_t i) -> Slot& {
    const Op& o = g->ops[i];
    const int from = o.send ? me->rank : o.peer, to = o.send ? o.peer : me->rank;
    return cl.slots[{from, to, g->keys[i]}];
  };
  for (size_t i = 0; i < g->ops.size(); ++i) {
    if (!g->ops[i].send) continue;
    Slot& s = slot(i);
    s.src = g->ops[i].buf;
    s.send_bytes = g->ops[i].bytes;
    s.posted = true;
  }
  cl.cv.notify_all();
  auto wait = [&](auto pred) {
    while (!pred()) {
      if (me->aborted) return false;
      cl.cv.wait_for(lk, std::chrono::milliseconds(5));
    }
    return true;
  };
  bool ok = true;
  for (size_t i = 0; ok && i < g->ops.size(); ++i) {
    const Op& o = g->ops[i];
    if (o.send) continue;
    Slot& s = slot(i);
    ok = wait([&] { return s.posted; });
    if (!ok) break;
    if (s.send_bytes > o.bytes) {
      set_error(me, ncclInvalidUsage,
                "message truncated: rank " + std::to_string(o.peer) + " sent " +
                    std::to_string(s.send_bytes) + " bytes, rank " + std::to_string(me->rank) +
                    " posted a receive of " + std::to_string(o.bytes));
      s.received = true;  // the send is consumed: the sender's call completes without an error
      cl.cv.notify_all();
      ok = false;
      break;
    }
    if (s.send_bytes) std::memcpy(o.buf, s.src, s.send_bytes);
    s.received = true;
    cl.cv.notify_all();
  }
  for (size_t i = 0; ok && i < g->ops.size(); ++i) {
    if (!g->ops[i].send) continue;
    Slot& s = slot(i);
    ok = wait([&] { return s.received; });
    if (ok) cl.slots.erase({me->rank, g->ops[i].peer, g->keys[i]});
  }
  if (--me->outstanding == 0 && me->finalizing && me->async == ncclInProgress) me->async = ncclSuccess;
  cl.cv.notify_all();
}

ncclResult_t enqueue(std::vector<Op>& ops) {
  ++g_groups;
  // One GroupRun per (communicator, stream), keys assigned in issue order.
  std::map<std::pair<ncclComm*, cudaStream_t>, std::unique_ptr<GroupRun>> runs;
  for (const Op& o : ops) {
    auto& r = runs[{o.comm, o.stream}];
    if (!r) {
      r = std::make_unique<GroupRun>();
      r->clique = clique_of(o.comm);
    }
    Clique& cl = *r->clique;
    std::lock_guard<std::mutex> lk(cl.mu);
    const int from = o.send ? o.comm->rank : o.peer, to = o.send ? o.peer : o.comm->rank;
    r->keys.push_back(++(o.send ? cl.sends : cl.recvs)[{from, to}]);
    r->ops.push_back(o);
  }
  bool nonblocking = false;
  for (auto& kv : runs) {
    ncclComm* c = kv.first.first;
    nonblocking |= !c->blocking;
    {
      std::lock_guard<std::mutex> lk(kv.second->clique->mu);
      ++c->outstanding;
    }
    GroupRun* g = kv.second.release();
    if (cudaLaunchHostFunc(kv.first.second, run_group, g) != cudaSuccess) {
      std::lock_guard<std::mutex> lk(g->clique->mu);
      --c->outstanding;
      set_error(c, ncclUnhandledCudaError, "cudaLaunchHostFunc failed");
      delete g;
      return ncclUnhandledCudaError;
    }
    if (c->async == ncclInProgress) c->async = ncclSuccess;
  }
  ops.clear();
  return nonblocking ? ncclInProgress : ncclSuccess;
}

ncclResult_t p2p(bool send, const void* buf, size_t count, ncclDataType_t t, int peer, ncclComm_t comm,
                 cudaStream_t stream) {
  if (!comm || comm->destroyed) return ncclInvalidArgument;
  if (peer < 0 || peer >= comm->nranks) {
    set_error(comm, ncclInvalidArgument, "peer " + std::to_string(peer) + " out of range");
    return ncclInvalidArgument;
  }
  if (comm->async != ncclSuccess && comm->async != ncclInProgress) return static_cast<ncclResult_t>(comm->async.load());
  Op o{send, const_cast<void*>(buf), count * type_size(t), peer, comm, stream};
  if (send) g_sent += o.bytes;
  if (tl_depth > 0) {
    tl_group.push_back(o);
    return ncclSuccess;
  }
  std::vector<Op> one{o};
  return enqueue(one);
}

}  // namespace

extern "C" {

ncclResult_t ncclGetVersion(int* version) {
  *version = 23000;  // behaves as NCCL 2.30 (NCCL_MULTI_RANK_GPU_ENABLE)
  return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  std::memset(id, 0, sizeof *id);
  std::snprintf(id->internal, sizeof id->internal, "standin-%d-%llu", getpid(),
                static_cast<unsigned long long>(++g_ids));
  return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* out, int nranks, ncclUniqueId id, int rank,
                                    ncclConfig_t* config) {
  *out = nullptr;
  if (ncclResult_t r = injected("ncclCommInitRankConfig")) return r;
  if (nranks < 1 || rank < 0 || rank >= nranks) return ncclInvalidArgument;
  const std::string key(id.internal, strnlen(id.internal, sizeof id.internal));
  std::shared_ptr<Clique> cl;
  {
    std::lock_guard<std::mutex> lk(g_mu);
    auto& slot = g_cliques[key];
    if (!slot) {
      slot = std::make_shared<Clique>();
      slot->nranks = nranks;
      slot->comms.resize(nranks);
    }
    cl = slot;
  }
  std::unique_lock<std::mutex> lk(cl->mu);
  if (cl->nranks != nranks || cl->comms[rank]) return ncclInvalidUsage;
  auto c = std::make_unique<ncclComm>();
  c->clique = cl.get();
  c->rank = rank;
  c->nranks = nranks;
  c->blocking = !config || config->blocking != 0;
  cudaGetDevice(&c->device);
  *out = c.get();
  cl->comms[rank] = std::move(c);
  if (++cl->joined == nranks) {
    const char* multi = std::getenv("NCCL_MULTI_RANK_GPU_ENABLE");
    std::string dup;
    for (int a = 0; a < nranks && dup.empty(); ++a)
      for (int b = a + 1; b < nranks && dup.empty(); ++b)
        if (cl->comms[a]->device == cl->comms[b]->device && !(multi && std::strcmp(multi, "1") == 0))
          dup = "Duplicate GPU detected : rank " + std::to_string(b) + " and rank " +
                std::to_string(a) + " both on CUDA device " + std::to_string(cl->comms[a]->device);
    for (auto& m : cl->comms) {
      if (dup.empty()) m->async = ncclSuccess;
      else set_error(m.get(), ncclInvalidUsage, dup);
    }
    cl->cv.notify_all();
  }
  if (!(*out)->blocking) return ncclInProgress;
  cl->cv.wait(lk, [&] { return cl->joined == nranks; });
  return static_cast<ncclResult_t>((*out)->async.load());
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* state) {
  if (!comm) return ncclInvalidArgument;
  *state = static_cast<ncclResult_t>(comm->async.load());
  return ncclSuccess;
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  if (!comm || comm->destroyed) return ncclInvalidArgument;
  std::lock_guard<std::mutex> lk(comm->clique->mu);
  comm->finalizing = true;
  if (comm->async == ncclSuccess && comm->outstanding > 0) comm->async = ncclInProgress;
  return comm->blocking ? ncclSuccess : ncclInProgress;
}

static ncclResult_t release(ncclComm_t comm, bool abort) {
  if (!comm || comm->destroyed) return ncclInvalidArgument;
  std::shared_ptr<Clique> cl = clique_of(comm);
  if (abort) comm->aborted = true;
  comm->destroyed = true;
  std::lock_guard<std::mutex> lk(cl->mu);
  cl->cv.notify_all();
  if (++cl->gone == cl->nranks) {  // operations still queued hold the clique (shared_ptr)
    std::lock_guard<std::mutex> glk(g_mu);
    for (auto it = g_cliques.begin(); it != g_cliques.end(); ++it)
      if (it->second == cl) {
        g_cliques.erase(it);
        break;
      }
  }
  return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) { return release(comm, false); }
ncclResult_t ncclCommAbort(ncclComm_t comm) { return release(comm, true); }

const char* ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
  }
}

const char* ncclGetLastError(ncclComm_t comm) {
  if (comm && !comm->last_error.empty()) return comm->last_error.c_str();
  return g_last_error.c_str();
}

ncclResult_t ncclGroupStart() {
  if (ncclResult_t r = injected("ncclGroupStart")) return r;
  ++tl_depth;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
  if (tl_depth == 0) return ncclInvalidUsage;
  if (ncclResult_t r = injected("ncclGroupEnd")) {
    --tl_depth;
    tl_group.clear();
    return r;
  }
  if (--tl_depth > 0) return ncclSuccess;
  return tl_group.empty() ? ncclSuccess : enqueue(tl_group);
}

ncclResult_t ncclSend(const void* buf, size_t count, ncclDataType_t t, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  if (ncclResult_t r = injected("ncclSend")) return r;
  return p2p(true, buf, count, t, peer, comm, stream);
}

ncclResult_t ncclRecv(void* buf, size_t count, ncclDataType_t t, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  if (ncclResult_t r = injected("ncclRecv")) return r;
  return p2p(false, buf, count, t, peer, comm, stream);
}

void standin_fail_next(const char* function, ncclResult_t result) {
  std::lock_guard<std::mutex> lk(g_mu);
  g_fail_next[function] = result;
}

int standin_group_depth() { return tl_depth; }

uint64_t standin_groups() { return g_groups.load(); }

uint64_t standin_sent_bytes() { return g_sent.load(); }

}  // extern "C"
