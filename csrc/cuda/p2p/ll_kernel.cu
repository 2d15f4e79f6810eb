// The LL one-shot of the p2p transport (Algo::LL): the smallest all_reduces with no barrier. Each
// rank writes its input straight into its slot in every peer's area, as 8-byte words of 4 data
// bytes and the call's flag (ll_word, ll_flag): single-copy atomic, so a word whose flag is this
// call's carries this call's data, and no fence or flag of its own is needed (NCCL's LL
// protocol); two words go in one 16-byte store and come back in one 16-byte poll. Each rank then
// polls its own slots and folds the n inputs in rank order (the bits of one-shot and of
// deterministic mode). Every block also waits for every peer's header words and checks them, so
// that a mismatched call is named. Slots alternate by the parity of the LL call's count k: a rank
// writes a slot again two LL calls later, when it has read every peer's words of the call
// between, which each peer wrote after its kernel of the call before ended (stream order). Every
// 2^30 calls a call wipes the idle slot first (ll_wipes), so no word lives to see its flag come
// round again. The epoch (the workspace's, one per LL call) keeps sym_kernel.cu's halves and
// barriers in step. Waits poll the abort word and the deadline, as the barriers do.
// Why a kernel of its own beside sym_kernel.cu's one-shot (the same fold in rank order): LL's
// synchronisation is in the data (every 8-byte word carries its flag) and its slots are in the
// peers' areas, where sym_kernel's is a barrier per piece before 16-byte loads of workspace
// halves. One kernel would put a flag check into every word sym_kernel moves, or a barrier into
// LL, which exists because it has none. Not measured as one kernel: the reason is the design's.
#include "cuda/p2p/device.cuh"
#include "cuda/reduce.cuh"

