// The flight recorder: every communicator keeps its last N calls (what, how big, where from, and
// when each call was queued, started and ended) so that a hung or failed job can say which rank
// did what. Cheap enough to stay on (two clock reads and a few stores per call); written as JSON
// on failure, on demand, or on SIGUSR1 for every recorder of the process. Torch-free.
#pragma once
#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace ringreduce::runtime {

// Where a call came from. Set per thread by the entry points (the backend, hooks, the bucketer,
// registered ops); the direct API is the default.
enum class Source : uint8_t { Api = 0, Backend, DdpHook, Bucketer, Op, Nn, Count };
const char* source_name(Source s);
bool parse_source(const std::string& name, Source& out);
Source& current_source();  // this thread's

struct SourceScope {  // sets this thread's source for a scope
  explicit SourceScope(Source s) : prev(current_source()) { current_source() = s; }
  ~SourceScope() { current_source() = prev; }
  Source prev;
};

enum class CallState : uint8_t { Queued = 0, Started, Finished, Failed };

int64_t now_ns();  // steady clock

class Recorder {
 public:
  struct Entry {
    uint64_t seq = 0;  // 1-based call number on this communicator (the same call on every rank)
    const char* coll = "";
    const char* dtype = "";
    const char* op = "";
    const char* algo = "";
    int64_t numel = 0;
    uint64_t nbytes = 0;
    int64_t t_queued = 0, t_started = 0, t_ended = 0;  // now_ns(); 0: not reached
    Source source = Source::Api;
    CallState state = CallState::Queued;
    uint64_t dev_seq = 0;  // CUDA: the ring's call number, for the device probe (0: none)
  };

  // Where a CUDA call stands on the device (read without blocking): 0 unknown, 1 pending,
  // 2 done (*done_ns: when, steady clock; 0 if not known), 3 failed (*error: why).
  using DeviceProbe = std::function<int(uint64_t dev_seq, int64_t* done_ns, std::string* error)>;

  // capacity 0: off (every call is a no-op, dumps hold no entries). RINGREDUCE_TRACE_BUFFER is
  // read and checked by Python (ringreduce/_lifecycle.py: trace_buffer), its default is this.
  static constexpr size_t kDefaultCapacity = 2000;
  explicit Recorder(size_t capacity);
  ~Recorder();
  Recorder(const Recorder&) = delete;
  Recorder& operator=(const Recorder&) = delete;

  bool on() const { return cap_ != 0; }
  size_t capacity() const { return cap_; }

  // A new call (strings must outlive the recorder: static names, or intern()), made at t_queued
  // (now_ns()) and started at t_started (0: queued behind earlier calls). Returns its seq (0: off).
  uint64_t begin(const char* coll, const char* dtype, const char* op, const char* algo, int64_t numel,
                 uint64_t nbytes, Source source, int64_t t_queued, int64_t t_started);
  void started(uint64_t seq, int64_t t = 0);
  void finished(uint64_t seq, int64_t t = 0);
  void failed(uint64_t seq, const std::string& error, int64_t t = 0);
  void set_algo(uint64_t seq, const char* algo);
  void set_dev_seq(uint64_t seq, uint64_t dev_seq);
  const char* intern(const std::string& s);  // a stable copy

  // What the transport is doing now (e.g. which peer it waits for), as a JSON object or "".
  void set_probe(std::function<std::string()> probe);
  // Resolves CUDA calls' states in dumps (null: none). Cleared before the ring closes.
  void set_device_probe(DeviceProbe probe);
  // Where dumps go and what they say about their rank: header is a JSON object's members
  // ("\"rank\": 0, ...") written at the top of each dump.
  void configure(const std::string& dir, const std::string& file, const std::string& header);
  // The JSON text of a dump.
  std::string json();
  // Writes json() to path ("" : the configured dir/file); returns the path written, "" on failure
  // (why in *error). Atomic: a temp file renamed.
  std::string dump(const std::string& path = "", std::string* error = nullptr);
  // dump() once per recorder, for the first failure; later calls return the first path.
  std::string dump_on_failure();
  // Call seq (not 0) failed with what: marks it failed, writes the failure's dump (once) and
  // returns what naming the dump (what itself when none could be written; a dump an inner
  // communicator's error named is replaced). The one failure wrapper: rethrow_failed's and
  // Python's (ringreduce/_lifecycle.py: Communicator._traced).
  std::string fail_and_dump(uint64_t seq, const std::string& what);
  // Called in a catch block of call seq (0: not recorded): marks it failed and rethrows it; a
  // RingError then also names the dump that its failure wrote. Every transport's calls end here.
  [[noreturn]] void rethrow_failed(uint64_t seq);

  // Every recorder of this process (for the signal dump).
  static std::vector<std::shared_ptr<Recorder>> all();
  static void add(const std::shared_ptr<Recorder>& r);

 private:
  struct Slot {
    std::atomic<uint64_t> ver{0};  // odd while written (readers retry)
    Entry e;
  };
  Slot* find(uint64_t seq);
  template <class F>
  void update(uint64_t seq, F f);

  size_t cap_;
  std::unique_ptr<Slot[]> slots_;
  std::atomic<uint64_t> next_{0};
  std::mutex mu_;  // below: rare paths only
  std::map<uint64_t, std::string> errors_;
  std::deque<std::string> strings_;
  std::mutex probe_mu_;  // held while the probe runs: set_probe(nullptr) waits for it
  std::mutex dump_mu_;   // one dump() at a time (a failure, a signal, the user)
  std::mutex failure_mu_;
  std::function<std::string()> probe_;
  DeviceProbe device_probe_;
  std::string dir_, file_, header_;
  bool failure_dumped_ = false;
  std::string failure_path_;
};

// RINGREDUCE_TRACE_SIGNAL: on SIGUSR1 a thread of ours writes every live recorder's dump (the
// handler only wakes it, so the dump works wherever the main thread is stuck). Idempotent.
// Chains to the handler that was installed before. Returns false (why in *error) on failure.
bool install_dump_signal(int signo, std::string* error);

}  // namespace ringreduce::runtime
