// The narrow wire's data path on a GPU, for any kernel that rounds onto it or folds from it: the
// symmetric workspace's (p2p/sym_wire.cu) and the two-level plan's between hosts (hier/wire.cu).
// A warp rounds a wire block (128 elements) at a time, 4 elements a lane, in one pass: the loads,
// the block's largest magnitude (one warp reduction: an fp8 scale needs it before any element is
// rounded), the encode or decode in registers, the stores. No shared memory, no block barrier.
// A warp keeps kBatch wire blocks in flight (a fold: of two sources at a time, as the float32
// kernels' span_fold), so a thread has as many elements in flight as theirs. Kernels using it are
// launched by RR_LAUNCH_WARPS (the emulator runs whole warps). Included by .cu files only.
#pragma once
#include "cuda/p2p/device.cuh"
#include "cuda/wire.cuh"

namespace ringreduce::cuda::p2p {
namespace {

constexpr int kLanes = 32;
constexpr int kPer = static_cast<int>(kWireBlock) / kLanes;  // a lane's elements of a wire block
constexpr int kBatch = 4;                                    // wire blocks a warp has in flight
static_assert(kPer == 4 && kThreads % kLanes == 0, "a warp moves a wire block, 4 elements a lane");

__device__ __forceinline__ int lane() { return static_cast<int>(threadIdx.x % kLanes); }
// The lane's first element of wire block b (of a piece).
__device__ __forceinline__ int64_t lane_at(int64_t b) { return b * kWireBlock + lane() * kPer; }

// A wire span in some rank's workspace (layout.h: workspace_wire_bytes): room for `cap` wire blocks of
// the piece from its block `first` (a piece's inputs: all of it; a reduced chunk: its own).
template <Wire W>
struct WSpan {
  using E = typename WireElem<W>::E;
  char* base;
  int64_t cap;
  int64_t first = 0;
  __device__ uint32_t* count(int k) const { return reinterpret_cast<uint32_t*>(base) + k; }
  __device__ float* scale(int64_t b) const {
    return reinterpret_cast<float*>(base + kWireCountBytes) + (b - first);
  }
  // The lane's first element of the piece's wire block b (wire blocks start on 16 bytes).
  __device__ E* elem(int64_t b) const {
    return reinterpret_cast<E*>(base + wire_data_at(wire_scaled(W), cap)) + (b - first) * kWireBlock +
           lane() * kPer;
  }
};

// A lane's group (kPer elements of E) as one access: 16 bytes of float32, 8 of 16-bit, 4 of fp8.
template <int Bytes> struct Group;
template <> struct Group<16> { using U = uint4; };
template <> struct Group<8> { using U = uint2; };
template <> struct Group<4> { using U = uint32_t; };
template <class E> using GroupOf = typename Group<kPer * static_cast<int>(sizeof(E))>::U;

template <class E>
__device__ __forceinline__ bool aligned(const E* p) {
  return reinterpret_cast<uintptr_t>(p) % sizeof(GroupOf<E>) == 0;
}
// The group at p, `left` of its elements present (>= kPer: all): one access when all are and p
// is aligned (vec), else one per present element; absent ones are 0.
template <class E>
__device__ __forceinline__ void get_group(const E* p, int64_t left, bool vec, E (&e)[kPer]) {
  if (vec && left >= kPer) {
    const GroupOf<E> u = __ldcg(reinterpret_cast<const GroupOf<E>*>(p));
    __builtin_memcpy(e, &u, sizeof u);
    return;
  }
#pragma unroll
  for (int k = 0; k < kPer; ++k) e[k] = k < left ? load1(p + k) : E{};
}
template <class E>
__device__ __forceinline__ void put_group(E* p, int64_t left, bool vec, const E (&e)[kPer]) {
  if (vec && left >= kPer) {
    GroupOf<E> u;
    __builtin_memcpy(&u, e, sizeof u);
    __stcg(reinterpret_cast<GroupOf<E>*>(p), u);
    return;
  }
#pragma unroll
  for (int k = 0; k < kPer; ++k)
    if (k < left) store1(p + k, e[k]);
}

// This warp's batches of the wire blocks `blocks`: f(first block, how many of the batch's kBatch
// blocks are in `blocks`). The same in every lane: warp_max and warp_gather need the whole warp.
template <class F>
__device__ void batches(ring::Span blocks, F f) {
  const int64_t end = blocks.begin + blocks.count, step = static_cast<int64_t>(blockDim.x / kLanes) * kBatch;
  for (int64_t b = blocks.begin + static_cast<int64_t>(threadIdx.x / kLanes) * kBatch; b < end; b += step)
    f(b, static_cast<int>(ring::min64(kBatch, end - b)));
}
// The lane's elements present in batch block u (of nb in the part; the piece has count elements).
__device__ __forceinline__ int64_t left_of(int64_t b0, int u, int nb, int64_t count) {
  return u < nb ? count - lane_at(b0 + u) : 0;
}

// The scales of a batch's blocks in up to two sources (fp8): lane s * kBatch + u loads source s's
// scale of block b0 + u, and the warp shares them: one load per scale, not one per lane.
template <Wire W, class Src>
__device__ __forceinline__ void get_scales(Src src, int qs, int64_t b0, int nb, float (&sc)[2][kBatch]) {
  if constexpr (wire_scaled(W)) {
    const int s = lane() / kBatch, u = lane() % kBatch;
    const float mine = s < qs && u < nb ? load1(src(s).scale(b0 + u)) : 0.0f;
    uint32_t all[2 * kBatch];
    warp_gather(wire::bits(mine), all);
#pragma unroll
    for (int k = 0; k < 2 * kBatch; ++k) sc[k / kBatch][k % kBatch] = wire::from_bits(all[k]);
  }
}

// Rounds v (the lane's values of a batch's blocks) onto the wire: an fp8 block's scale from its
// largest magnitude over the warp's present elements; the wire elements into dst (unless its base
// is null), the values they stand for back into v. Returns whether this lane rounded a finite
// value beyond fp16's range.
template <Wire W>
__device__ bool round_batch(float (&v)[kBatch][kPer], int64_t b0, int nb, int64_t count, const WSpan<W>& dst) {
  using E = typename WireElem<W>::E;
  float inv[kBatch] = {}, sc[kBatch] = {};
  if constexpr (wire_scaled(W)) {
    uint32_t amax[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int64_t left = left_of(b0, u, nb, count);
      amax[u] = 0;
#pragma unroll
      for (int k = 0; k < kPer; ++k) {
        const uint32_t x = k < left ? wire::bits(v[u][k]) & 0x7fffffffu : 0u;
        amax[u] = x > amax[u] ? x : amax[u];
      }
    }
    warp_max(amax);
#pragma unroll
    for (int u = 0; u < kBatch; ++u) wire::fp8_scale<Fp8Of<W>>(amax[u], &inv[u], &sc[u]);
  }
  bool over = false;
#pragma unroll
  for (int u = 0; u < kBatch; ++u) {
    const int64_t left = left_of(b0, u, nb, count);
    if (left <= 0) continue;
    E e[kPer];
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      if constexpr (W == Wire::F16) over |= k < left && wire::over_f16(v[u][k]) != 0;
      e[k] = wire_put<W>(v[u][k], inv[u]);
      v[u][k] = wire_get<W>(e[k], sc[u]);
    }
    if (!dst.base) continue;
    put_group(dst.elem(b0 + u), left, true, e);
    if (wire_scaled(W) && lane() == 0) store1(dst.scale(b0 + u), sc[u]);  // lane 0 has an element
  }
  return over;
}

// The lane's values of a batch's blocks from x (the piece's first element); absent ones 0.
template <class T>
__device__ __forceinline__ void get_values(const T* x, bool vec, float (&v)[kBatch][kPer], int64_t b0, int nb,
                                           int64_t count) {
#pragma unroll
  for (int u = 0; u < kBatch; ++u) {
    T e[kPer];
    get_group(x + lane_at(b0 + u), left_of(b0, u, nb, count), vec, e);
#pragma unroll
    for (int k = 0; k < kPer; ++k) v[u][k] = Num<T>::up(e[k]);
  }
}
// v's present elements into out (the piece's first element).
template <class T>
__device__ __forceinline__ void put_values(T* out, bool vec, const float (&v)[kBatch][kPer], int64_t b0,
                                           int nb, int64_t count) {
#pragma unroll
  for (int u = 0; u < kBatch; ++u) {
    T e[kPer];
#pragma unroll
    for (int k = 0; k < kPer; ++k) e[k] = Num<T>::down(v[u][k]);
    put_group(out + lane_at(b0 + u), left_of(b0, u, nb, count), vec, e);
  }
}

// x[0, count) (a piece of the tensor) onto the wire span dst, its wire blocks `blocks`.
template <class T, Wire W>
__device__ bool put_part(const T* x, int64_t count, ring::Span blocks, const WSpan<W>& dst) {
  const bool vec = aligned(x);
  bool over = false;
  batches(blocks, [&](int64_t b0, int nb) {
    float v[kBatch][kPer];
    get_values(x, vec, v, b0, nb, count);
    over |= round_batch<W>(v, b0, nb, count, dst);
  });
  return over;
}

// The rank-order fold of the n sources' wire blocks `blocks` into out (the piece's first element;
// AVG: divided by div). dst set: the sum rounded onto the wire again, into *dst unless its base is
// null, and out gets the rounded values; null: out gets the fp32 sum.
template <class T, Wire W, class Src>
__device__ bool fold_part(Src src, int n, int64_t count, ring::Span blocks, int div, const WSpan<W>* dst,
                          T* out) {
  using E = typename WireElem<W>::E;
  const bool vec = aligned(out);
  bool over = false;
  batches(blocks, [&](int64_t b0, int nb) {
    float acc[kBatch][kPer];
    for (int q = 0; q < n; q += 2) {
      const int qs = n - q < 2 ? 1 : 2;
      auto two = [&](int s) { return src(q + (s < qs ? s : 0)); };
      // every load of both sources issued before any value is used
      E e[2][kBatch][kPer];
      float sc[2][kBatch] = {};
#pragma unroll
      for (int s = 0; s < 2; ++s)
#pragma unroll
        for (int u = 0; u < kBatch; ++u) get_group(two(s).elem(b0 + u), s < qs ? left_of(b0, u, nb, count) : 0, true, e[s][u]);
      get_scales<W>(two, qs, b0, nb, sc);
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        if (s >= qs) break;
#pragma unroll
        for (int u = 0; u < kBatch; ++u)
#pragma unroll
          for (int k = 0; k < kPer; ++k) {
            const float x = wire_get<W>(e[s][u][k], sc[s][u]);
            acc[u][k] = q + s == 0 ? x : add_rn(acc[u][k], x);
          }
      }
    }
    if (div > 1)
#pragma unroll
      for (int u = 0; u < kBatch; ++u)
#pragma unroll
        for (int k = 0; k < kPer; ++k) acc[u][k] = div_rn(acc[u][k], static_cast<float>(div));
    if (dst) over |= round_batch<W>(acc, b0, nb, count, *dst);
    put_values(out, vec, acc, b0, nb, count);
  });
  return over;
}

// out[...] = the values of src's wire blocks `blocks` (another rank's reduced chunk).
template <class T, Wire W>
__device__ void get_part(const WSpan<W>& src, int64_t count, ring::Span blocks, T* out) {
  using E = typename WireElem<W>::E;
  const bool vec = aligned(out);
  batches(blocks, [&](int64_t b0, int nb) {
    E e[kBatch][kPer];
    float sc[2][kBatch] = {};
#pragma unroll
    for (int u = 0; u < kBatch; ++u) get_group(src.elem(b0 + u), left_of(b0, u, nb, count), true, e[u]);
    get_scales<W>([&](int) { return src; }, 1, b0, nb, sc);
    float v[kBatch][kPer];
#pragma unroll
    for (int u = 0; u < kBatch; ++u)
#pragma unroll
      for (int k = 0; k < kPer; ++k) v[u][k] = wire_get<W>(e[u][k], sc[0][u]);
    put_values(out, vec, v, b0, nb, count);
  });
}

}  // namespace
}  // namespace ringreduce::cuda::p2p