namespace ringreduce::cuda::p2p {
namespace {

__device__ __forceinline__ uint64_t* ll_slot(const SymArgs& a, Area* area, uint64_t k, int src) {
  return reinterpret_cast<uint64_t*>(reinterpret_cast<char*>(area) + a.ll_at +
                                     ((k & 1) * a.nranks + src) * a.ll_slot);
}

// ll_wait's answer when the peer waited for (sym_peer) is in a workspace barrier of this epoch
// instead: it made another call (not an abort word: those have a cause in the top byte).
constexpr uint32_t kSymPeer = ~0u;

// Every kPollsPerCheck polls of a wait: the abort words and the deadline, as sym_wait checks them.
// Returns 0 (go on polling) or the word that ends the wait (*local: this thread saw the cause).
__device__ uint32_t ll_check(const SymArgs& a, uint32_t polls, uint64_t t0, bool* local) {
  const uint32_t s = ld_relaxed_sys(&a.self->abort);
  if (s) {
    *local = abort_rank(s) == a.rank && abort_cause(s) == kHostAbort;
    return s;
  }
  if ((polls / kPollsPerCheck) % 16 == 0 && ld_relaxed_sys(&a.ctl->abort)) return abort_word(kHostAbort, a.rank);
  if (globaltimer_ns() - t0 > a.timeout_ns) return abort_word(kTimeout, a.rank);
  return 0;
}

// Thread t: waits until the word at p carries flag; *v: the word. Returns 0 or the abort word that
// ended the wait (*local: this thread saw the cause itself), as sym_wait does; sym_peer >= 0: also
// kSymPeer once that peer's block raised this block's start barrier word for the epoch.
__device__ uint32_t ll_wait(const SymArgs& a, const uint64_t* p, uint32_t flag, uint64_t* v, bool* local,
                            int sym_peer = -1, uint64_t epoch = 0) {
  *local = true;
  uint64_t w = ld_ll(p);
  if (static_cast<uint32_t>(w >> 32) != flag) {
    const uint64_t t0 = globaltimer_ns();
    for (uint32_t polls = 1;; ++polls) {
      w = ld_ll(p);
      if (static_cast<uint32_t>(w >> 32) == flag) break;
      spin_hint();
      if (polls % kPollsPerCheck) continue;
      if (sym_peer >= 0 &&
          ld_acquire_sys(&a.self->sym[blockIdx.x].arrived[sym_peer]) >= barrier_value(epoch, kStart))
        return kSymPeer;
      if (const uint32_t s = ll_check(a, polls, t0, local)) return s;
    }
  }
  ll_arrived(p);
  *v = w;
  return 0;
}

__device__ __forceinline__ bool ll_has(uint64_t w, uint32_t flag) { return static_cast<uint32_t>(w >> 32) == flag; }

// One 16-byte group of a peer's input: its `words` (1-4) LL words at p (16-byte aligned), polled
// 16 bytes a load, both loads in flight together; *d: the data (zero past `words`). Returns 0 or
// the abort word that ended the wait, as ll_wait.
__device__ uint32_t ll_wait_group(const SymArgs& a, const uint64_t* p, int words, uint32_t flag, uint4* d,
                                  bool* local) {
  *local = true;
  uint64_t w0, w1, w2 = 0, w3 = 0;
  ld_ll2(p, &w0, &w1);
  if (words > 2) ld_ll2(p + 2, &w2, &w3);
  bool lo = ll_has(w0, flag) && (words < 2 || ll_has(w1, flag));
  bool hi = words <= 2 || (ll_has(w2, flag) && (words < 4 || ll_has(w3, flag)));
  if (!(lo && hi)) {
    const uint64_t t0 = globaltimer_ns();
    for (uint32_t polls = 1;; ++polls) {
      if (!lo) ld_ll2(p, &w0, &w1);
      if (!hi) ld_ll2(p + 2, &w2, &w3);
      lo = ll_has(w0, flag) && (words < 2 || ll_has(w1, flag));
      hi = words <= 2 || (ll_has(w2, flag) && (words < 4 || ll_has(w3, flag)));
      if (lo && hi) break;
      spin_hint();
      if (polls % kPollsPerCheck) continue;
      if (const uint32_t s = ll_check(a, polls, t0, local)) return s;
    }
  }
  for (int k = 0; k < words; ++k) ll_arrived(p + k);
  d->x = static_cast<uint32_t>(w0);
  d->y = words > 1 ? static_cast<uint32_t>(w1) : 0u;
  d->z = words > 2 ? static_cast<uint32_t>(w2) : 0u;
  d->w = words > 3 ? static_cast<uint32_t>(w3) : 0u;
  return 0;
}

// Posts one 16-byte group's `words` data words (of v) at p (16-byte aligned), with flag.
__device__ __forceinline__ void ll_post_group(uint64_t* p, uint4 v, int words, uint32_t flag) {
  if (words == 4) {
    st_ll2(p, ll_word(v.x, flag), ll_word(v.y, flag));
    st_ll2(p + 2, ll_word(v.z, flag), ll_word(v.w, flag));
    return;
  }
  st_ll(p, ll_word(v.x, flag));
  if (words > 1) st_ll(p + 1, ll_word(v.y, flag));
  if (words > 2) st_ll(p + 2, ll_word(v.z, flag));
}

// 16 bytes (n of them; the rest zero) at p, any alignment.
__device__ __forceinline__ uint4 load_bytes(const char* p, int n) {
  uint4 v{};
  if (n == 16 && (reinterpret_cast<uintptr_t>(p) & 15) == 0) return __ldcg(reinterpret_cast<const uint4*>(p));
  unsigned char b[16] = {};
  for (int k = 0; k < n; ++k) b[k] = load1(reinterpret_cast<const unsigned char*>(p) + k);
  __builtin_memcpy(&v, b, 16);
  return v;
}
__device__ __forceinline__ void store_bytes(char* p, uint4 v, int n) {
  if (n == 16 && (reinterpret_cast<uintptr_t>(p) & 15) == 0) return __stcg(reinterpret_cast<uint4*>(p), v);
  unsigned char b[16];
  __builtin_memcpy(b, &v, 16);
  for (int k = 0; k < n; ++k) store1(reinterpret_cast<unsigned char*>(p) + k, b[k]);
}
template <class T, RedOp Op>
__global__ void __launch_bounds__(kThreads) ll_kernel(const __grid_constant__ SymArgs a) {
  const int n = a.nranks, r = a.rank, tid = threadIdx.x;
  const uint64_t es = sizeof(T);
  __shared__ unsigned s_claim;
  __shared__ uint64_t s_epoch, s_ll;
  if (tid == 0) {
    s_claim = 0;
    s_ll = ld_relaxed_sys(&a.self->sym[blockIdx.x].ll.value);  // (broken_at_start's barrier shares it)
  }
  if (broken_at_start(a, &a.self->sym[blockIdx.x].epoch.value, &s_epoch)) return;
  const uint64_t e = s_epoch + 1, k = s_ll + 1;
  const uint32_t flag = ll_flag(k);
  const char* in = static_cast<const char*>(a.in);
  const int64_t nbytes = a.numel * static_cast<int64_t>(es);
  // This block's 16-byte groups of the tensor (whole elements: es divides 16), the same cut on
  // every rank; posted and folded by this block only.
  const ring::Span G = ring::channel_part(ring::Span{0, (nbytes + 15) / 16}, gridDim.x, blockIdx.x);
  const MsgHeader mine = my_header(a, static_cast<uint64_t>(nbytes), static_cast<uint32_t>(gridDim.x) << 24);
  if (blockIdx.x == 0 && ll_wipes(k)) {
    // The idle slot of every source zeroed before this call's header leaves (see ll_wipes).
    uint64_t* idle = ll_slot(a, a.self, k + 1, 0);
    const int64_t words = static_cast<int64_t>(a.nranks) * a.ll_slot / 8;
    for (int64_t i = 2 * tid; i < words; i += 2 * blockDim.x) st_ll2(idle + i, 0, 0);
    fence_acq_rel_sys();
    __syncthreads();
  }
  // Post: the header (block 0) and this block's data words, into every peer's slot of this rank.
  for (int64_t g = G.begin + tid; g < G.begin + G.count; g += blockDim.x) {
    const int bytes = static_cast<int>(ring::min64(16, nbytes - 16 * g));
    const uint4 v = load_bytes(in + 16 * g, bytes);
    for (int q = 0; q < n; ++q)
      if (q != r) ll_post_group(ll_slot(a, a.peer[q], k, r) + kLLHeaderWords + 4 * g, v, (bytes + 3) / 4, flag);
  }
  for (int q = 0; q < n; ++q) {
    if (q == r) continue;
    uint64_t* slot = ll_slot(a, a.peer[q], k, r);
    if (blockIdx.x == 0 && tid < kLLHeaderWords) {
      uint32_t hw[kLLHeaderWords];
      __builtin_memcpy(hw, &mine, sizeof mine);
      st_ll(slot + tid, ll_word(hw[tid], flag));
    }
    // For a peer that made another call and waits in a workspace barrier of this epoch: this
    // block's header and start value there, so that it names both calls (the last thread: at
    // small sizes it folds nothing, so its fence delays no fold).
    if (tid == static_cast<int>(blockDim.x) - 1) {
      put_header(&a.peer[q]->sym_hdr[e & 1][blockIdx.x][r], mine);
      fence_acq_rel_sys();
      st_relaxed_sys(&a.peer[q]->sym[blockIdx.x].arrived[r], barrier_value(e, kStart));
    }
  }
  // Every peer's header, checked (thread q * 8 + k waits for word k of peer q's).
  uint32_t stop = 0;
  bool local = true;
  int waited = -1;
  const MsgHeader* got = nullptr;
  MsgHeader theirs;
  for (int t = tid; t < n * kLLHeaderWords && !stop; t += blockDim.x) {
    if (t / kLLHeaderWords == r) continue;
    uint64_t w;
    waited = t / kLLHeaderWords;
    const uint64_t* word = ll_slot(a, a.self, k, waited) + t % kLLHeaderWords;
    stop = ll_wait(a, word, flag, &w, &local, waited, e);
    if (stop == kSymPeer) {
      // Its header in the workspace's place: the same call (an LL peer whose words are on their
      // way: wait for them), or another one, named.
      theirs = get_header(&a.self->sym_hdr[e & 1][blockIdx.x][waited]);
      const uint32_t cause = check_header(theirs, mine);
      if (cause == kOk) {
        stop = ll_wait(a, word, flag, &w, &local);
      } else {
        stop = abort_word(cause, r);
        got = &theirs;
      }
    }
  }
  // Every header word in, unless some wait stopped (then its thread records why).
  if (__syncthreads_or(stop != 0) == 0) {
    for (int q = tid; q < n && !stop; q += blockDim.x) {
      if (q == r) continue;
      uint32_t hw[kLLHeaderWords];
      const uint64_t* slot = ll_slot(a, a.self, k, q);
      for (int j = 0; j < kLLHeaderWords; ++j) hw[j] = static_cast<uint32_t>(ld_ll(slot + j));
      __builtin_memcpy(&theirs, hw, sizeof theirs);
      const uint32_t cause = check_header(theirs, mine);
      if (cause != kOk) stop = abort_word(cause, r), got = &theirs, waited = q;
    }
  }
  if (stop && atomicCAS(&s_claim, 0u, 1u) == 0u)
    record_stop(a, stop, local, waited, Where{2, waited, 0}, false, mine, got);
  if (__syncthreads_or(stop != 0) == 0) {
    // Fold: group g of every rank in rank order (own input read in place), accumulated in the
    // compute type and rounded once, as span_fold does.
    using N = Num<T>;
    using C = typename N::C;
    constexpr int K = 16 / sizeof(T);
    char* out = static_cast<char*>(a.out);
    for (int64_t g = G.begin + tid; g < G.begin + G.count && !stop; g += blockDim.x) {
      const int bytes = static_cast<int>(ring::min64(16, nbytes - 16 * g));
      const int words = (bytes + 3) / 4;
      C acc[K] = {};
      for (int q = 0; q < n && !stop; ++q) {
        uint4 v;
        if (q == r) {
          v = load_bytes(in + 16 * g, bytes);
        } else {
          stop = ll_wait_group(a, ll_slot(a, a.self, k, q) + kLLHeaderWords + 4 * g, words, flag, &v, &local);
          if (stop) {
            waited = q;
            break;
          }
        }
        T x[K];
        __builtin_memcpy(x, &v, 16);
#pragma unroll
        for (int j = 0; j < K; ++j) acc[j] = q == 0 ? N::up(x[j]) : apply<Op>(acc[j], N::up(x[j]));
      }
      if (stop) break;
      T x[K];
#pragma unroll
      for (int j = 0; j < K; ++j) {
        C c = acc[j];
        if (a.divisor > 1) {
          if constexpr (std::is_integral_v<C>) c = static_cast<C>(static_cast<int64_t>(c) / a.divisor);
          else c = c / static_cast<C>(a.divisor);
        }
        x[j] = N::down(c);
      }
      uint4 v;
      __builtin_memcpy(&v, x, 16);
      store_bytes(out + 16 * g, v, bytes);
    }
    if (stop && atomicCAS(&s_claim, 0u, 1u) == 0u)
      record_stop(a, stop, local, waited, Where{2, waited, 0}, false, mine, nullptr);
  }
  // As end_epochs, with the LL count beside the epoch.
  __syncthreads();
  if (tid == 0)
    for (int b = blockIdx.x; b < kMaxSymBlocks; b += gridDim.x) {
      a.self->sym[b].epoch.value = e;
      a.self->sym[b].ll.value = k;
    }
}

}  // namespace

void launch_ll(const SymArgs& a, cudaStream_t stream) {
  if (a.nranks < 2 || a.nranks > kMaxPeers || a.blocks < 1 || a.blocks > kMaxSymBlocks ||
      a.coll != static_cast<uint8_t>(Coll::AllReduce) || a.ll_slot == 0 ||
      static_cast<uint64_t>(a.numel) * dtype_size(static_cast<DType>(a.dtype)) >
          (a.ll_slot / 8 - kLLHeaderWords) * 4)
    throw std::invalid_argument("ringreduce: p2p LL launch: bad rank, block count or size");
  dispatch_dtype(static_cast<DType>(a.dtype), [&](auto tag) {
    using T = decltype(tag);
    dispatch_op(static_cast<RedOp>(a.op), [&](auto optag) {
      constexpr auto kernel = &ll_kernel<T, decltype(optag)::value>;
      RR_LAUNCH(kernel, a.blocks, kThreads, stream, a);
    });
  });
  RR_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ringreduce::cuda::p2p
