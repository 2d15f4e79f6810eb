// The two-level CUDA transport (issue 74): a group whose ranks sit on several hosts, every host's
// ranks mapping each other's memory. Inside a host the p2p transport (the symmetric workspace);
// between hosts the nccl transport, one ring per local rank (the ranks with the same index on
// every host, in host order). An all_reduce, in pieces:
//   reduce-scatter inside the host  (p2p, on the caller's stream): local rank j holds chunk j of
//                                   the piece summed over its host, in a slot of its own
//   all_reduce between hosts        (nccl, on this transport's stream): chunk j over the hosts
//   all-gather inside the host      (p2p, on the caller's stream): every rank gets the piece
// The legs of consecutive pieces overlap (piece p between hosts while piece p + 1 is reduced inside
// the host); events order each piece's legs, and a slot's next piece waits for its last reader.
// Per rank 2(H-1)/H of 1/L of the tensor crosses between hosts, as NCCL's own hierarchy sends.
// reduce_scatter and all_gather keep the group's rank order: each piece's chunks are copied into
// (local rank, host) order before the legs (reduce_scatter) or out of it after (all_gather).
// AVG sums on both legs and divides once, by the group's size, between hosts (the chunk's owner),
// so every rank gets the same bits.
// A narrow wire (all_reduce of float32/bf16/fp16 tensors, SUM or AVG; bf16 and fp8 wires) goes on
// the leg between hosts only, as the CPU's two-level wire (ringreduce/_hier/two_level.py): each
// host's partial sum (AVG: divided by the group's size first) rounded onto the wire once, in rows
// of whole 128-element blocks on the tensor's grid (the tail padded with zeros), every host's rows
// sent to every host (one all_gather of bytes), each row folded in host order in float32 and
// rounded once more (wire.cu). With two hosts that moves the bytes of the two steps (a row out, a
// row back); with more, H/2 times as many (the CPU's one-shot exchange). Torch-free.
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cuda/nccl/endpoint.h"
#include "cuda/p2p/endpoint.h"
#include "runtime/transport.h"

namespace ringreduce::cuda::hier {

// Bytes of the tensor per piece of a pipelined call (a reduce_scatter's input, an all_gather's
// output): large enough that a piece's two legs take longer than the launches and group round
// trips of its steps, small enough that three pieces in flight overlap both legs of a DDP bucket.
constexpr size_t kDefaultPieceBytes = 8 << 20;
constexpr int kSlots = 3;  // pieces in flight: one inside the host, one between hosts, one gathered

struct Options {
  int rank = 0;                         // in the group
  std::vector<std::vector<int>> hosts;  // the group's ranks on each host; every host has L of them
  size_t piece_bytes = kDefaultPieceBytes;  // test knob: tiny pieces make many per call
};

// Where the group's ranks are: host h, local rank j of rank by_host[h][j].
struct Layout {
  int rank = 0, nranks = 0, nhosts = 0, nlocal = 0, host = 0, local = 0;
  std::vector<std::vector<int>> by_host;
  explicit Layout(const Options& o);
  std::string host_text(int h) const;  // "host 1 (ranks 2, 3)"
};

class Endpoint : public runtime::Transport {
 public:
  // intra: this host's ranks (rank j of it is local rank j); cross: local rank j of every host, in
  // host order. Both connected. On the current device.
  Endpoint(const Options& o, std::unique_ptr<p2p::Endpoint> intra, std::unique_ptr<nccl::Endpoint> cross);
  ~Endpoint() override;
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;

  void run(const Call& c, cudaStream_t stream);
  p2p::Endpoint& intra() { return *intra_; }
  nccl::Endpoint& cross() { return *cross_; }
  const Layout& layout() const { return layout_; }

