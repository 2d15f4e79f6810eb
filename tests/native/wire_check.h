// The narrow wire (Call::wire) on the CUDA p2p transport, checked bit for bit against the CPU
// kernels (cpu/wire.h), which tests/test_wire.py holds bit for bit to the plain-torch definition
// in tests/reference.py (round once, fp32 fold in rank order, all_reduce rounds again; fp8 blocks
// of 128 from the tensor's start, or from each chunk's for reduce_scatter).
#pragma once
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu/wire.h"
#include "cuda_check.h"
#include "deterministic_check.h"

inline const rr::Wire kWires[] = {rr::Wire::BF16, rr::Wire::F16, rr::Wire::E4M3, rr::Wire::E5M2};

// Element i of rank's input: magnitudes that differ from wire block to wire block (2^-8 .. 2^4,
// so fp8's scales differ) and within one, some blocks all zeros on some ranks, and below fp16's
// range summed over 4 ranks. Exact in dtype t (rounded to it on the host).
inline void wire_put(rr::DType t, char* p, int64_t i, int rank, int salt) {
  const uint32_t h = det_hash(i, rank, salt), hb = det_hash(i / rr::kWireBlock, rank, salt + 7);
  double v = 0.0;
  if (hb % 11 != 0)
    v = (static_cast<double>(h % 20001) - 10000.0) / 10000.0 * std::ldexp(1.0, static_cast<int>(hb % 13) - 8);
  det_put(t, p, v);
}

// One all_reduce (in place or not) or reduce_scatter (in place: the output is the rank's chunk of
// the input) with wire w on every rank; every output must have the CPU kernels' bits, nothing past
// it written, an out-of-place input untouched. Returns how many elements differ from the same
// call without a wire (the wire must change something, or the test proves nothing).
inline int64_t check_wire(std::vector<Rank>& ranks, rr::Coll coll, rr::DType t, rr::RedOp op, rr::Wire w,
                          int64_t numel, bool inplace, const char* what, int salt = 0) {
  const int n = static_cast<int>(ranks.size());
  const size_t es = rr::dtype_size(t);
  const bool rs = coll == rr::Coll::ReduceScatter;
  const int64_t m = numel / n, out_n = rs ? m : numel;
  std::vector<std::vector<char>> host(n);
  std::vector<std::unique_ptr<DevBuf>> ins, outs;
  std::vector<char*> out_p(n);
  for (int r = 0; r < n; ++r) {
    RR_CUDA_CHECK(cudaSetDevice(ranks[r].device));
    host[r].assign((numel + 1) * es, 0x5a);
    for (int64_t i = 0; i < numel; ++i) wire_put(t, &host[r][i * es], i, r, salt);
    ins.push_back(std::make_unique<DevBuf>((numel + 1) * es));
    fill_on(ranks[r].stream, ins[r]->p, host[r]);
    if (inplace) {
      outs.push_back(nullptr);
      out_p[r] = ins[r]->p + (rs ? r * m * es : 0);
    } else {
      outs.push_back(std::make_unique<DevBuf>((out_n + 1) * es));
      set_on(ranks[r].stream, outs[r]->p, 0x5a, (out_n + 1) * es);
      out_p[r] = outs[r]->p;
    }
  }
  for (int r = 0; r < n; ++r) {
    RR_CUDA_CHECK(cudaSetDevice(ranks[r].device));
    ranks[r].run({coll, t, op, numel, ins[r]->p, out_p[r], w}, ranks[r].stream);
  }
  for (int r = 0; r < n; ++r) RR_CUDA_CHECK(cudaStreamSynchronize(ranks[r].stream));

  // The reference of rank r's output (all_reduce: the same on every rank), and the plain fold.
  const int div = op == rr::RedOp::Avg ? n : 1;
  auto reference = [&](int r, std::vector<char>* want, std::vector<char>* plain) {
    const int64_t at = rs ? r * m : 0, len = rs ? m : numel;
    std::vector<std::vector<char>> enc(n, std::vector<char>(rr::wire_span_bytes(w, len) + 1));
    std::vector<const void*> srcs(n);
    for (int q = 0; q < n; ++q) {
      rr::cpu::wire_encode(w, t, &host[q][at * es], len, enc[q].data());
      srcs[q] = enc[q].data();
    }
    std::vector<char> wout(rr::wire_span_bytes(w, len) + 1);
    want->assign(len * es + 1, 0);
    rr::cpu::wire_reduce(w, srcs.data(), n, len, div, rs ? nullptr : wout.data(), t, want->data());
    plain->assign(len * es + 1, 0);
    std::vector<const char*> xs(n);
    for (int64_t i = 0; i < len; ++i) {
      for (int q = 0; q < n; ++q) xs[q] = &host[q][(at + i) * es];
      det_fold(t, op, xs, &(*plain)[i * es]);
    }
  };
  int64_t changed = 0;
  std::vector<char> want, plain;
  for (int r = 0; r < n; ++r) {
    const std::string f = ranks[r].failure();
    EXPECT(f.empty(), "%s: rank %d failed: %s", what, r, f.c_str());
    if (r == 0 || rs) reference(r, &want, &plain);
    std::vector<char> got((out_n + 1) * es);
    RR_CUDA_CHECK(cudaMemcpy(got.data(), out_p[r], (out_n + 1) * es, cudaMemcpyDeviceToHost));
    for (int64_t i = 0; i < out_n; ++i) {
      changed += r == 0 && std::memcmp(&want[i * es], &plain[i * es], es) != 0;
      if (std::memcmp(&got[i * es], &want[i * es], es) != 0) {
        EXPECT(false, "%s: %s n=%d %s %s wire=%s numel=%lld%s rank %d element %lld: got %.9g want %.9g "
               "(without the wire %.9g)", what, rr::coll_name(coll), n, rr::dtype_name(t), rr::op_name(op),
               rr::wire_name(w), (long long)numel, inplace ? " in place" : "", r, (long long)i,
               det_get(t, &got[i * es]), det_get(t, &want[i * es]), det_get(t, &plain[i * es]));
        break;
      }
    }
    expect_untouched(got, out_n, es, inplace, ins[r]->p, host[r], numel, what, rr::coll_name(coll), r);
  }
  return changed;
}
