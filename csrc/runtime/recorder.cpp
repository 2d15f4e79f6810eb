#include "runtime/recorder.h"

#include "ring/call.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <algorithm>
#include <cstring>
#include <thread>
#include <utility>

namespace ringreduce::runtime {

namespace {
const char* const kSources[] = {"api", "backend", "ddp_hook", "bucketer", "op", "nn"};
const char* const kStates[] = {"queued", "started", "finished", "failed"};
const char* const kDevice[] = {"unknown", "pending", "done", "failed"};

// A JSON string. Bytes >= 0x80 are escaped one by one (as Latin-1): the text stays valid JSON
// whatever encoding an error message came in.
void escape(std::string& out, const char* s) {
  out += '"';
  for (; *s; ++s) {
    const unsigned char c = static_cast<unsigned char>(*s);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20 || c >= 0x80) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  out += '"';
}

// Numbers without printf's %f, which follows the C locale (a "," decimal point is not JSON).
void add_int(std::string& out, long long v) { out += std::to_string(v); }
void add_us(std::string& out, int64_t ns) {  // ns as microseconds with 3 decimals
  if (ns < 0) {
    out += '-';
    ns = -ns;
  }
  char frac[8];
  std::snprintf(frac, sizeof frac, "%03d", static_cast<int>(ns % 1000));
  out += std::to_string(ns / 1000);
  out += '.';
  out += frac;
}
void add_field(std::string& out, const char* key, const char* value) {
  out += ", \"";
  out += key;
  out += "\": ";
  escape(out, value);
}

int64_t wall_us_offset_ns() {  // wall clock minus steady clock, now
  const auto w = std::chrono::system_clock::now().time_since_epoch();
  const int64_t s = now_ns();
  return std::chrono::duration_cast<std::chrono::nanoseconds>(w).count() - s;
}

bool mkdirs(const std::string& dir) {
  std::string path;
  size_t pos = 0;
  while (pos != std::string::npos) {
    pos = dir.find('/', pos + 1);
    path = dir.substr(0, pos);
    if (!path.empty() && mkdir(path.c_str(), 0777) != 0 && errno != EEXIST) return false;
  }
  return true;
}

std::mutex& registry_mu() {
  static auto* mu = new std::mutex();  // never destroyed: the signal thread may outlive statics
  return *mu;
}
std::vector<std::weak_ptr<Recorder>>& registry() {
  static auto* r = new std::vector<std::weak_ptr<Recorder>>();
  return *r;
}
}  // namespace

const char* source_name(Source s) {
  const auto i = static_cast<size_t>(s);
  return i < static_cast<size_t>(Source::Count) ? kSources[i] : "unknown";
}

bool parse_source(const std::string& name, Source& out) {
  for (size_t i = 0; i < static_cast<size_t>(Source::Count); ++i)
    if (name == kSources[i]) {
      out = static_cast<Source>(i);
      return true;
    }
  return false;
}

Source& current_source() {
  thread_local Source s = Source::Api;
  return s;
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

Recorder::Recorder(size_t capacity) : cap_(capacity) {
  if (cap_) slots_.reset(new Slot[cap_]);
}

Recorder::~Recorder() = default;

Recorder::Slot* Recorder::find(uint64_t seq) {
  if (!cap_ || seq == 0) return nullptr;
  Slot* s = &slots_[(seq - 1) % cap_];
  return s->e.seq == seq ? s : nullptr;  // overwritten by a newer call: nothing to update
}

// Seqlock: a slot is written by one thread at a time (calls of a communicator are serialised);
// a dump reading it concurrently retries or skips it.
template <class F>
void Recorder::update(uint64_t seq, F f) {
  Slot* s = find(seq);
  if (!s) return;
  const uint64_t v = s->ver.load(std::memory_order_relaxed);
  s->ver.store(v + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  f(s->e);
  s->ver.store(v + 2, std::memory_order_release);
}

uint64_t Recorder::begin(const char* coll, const char* dtype, const char* op, const char* algo,
                         int64_t numel, uint64_t nbytes, Source source, int64_t t_queued,
                         int64_t t_started) {
  if (!cap_) return 0;
  // One writer at a time (a communicator's calls are serialised: its executor, the GIL): a plain
  // increment, not a locked one.
  const uint64_t seq = next_.load(std::memory_order_relaxed) + 1;
  next_.store(seq, std::memory_order_release);
  Slot& s = slots_[(seq - 1) % cap_];
  const uint64_t v = s.ver.load(std::memory_order_relaxed);
  s.ver.store(v + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  Entry& e = s.e;
  e.seq = seq;
  e.coll = coll;
  e.dtype = dtype;
  e.op = op;
  e.algo = algo;
  e.numel = numel;
  e.nbytes = nbytes;
  e.t_queued = t_queued;
  e.t_started = t_started;
  e.t_ended = 0;
  e.source = source;
  e.state = t_started ? CallState::Started : CallState::Queued;
  e.dev_seq = 0;
  s.ver.store(v + 2, std::memory_order_release);
  return seq;
}

void Recorder::started(uint64_t seq, int64_t t) {
  if (!t) t = now_ns();
  update(seq, [t](Entry& e) {
    e.t_started = t;
    e.state = CallState::Started;
  });
}

void Recorder::finished(uint64_t seq, int64_t t) {
  if (!cap_) return;
  if (!t) t = now_ns();
  update(seq, [t](Entry& e) {
    e.t_ended = t;
    e.state = CallState::Finished;
  });
}

void Recorder::failed(uint64_t seq, const std::string& error, int64_t t) {
  if (!cap_ || seq == 0) return;
  if (!t) t = now_ns();
  update(seq, [t](Entry& e) {
    if (!e.t_started) e.t_started = t;
    e.t_ended = t;
    e.state = CallState::Failed;
  });
  std::lock_guard<std::mutex> lk(mu_);
  errors_[seq] = error;
  while (!errors_.empty() && errors_.begin()->first + cap_ <= seq) errors_.erase(errors_.begin());
}

void Recorder::set_dev_seq(uint64_t seq, uint64_t dev_seq) {
  update(seq, [dev_seq](Entry& e) { e.dev_seq = dev_seq; });
}

void Recorder::set_device_probe(DeviceProbe probe) {
  std::lock_guard<std::mutex> lk(probe_mu_);
  device_probe_ = std::move(probe);
}

void Recorder::set_algo(uint64_t seq, const char* algo) {
  update(seq, [algo](Entry& e) { e.algo = algo; });
}

const char* Recorder::intern(const std::string& s) {
  std::lock_guard<std::mutex> lk(mu_);
  for (const std::string& x : strings_)
    if (x == s) return x.c_str();
  strings_.push_back(s);
  return strings_.back().c_str();
}

void Recorder::set_probe(std::function<std::string()> probe) {
  std::lock_guard<std::mutex> lk(probe_mu_);
  probe_ = std::move(probe);
}

void Recorder::configure(const std::string& dir, const std::string& file, const std::string& header) {
  std::lock_guard<std::mutex> lk(mu_);
  dir_ = dir;
  file_ = file;
  header_ = header;
}

std::string Recorder::json() {
  std::string header, waiting;
  std::map<uint64_t, std::string> errors;
  {
    std::lock_guard<std::mutex> lk(mu_);
    header = header_;
    errors = errors_;
  }
  std::unique_lock<std::mutex> probes(probe_mu_);  // held to the end: close() waits for us
  if (probe_) waiting = probe_();
  const int64_t off = wall_us_offset_ns();
  const uint64_t last = next_.load(std::memory_order_acquire);
  const uint64_t first = last > cap_ ? last - cap_ + 1 : 1;
  std::string out = "{\"version\": 1, ";
  if (!header.empty()) out += header + ", ";
  out += "\"pid\": ";
  add_int(out, getpid());
  out += ", \"time_us\": ";
  add_us(out, now_ns() + off);
  out += ", \"capacity\": ";
  add_int(out, static_cast<long long>(cap_));
  out += ", \"calls\": ";
  add_int(out, static_cast<long long>(last));
  out += ", \"dropped\": ";
  add_int(out, static_cast<long long>(last >= first ? first - 1 : 0));
  out += ", \"waiting\": ";
  out += waiting.empty() ? "null" : waiting;
  out += ", \"entries\": [";
  bool any = false;
  for (uint64_t seq = first; cap_ && seq <= last; ++seq) {
    const Slot& s = slots_[(seq - 1) % cap_];
    Entry e;
    bool ok = false;
    for (int tries = 0; tries < 100 && !ok; ++tries) {
      const uint64_t v1 = s.ver.load(std::memory_order_acquire);
      if (v1 & 1) continue;
      std::memcpy(static_cast<void*>(&e), static_cast<const void*>(&s.e), sizeof e);
      std::atomic_thread_fence(std::memory_order_acquire);
      ok = s.ver.load(std::memory_order_relaxed) == v1;
    }
    if (!ok || e.seq != seq) continue;  // being written, or not yet
    int device = -1;
    std::string device_error;
    if (e.dev_seq && device_probe_ && e.state != CallState::Failed) {
      int64_t done = 0;
      device = device_probe_(e.dev_seq, &done, &device_error) & 3;
      if (device == 2) {  // done on the device: that is when the call ended (0: no longer known)
        e.state = CallState::Finished;
        e.t_ended = done ? std::max(done, e.t_started) : 0;
      } else if (device == 3) {
        e.state = CallState::Failed;
        e.t_ended = 0;  // when the device failed it is not known
      } else if (device == 1) {
        e.state = CallState::Started;
        e.t_ended = 0;
      }
    }
    out += any ? ",\n  {\"seq\": " : "\n  {\"seq\": ";
    any = true;
    add_int(out, static_cast<long long>(e.seq));
    add_field(out, "coll", e.coll);
    out += ", \"numel\": ";
    add_int(out, static_cast<long long>(e.numel));
    add_field(out, "dtype", e.dtype);
    add_field(out, "op", e.op);
    add_field(out, "algo", e.algo);
    out += ", \"bytes\": ";
    add_int(out, static_cast<long long>(e.nbytes));
    add_field(out, "source", source_name(e.source));
    add_field(out, "state", kStates[static_cast<int>(e.state) & 3]);
    const std::pair<const char*, int64_t> times[] = {
        {"queued_us", e.t_queued}, {"started_us", e.t_started}, {"ended_us", e.t_ended}};
    for (const auto& [key, t] : times) {
      out += ", \"";
      out += key;
      out += "\": ";
      if (t)
        add_us(out, t + off);
      else
        out += "0";
    }
    if (e.dev_seq) {
      out += ", \"dev_seq\": ";
      add_int(out, static_cast<long long>(e.dev_seq));
      add_field(out, "device", device < 0 ? "unknown" : kDevice[device]);
    }
    auto err = errors.find(seq);
    if (err != errors.end() || !device_error.empty())
      add_field(out, "error", err != errors.end() ? err->second.c_str() : device_error.c_str());
    out += "}";
  }
  out += any ? "\n]}\n" : "]}\n";
  return out;
}

std::string Recorder::dump(const std::string& path_in, std::string* error) {
  std::lock_guard<std::mutex> one_at_a_time(dump_mu_);
  std::string path = path_in;
  if (path.empty()) {
    std::lock_guard<std::mutex> lk(mu_);
    if (dir_.empty() || file_.empty()) {
      if (error) *error = "no trace directory configured";
      return "";
    }
    path = dir_ + "/" + file_;
  }
  const auto slash = path.rfind('/');
  if (slash != std::string::npos && slash > 0 && !mkdirs(path.substr(0, slash))) {
    if (error) *error = "cannot create " + path.substr(0, slash) + ": " + std::strerror(errno);
    return "";
  }
  const std::string text = json();
  static std::atomic<uint64_t> tmp_count{0};
  const std::string tmp = path + ".tmp" + std::to_string(getpid()) + "-" +
                          std::to_string(tmp_count.fetch_add(1));
  FILE* f = std::fopen(tmp.c_str(), "w");
  if (!f) {
    if (error) *error = "cannot write " + tmp + ": " + std::strerror(errno);
    return "";
  }
  const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  if (std::fclose(f) != 0 || !ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    if (error) *error = "cannot write " + path + ": " + std::strerror(errno);
    std::remove(tmp.c_str());
    return "";
  }
  return path;
}

std::string Recorder::fail_and_dump(uint64_t seq, const std::string& what) {
  failed(seq, what);
  const std::string path = dump_on_failure();
  if (path.empty()) return what;
  static const std::string kNamed = "\nflight recorder: ";
  return what.substr(0, what.find(kNamed)) + kNamed + path + " (every rank's: python -m ringreduce.trace " +
         path.substr(0, path.rfind('/')) + ")";
}

void Recorder::rethrow_failed(uint64_t seq) {
  try {
    throw;
  } catch (const RingError& e) {
    if (!seq) throw;
    const std::string text = fail_and_dump(seq, e.what());
    if (text == e.what()) throw;
    throw RingError(text);
  } catch (const std::exception& e) {
    if (seq) failed(seq, e.what());
    throw;
  }
}

std::string Recorder::dump_on_failure() {
  std::lock_guard<std::mutex> once(failure_mu_);  // a second caller waits for the first's path
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (failure_dumped_ || dir_.empty()) return failure_path_;
  }
  std::string path = dump();
  std::lock_guard<std::mutex> lk(mu_);
  failure_dumped_ = true;
  failure_path_ = path;
  return path;
}

void Recorder::add(const std::shared_ptr<Recorder>& r) {
  std::lock_guard<std::mutex> lk(registry_mu());
  auto& reg = registry();
  std::vector<std::weak_ptr<Recorder>> live;
  for (auto& w : reg)
    if (!w.expired()) live.push_back(w);
  live.push_back(r);
  reg.swap(live);
}

std::vector<std::shared_ptr<Recorder>> Recorder::all() {
  std::lock_guard<std::mutex> lk(registry_mu());
  std::vector<std::shared_ptr<Recorder>> out;
  for (auto& w : registry())
    if (auto r = w.lock()) out.push_back(r);
  return out;
}

// -- the signal dump --------------------------------------------------------------------------------

namespace {
int g_pipe[2] = {-1, -1};
struct sigaction g_previous;

void on_signal(int signo, siginfo_t* info, void* ctx) {
  const int saved = errno;
  const char c = 1;
  if (g_pipe[1] >= 0) (void)!write(g_pipe[1], &c, 1);
  errno = saved;
  // Chain: a handler installed before ours (SIG_DFL for SIGUSR1 would end the process: skip it).
  if (g_previous.sa_flags & SA_SIGINFO) {
    if (g_previous.sa_sigaction) g_previous.sa_sigaction(signo, info, ctx);
  } else if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN &&
             g_previous.sa_handler != nullptr) {
    g_previous.sa_handler(signo);
  }
}

void dump_loop() {
  char c;
  for (;;) {
    const ssize_t n = read(g_pipe[0], &c, 1);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    for (auto& r : Recorder::all()) {
      std::string error;
      const std::string path = r->dump("", &error);
      if (path.empty())
        std::fprintf(stderr, "ringreduce: trace dump failed: %s\n", error.c_str());
      else
        std::fprintf(stderr, "ringreduce[%d]: flight recorder written to %s\n",
                     static_cast<int>(getpid()), path.c_str());
    }
  }
}
}  // namespace

bool install_dump_signal(int signo, std::string* error) {
  static std::mutex mu;
  static bool installed = false;
  std::lock_guard<std::mutex> lk(mu);
  if (installed) return true;
  if (pipe2(g_pipe, O_CLOEXEC) != 0 || fcntl(g_pipe[1], F_SETFL, O_NONBLOCK) != 0) {
    if (error) *error = std::string("pipe: ") + std::strerror(errno);
    return false;
  }
  struct sigaction sa {};
  sa.sa_sigaction = on_signal;
  sa.sa_flags = SA_SIGINFO | SA_RESTART;
  sigemptyset(&sa.sa_mask);
  if (sigaction(signo, &sa, &g_previous) != 0) {
    if (error) *error = std::string("sigaction: ") + std::strerror(errno);
    return false;
  }
  std::thread(dump_loop).detach();
  installed = true;
  return true;
}

}  // namespace ringreduce::runtime
