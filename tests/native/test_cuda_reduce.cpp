// Native test of the reduce kernels against a host reference: launch_reduce (every dtype and op,
// odd sizes, misaligned offsets, AVG divisors that do not fit the element type) and
// launch_reduce_ranks, the rank-order fold of deterministic mode, for any number of ranks.
// Built against the emulated device in every CI run (test_cuda_reduce_emu; ranks are threads, areas
// are shared through the emulated IPC) and by nvcc where a toolkit is found (test_cuda_reduce; on a
// GPU, ranks are streams of one process). Exits 0 with a message when there is no CUDA device.
// `test_cuda_reduce_emu NAME...` runs the tests whose names contain a NAME (weak_* only so);
// without names, all but weak_*.
#include "p2p_check.h"

// launch_reduce: d = a op b, with element offsets oa/ob/od into 16-byte aligned buffers.
static void test_reduce() {
  const int64_t sizes[] = {0, 1, 2, 7, 15, 16, 17, 255, 4099, 1000003};
  const int offsets[][3] = {{0, 0, 0}, {1, 1, 1}, {3, 3, 3}, {0, 1, 2}, {2, 0, 0}};
  int cases = 0;
  for (rr::DType t : kDtypes) {
    const size_t es = rr::dtype_size(t);
    for (rr::RedOp op : kOps) {
      for (int64_t n : sizes) {
        for (const auto& off : offsets) {
          const int div = op == rr::RedOp::Avg ? 3 : 1;
          const size_t bytes = (n + 8) * es;
          std::vector<char> ha(bytes), hb(bytes), hd(bytes), want(bytes);
          for (int64_t i = 0; i < n; ++i) {
            put(t, &ha[(i + off[0]) * es], value(t, i, 1));
            put(t, &hb[(i + off[1]) * es], value(t, i, 2));
            const double r = ref_op(op, value(t, i, 1), value(t, i, 2));
            put(t, &want[i * es], op == rr::RedOp::Avg ? ref_avg(t, r, div) : r);
          }
          DevBuf a(bytes), b(bytes), d(bytes);
          RR_CUDA_CHECK(cudaMemcpy(a.p, ha.data(), bytes, cudaMemcpyHostToDevice));
          RR_CUDA_CHECK(cudaMemcpy(b.p, hb.data(), bytes, cudaMemcpyHostToDevice));
          RR_CUDA_CHECK(cudaMemset(d.p, 0x5a, bytes));
          rc::nccl::launch_reduce(t, op, d.p + off[2] * es, a.p + off[0] * es, b.p + off[1] * es, n, div,
                            nullptr);
          RR_CUDA_CHECK(cudaDeviceSynchronize());
          RR_CUDA_CHECK(cudaMemcpy(hd.data(), d.p, bytes, cudaMemcpyDeviceToHost));
          for (int64_t i = 0; i < n; ++i)
            EXPECT(std::memcmp(&hd[(i + off[2]) * es], &want[i * es], es) == 0,
                   "reduce %s %s n=%lld off=%d/%d/%d i=%lld: got %g want %g", rr::dtype_name(t),
                   rr::op_name(op), (long long)n, off[0], off[1], off[2], (long long)i,
                   get(t, &hd[(i + off[2]) * es]), get(t, &want[i * es]));
          // Nothing outside the span is written.
          for (int64_t i = 0; i < off[2]; ++i)
            EXPECT(static_cast<unsigned char>(hd[i * es]) == 0x5a, "reduce wrote before its span");
          EXPECT(static_cast<unsigned char>(hd[(n + off[2]) * es]) == 0x5a, "reduce wrote past its span");
          ++cases;
        }
      }
    }
  }
  std::printf("reduce kernel: %d cases\n", cases);
}

// AVG divides by the world size, which need not fit the element type (int8 with 128 or 200 ranks,
// uint8 with 256 or 300): the device must divide in a wide type, as cpu::reduce does.
static void test_avg_wide_divisor() {
  struct Case { rr::DType t; int64_t a, b; int div; int64_t want; };
  const Case cases[] = {{rr::DType::I8, -64, -64, 128, -1}, {rr::DType::I8, -60, -60, 200, 0},
                        {rr::DType::U8, 200, 50, 256, 0},   {rr::DType::U8, 200, 50, 300, 0},
                        {rr::DType::I32, 3000, 3000, 129, 46}, {rr::DType::I64, -5000, -5000, 256, -39}};
  for (const Case& c : cases) {
    const size_t es = rr::dtype_size(c.t);
    const int64_t n = 37;  // vector body and scalar tail
    std::vector<char> ha(n * es), hb(n * es), hd(n * es);
    for (int64_t i = 0; i < n; ++i) {
      std::memcpy(&ha[i * es], &c.a, es);  // little-endian: the low bytes hold the value
      std::memcpy(&hb[i * es], &c.b, es);
    }
    DevBuf a(n * es), b(n * es), d(n * es);
    RR_CUDA_CHECK(cudaMemcpy(a.p, ha.data(), n * es, cudaMemcpyHostToDevice));
    RR_CUDA_CHECK(cudaMemcpy(b.p, hb.data(), n * es, cudaMemcpyHostToDevice));
    rc::nccl::launch_reduce(c.t, rr::RedOp::Avg, d.p, a.p, b.p, n, c.div, nullptr);
    RR_CUDA_CHECK(cudaDeviceSynchronize());
    RR_CUDA_CHECK(cudaMemcpy(hd.data(), d.p, n * es, cudaMemcpyDeviceToHost));
    for (int64_t i = 0; i < n; ++i) {
      const double got = get(c.t, &hd[i * es]);
      EXPECT(got == static_cast<double>(c.want), "%s AVG (%lld + %lld) / %d: got %g want %lld",
             rr::dtype_name(c.t), (long long)c.a, (long long)c.b, c.div, got, (long long)c.want);
    }
  }
}