  // runtime::Transport
  const char* name() const override { return "hier"; }
  runtime::Caps caps() const override;
  int nranks() const override { return layout_.nranks; }
  Plan plan(const Call& c) override;
  void run(const Call& c, const Plan& /*p*/, void* stream) override { run(c, static_cast<cudaStream_t>(stream)); }
  // The p2p endpoint inside the host serves this host's ranks.
  Transport& local() override;
  std::string failure() override;
  uint64_t failed_seq() override;
  void poll() override { cross_->poll(); }
  void abort(const std::string& why) override;
  void watch_peers(std::vector<runtime::Peer> peers) override;
  void stop_threads() override;
  bool unmap_peers() override;
  void close(bool peers_done) override;
  bool closed() const override { return closed_; }
  bool open() const override { return !closed_ && intra_->open(); }
  uint64_t op_seq() const override { return op_seq_; }
  std::string take_note() override { return intra_->take_note(); }

 private:
  struct Slot {
    char* buf = nullptr;  // the piece's chunks in (local rank, host) order, then its shard
    cudaEvent_t in_host = nullptr, between = nullptr, free = nullptr;
    bool used = false;  // `free` recorded: the next piece waits for it
  };
  // The legs of one piece (its index, its slot, the stream to enqueue on). pipeline() runs them for
  // every piece, kSlots in flight: first and second on the two streams (the caller's s and this
  // transport's, in that order when first_on_caller, else the other), third on s, each after the
  // one before (events), and a slot's next first leg after its last reader.
  using Leg = std::function<void(int64_t, Slot&, cudaStream_t)>;
  void pipeline(int64_t pieces, cudaStream_t s, bool first_on_caller, const Leg& first, const Leg& second,
                const Leg& third);
  void all_reduce(const Call& c, cudaStream_t s);
  void reduce_scatter(const Call& c, cudaStream_t s);
  void all_gather(const Call& c, cudaStream_t s);
  void all_reduce_wire(const Call& c, cudaStream_t s);
  // Bytes of a slot that a wire piece of rows of n elements needs (dtype of es bytes).
  uint64_t wire_slot_bytes(Wire w, size_t es, int64_t n) const;
  void watch();  // a failure between hosts stops this host's ranks (their waits end at once)

  Options opt_;
  Layout layout_;
  std::unique_ptr<p2p::Endpoint> intra_;
  std::unique_ptr<nccl::Endpoint> cross_;
  int device_ = 0;
  cudaStream_t x_ = nullptr;  // the legs between hosts
  cudaEvent_t ready_ = nullptr, done_ = nullptr;  // the caller's stream to x_, and back
  size_t slot_bytes_ = 0;
  Slot slots_[kSlots];
  char* pad_ = nullptr;  // a wire call's last piece: its tail, then zeros (L * H * 128 elements)
  std::atomic<uint64_t> op_seq_{0};
  bool closed_ = false;
  struct Ends {  // where the inner transports' op_seq stood at the end of our call seq
    uint64_t seq, intra, cross;
  };
  std::mutex mu_;  // stop_, ends_
  std::deque<Ends> ends_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread watcher_;
};

// The narrow wire between hosts (wire.cu). A row of n elements (whole wire blocks) on wire w is a
// workspace wire span of wire_row_bytes(w, n) bytes. launch_wire_put: rows k < nrows of `rows`
// (n elements each, dtype t) onto the wire at out + k * wire_row_bytes(w, n). launch_wire_fold:
// row k of out = host h's rows k (h < nhosts, at got + (h * nrows + k) * wire_row_bytes(w, n))
// folded in host order in float32, rounded onto the wire once more, in dtype t.
uint64_t wire_row_bytes(Wire w, int64_t n);
void launch_wire_put(DType t, Wire w, const void* rows, int nrows, int64_t n, char* out, cudaStream_t stream);
void launch_wire_fold(DType t, Wire w, const char* got, int nhosts, int nrows, int64_t n, void* out,
                      cudaStream_t stream);

// x[i] /= divisor for i < n, in the compute type (fp16/bf16: fp32, rounded once; integers
// truncate toward zero): AVG's one division (divide.cu).
void launch_divide(DType t, void* x, int64_t n, int divisor, cudaStream_t stream);

}  // namespace ringreduce::cuda::hier