// launch_reduce_ranks against the host's rank-order fold: every dtype and op, up to 20 ranks (more
// than the direct kernels' kMaxSpanPtrs), the own piece at any rank and alignment, in place.
static void test_reduce_ranks() {
  const int64_t sizes[] = {0, 1, 17, 4099};
  const int worlds[] = {1, 2, 3, 5, 20};
  int cases = 0;
  DetTeeth teeth;
  for (rr::DType t : kDtypes) {
    const size_t es = rr::dtype_size(t);
    for (rr::RedOp op : kOps)
      for (int64_t n : sizes)
        for (int nr : worlds)
          for (int own : {0, nr - 1})
            for (int off : {0, 1, 3}) {  // element offset of the own piece; the output's too, or in place
              const bool inplace = off == 3;
              const size_t slot = (n * es + 15) / 16 * 16 + 16;  // a multiple of 16 (every es)
              std::vector<std::vector<char>> x(nr, std::vector<char>(std::max<int64_t>(n, 1) * es));
              for (int q = 0; q < nr; ++q)
                for (int64_t i = 0; i < n; ++i) put(t, &x[q][i * es], det_value(t, op, i, q));
              std::vector<char> slots_h((nr > 1 ? nr - 1 : 1) * slot, 0);
              for (int q = 0, k = 0; q < nr; ++q)
                if (q != own) std::memcpy(&slots_h[(k++) * slot], x[q].data(), n * es);
              std::vector<char> own_h((n + 8) * es, 0x5a);
              std::memcpy(&own_h[off * es], x[own].data(), n * es);
              DevBuf own_d(own_h.size()), slots_d(slots_h.size()), out_d((n + 8) * es);
              RR_CUDA_CHECK(cudaMemcpy(own_d.p, own_h.data(), own_h.size(), cudaMemcpyHostToDevice));
              RR_CUDA_CHECK(cudaMemcpy(slots_d.p, slots_h.data(), slots_h.size(), cudaMemcpyHostToDevice));
              RR_CUDA_CHECK(cudaMemset(out_d.p, 0x5a, (n + 8) * es));
              char* dst = inplace ? own_d.p + off * es : out_d.p + (off + 1) * es;
              rc::nccl::launch_reduce_ranks(t, op, dst, own_d.p + off * es, own, slots_d.p, slot, nr, n, nr,
                                      nullptr);
              RR_CUDA_CHECK(cudaDeviceSynchronize());
              std::vector<char> got(n * es + 1);
              RR_CUDA_CHECK(cudaMemcpy(got.data(), dst, n * es, cudaMemcpyDeviceToHost));
              std::vector<const char*> xs(nr);
              std::vector<char> want(es), step(es);
              for (int64_t i = 0; i < n; ++i) {
                for (int q = 0; q < nr; ++q) xs[q] = &x[q][i * es];
                det_fold(t, op, xs, want.data());
                if (nr >= 3 && (op == rr::RedOp::Sum || op == rr::RedOp::Avg) &&
                    (t == rr::DType::F16 || t == rr::DType::BF16)) {
                  det_fold(t, op, xs, step.data(), true);
                  ++teeth.elements;
                  teeth.per_step += want != step;
                }
                if (std::memcmp(&got[i * es], want.data(), es) != 0) {
                  EXPECT(false, "reduce_ranks %s %s n=%lld ranks=%d own=%d off=%d%s i=%lld: got %.17g want %.17g",
                         rr::dtype_name(t), rr::op_name(op), (long long)n, nr, own, off,
                         inplace ? " in place" : "", (long long)i, det_get(t, &got[i * es]),
                         det_get(t, want.data()));
                  break;
                }
              }
              if (!inplace) {  // nothing around the output is written
                std::vector<char> around((n + 8) * es);
                RR_CUDA_CHECK(cudaMemcpy(around.data(), out_d.p, around.size(), cudaMemcpyDeviceToHost));
                for (int64_t i = 0; i < (off + 1) * static_cast<int64_t>(es); ++i)
                  EXPECT(static_cast<unsigned char>(around[i]) == 0x5a, "reduce_ranks wrote before its output");
                EXPECT(static_cast<unsigned char>(around[(off + 1 + n) * es]) == 0x5a,
                       "reduce_ranks wrote past its output");
              }
              ++cases;
            }
  }
  EXPECT(teeth.per_step > 0, "no fp16/bf16 element rounds differently per step: the test could not fail");
  std::printf("reduce_ranks kernel: %d cases; per-step rounding differs on %lld of %lld fp16/bf16 "
              "elements\n", cases, (long long)teeth.per_step, (long long)teeth.elements);
}

int main(int argc, char** argv) {
  return p2p_main("test_cuda_reduce", [&] {
    run_test(argc, argv, "test_reduce", [&] { test_reduce(); });
    run_test(argc, argv, "test_avg_wide_divisor", [&] { test_avg_wide_divisor(); });
    run_test(argc, argv, "test_reduce_ranks", [&] { test_reduce_ranks(); });
  });
}
