// Imported memory of the p2p transport (Algo::Imported, layout.h): an ordinary tensor's allocation
// shared with the peers once, by its IPC handle on the group's board, mapped by each peer the
// first time it predicts a call on it. Freeing memory a peer still maps is undefined in CUDA, so
// this rank keeps a hold on every tensor it exported (Hold: the binding's keeps the
// storage, and so torch's block and segment, allocated) until no tensor uses it, the export is
// withdrawn, and every peer's reaper closed its mapping; only then does the reaper drop the hold
// (and torch may free). Nothing on torch's free path waits for another process. Correctness
// never rests on a prediction: the start barrier compares every rank's tags, and a wrong guess
// only sends the call through the workspace. Torch-free.
#include <chrono>
#include <cstring>
#include <thread>

#include "cuda/host.h"
#include "cuda/p2p/imports.h"
#include "runtime/shm_map.h"

namespace ringreduce::cuda::p2p {
namespace {

uint64_t load_acquire(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
void store_release(uint64_t* p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

// The reaper's period: memory a tensor let go of returns to its allocator about two of these later.
constexpr auto kReapPeriod = std::chrono::milliseconds(2);
// Done with every owner: set by a rank that closed (nothing of anyone's is mapped there any more).
constexpr uint64_t kReapedAll = ~uint64_t{0};

// The driver's cuMemGetAddressRange (CUdeviceptr is 64 bits here).
using AddressRange = int (*)(uint64_t* base, size_t* bytes, uint64_t p);
AddressRange address_range() {
  static const AddressRange fn = [] {
    void* p = nullptr;
#if CUDART_VERSION >= 12000
    cudaDriverEntryPointQueryResult q{};
#if CUDART_VERSION >= 12050
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &p, 12000, cudaEnableDefault, &q);
#else
    const cudaError_t e = cudaGetDriverEntryPoint("cuMemGetAddressRange", &p, cudaEnableDefault, &q);
#endif
    if (e != cudaSuccess || q != cudaDriverEntryPointSuccess) p = nullptr;
#endif
    cudaGetLastError();
    return reinterpret_cast<AddressRange>(p);
  }();
  return fn;
}

bool driver_finder(const void* p, uintptr_t* base, size_t* bytes, std::string* why) {
  const AddressRange fn = address_range();
  uint64_t b = 0;
  if (!fn || fn(&b, bytes, reinterpret_cast<uint64_t>(p)) != 0) {
    *why = "the driver does not know the allocation (cuMemGetAddressRange)";
    return false;
  }
  *base = static_cast<uintptr_t>(b);
  return true;
}

}  // namespace

void Imports::attach(const std::string& name, bool create) {
  if (attached()) throw RingError("ringreduce: board_attach: the board is attached already");
  uint64_t bytes = sizeof(RegBoard);
  char* p = create ? runtime::shm_create(name, bytes) : runtime::shm_map(name, &bytes);
  if (create) std::memset(p, 0, sizeof(RegBoard));
  {
    std::lock_guard<std::mutex> lk(mu_);
    board_ = reinterpret_cast<RegBoard*>(p);
  }
  attached_.store(true, std::memory_order_release);
  reaper_ = std::make_unique<runtime::Ticker>(kReapPeriod, [this] { reap(); });
}

void Imports::set_holder(Holder h) {
  std::lock_guard<std::mutex> lk(mu_);
  holder_ = std::move(h);
}

uint64_t Imports::seen() const {
  std::lock_guard<std::mutex> lk(mu_);
  return seen_;
}

uint64_t Imports::in_place() const {
  std::lock_guard<std::mutex> lk(mu_);
  return in_place_;
}

size_t Imports::mapped() const {
  std::lock_guard<std::mutex> lk(mu_);
  return mappings_.size();
}

size_t Imports::holds() const {
  std::lock_guard<std::mutex> lk(mu_);
  size_t n = 0;
  for (const auto& [base, e] : exports_) n += e.holds.size();
  for (const Retiring& t : retiring_) n += t.holds.size();
  return n;
}

std::string Imports::note() const {
  std::lock_guard<std::mutex> lk(mu_);
  return note_;
}

std::string Imports::take_note() {
  std::lock_guard<std::mutex> lk(mu_);
  if (note_taken_ || note_.empty()) return {};
  note_taken_ = true;
  return note_;
}

void Imports::stop() {
  if (reaper_) reaper_->stop();
}

// The peer's allocation `id` mapped here (opened now if new), or null: withdrawn, too short for
// `end` bytes, or its open failed before (remembered: not retried on every call). Under mu_,
// which the reaper takes too: an entry withdrawn while this opens it is seen by the check after
// the open, or by the reaper's next scan.
char* Imports::map_locked(int q, uint64_t id, uint64_t end) {
  auto it = mappings_.find({q, id});
  if (it != mappings_.end()) return end <= it->second.bytes ? it->second.p : nullptr;
  if (unmappable_.count({q, id})) return nullptr;
  BoardEntry* e = &board_->exp[q][id % kBoardSlots];
  if (load_acquire(&e->id) != id) return nullptr;
  const uint64_t bytes = e->bytes;
  cudaIpcMemHandle_t h;
  std::memcpy(&h, e->handle, sizeof h);
  if (load_acquire(&e->id) != id || end > bytes) return nullptr;
  DeviceScope scope(device_);
  RelaxedCapture relaxed;  // not the stream's work: allowed beside another thread's capture
  void* p = nullptr;
  if (cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess) != cudaSuccess) {
    cudaGetLastError();
    unmappable_.insert({q, id});
    say_locked("rank " + std::to_string(rank_) + ": rank " + std::to_string(q) +
               "'s memory could not be mapped here (cudaIpcOpenMemHandle); such calls go through the workspace");
    return nullptr;
  }
  if (load_acquire(&e->id) != id) {  // withdrawn meanwhile: its owner may free it
    cudaIpcCloseMemHandle(p);
    return nullptr;
  }
  mappings_[{q, id}] = Mapping{static_cast<char*>(p), bytes};
  return static_cast<char*>(p);
}

void Imports::learn(const HostCtl* ctl, uint64_t op_seq) {
  std::lock_guard<std::mutex> lk(mu_);
  if (ctl) learn_locked(ctl, op_seq);
}

void Imports::learn_locked(const HostCtl* ctl, uint64_t op_seq) {
  // What the device saw of earlier Imported calls; a slot overwritten since (more than kSeenSlots
  // calls back) or never written (a call that stopped) is dropped.
  for (auto it = to_learn_.begin(); it != to_learn_.end();) {
    const uint64_t seq = *it;
    const volatile HostCtl::Seen* s = &ctl->seen[seq % kSeenSlots];
    if (op_seq - seq >= kSeenSlots) {
      it = to_learn_.erase(it);
      continue;
    }
    if (s->seq != seq) {
      ++it;
      continue;
    }
    std::atomic_thread_fence(std::memory_order_acquire);
    std::vector<uint64_t> tags(nranks_);
    for (int q = 0; q < nranks_; ++q) tags[q] = s->tags[q];
    const bool in_place = s->in_place != 0;
    std::atomic_thread_fence(std::memory_order_acquire);
    if (s->seq != seq) {  // overwritten while read
      it = to_learn_.erase(it);
      continue;
    }
    ++seen_;
    in_place_ += in_place;
    if (tags[rank_]) predict_[tags[rank_]] = std::move(tags);
    it = to_learn_.erase(it);
  }
}

// The tag of [p, p + bytes) in an export of this rank, which then keeps *hold (unless it holds that
// owner already: *hold stays the caller's, to drop outside the lock); 0 if no export holds it.
uint64_t Imports::tag_locked(uintptr_t p, uint64_t bytes, std::unique_ptr<Hold>* hold) {
  auto it = exports_.upper_bound(p);
  if (it == exports_.begin() || p + bytes > (--it)->first + it->second.bytes) return 0;
  auto& holds = it->second.holds;
  if (!holds.count((*hold)->key())) holds.emplace((*hold)->key(), std::move(*hold));
  return it->second.id << kTagShift | (p - it->first);
}

// Closes the mappings (IPC calls: outside mu_).
void Imports::close_all(const std::vector<char*>& to_close) {
  if (to_close.empty()) return;
  DeviceScope scope(device_);
  RelaxedCapture relaxed;  // beside a capture on another thread (torch.cuda.graph: global mode)
  for (char* p : to_close) cudaIpcCloseMemHandle(p);
  cudaGetLastError();
}

// Call c's tag: its allocation's export (made now at first sight) and offset, with `hold` kept
// for the export; 0 where the memory cannot be shared (note_ says why).
uint64_t Imports::export_of(const Call& c, std::unique_ptr<Hold> hold) {
  const uintptr_t p = reinterpret_cast<uintptr_t>(c.in);
  const uint64_t bytes = static_cast<uint64_t>(c.numel) * dtype_size(c.dtype);
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (const uint64_t tag = tag_locked(p, bytes, &hold)) return tag;  // a spare hold goes after the lock
  }
  // First sight of this allocation: share it (the driver's and IPC calls outside the lock).
  uintptr_t base = 0;
  size_t size = 0;
  std::string why;
  bool ok = driver_finder(c.in, &base, &size, &why);
  cudaIpcMemHandle_t h;
  if (ok && (p < base || p + bytes > base + size)) {
    ok = false;
    why = "the tensor does not lie inside the allocation found for it";
  }
  if (ok) {
    DeviceScope scope(device_);
    RelaxedCapture relaxed;  // another thread may be capturing (this one is not: see prepare)
    if (cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(base)) != cudaSuccess) {
      cudaGetLastError();
      ok = false;
      why = "its allocation has no CUDA IPC handle (not from cudaMalloc: expandable segments or "
            "another allocator)";
    }
  }
  std::lock_guard<std::mutex> lk(mu_);
  if (ok && (size >> kTagShift) != 0) {
    ok = false;
    why = "its allocation is larger than 1 TiB";
  }
  const uint64_t id = next_export_;
  if (ok && load_acquire(&board_->exp[rank_][id % kBoardSlots].id) != 0) {
    ok = false;
    why = "more than " + std::to_string(kBoardSlots) + " of its allocations are shared already";
  }
  if (!ok) {
    say_locked("rank " + std::to_string(rank_) + ": a tensor's memory cannot be shared with the peers, so "
               "its all_reduce copies it through the workspace: " + why);
    return 0;
  }
  ++next_export_;
  BoardEntry* e = &board_->exp[rank_][id % kBoardSlots];
  e->bytes = size;
  std::memcpy(e->handle, &h, sizeof h);
  store_release(&e->id, id);
  Export& x = exports_[base];
  x.id = id;
  x.bytes = size;
  const void* key = hold->key();
  x.holds.emplace(key, std::move(hold));
  return id << kTagShift | (p - base);
}

ImportedCall Imports::prepare(const Call& c, bool capturing, const HostCtl* ctl, uint64_t op_seq) {
  ImportedCall out;
  const int n = nranks_, r = rank_;
  const uint64_t bytes = static_cast<uint64_t>(c.numel) * dtype_size(c.dtype);
  // The hold first (the binding's takes a reference to the tensor's storage: no lock of ours).
  Holder holder;
  {
    std::lock_guard<std::mutex> lk(mu_);
    holder = holder_;
  }
  std::string why = "this communicator has no way to keep its memory allocated (no holder)";
  std::unique_ptr<Hold> hold = holder ? holder(c, &why) : nullptr;
  uint64_t tag = 0;
  if (hold) {
    if (capturing) {  // mapped before only: a capture shares nothing new
      std::lock_guard<std::mutex> lk(mu_);
      tag = tag_locked(reinterpret_cast<uintptr_t>(c.in), bytes, &hold);
    } else {
      tag = export_of(c, std::move(hold));
    }
  } else {
    std::lock_guard<std::mutex> lk(mu_);
    say_locked("rank " + std::to_string(r) + ": a tensor's memory cannot be shared with the peers, so "
               "its all_reduce copies it through the workspace: " + why);
  }
  std::lock_guard<std::mutex> lk(mu_);
  learn_locked(ctl, op_seq);
  to_learn_.push_back(op_seq + 1);  // the endpoint counts the call after this
  out.tag = tag;
  out.at[r] = static_cast<char*>(const_cast<void*>(c.in));
  if (!tag) return out;  // no prediction: the call goes through the workspace on every rank
  auto it = predict_.find(tag);
  if (it == predict_.end()) return out;
  const std::vector<uint64_t>& tags = it->second;
  const uint64_t mask = (uint64_t{1} << kTagShift) - 1;
  for (int q = 0; q < n; ++q) {
    if (q == r) continue;
    const uint64_t id = tags[q] >> kTagShift, off = tags[q] & mask;
    char* m = nullptr;
    if (id && capturing) {  // mapped before only
      auto at = mappings_.find({q, id});
      if (at != mappings_.end() && off + bytes <= at->second.bytes) m = at->second.p;
    } else if (id) {
      m = map_locked(q, id, off + bytes);
    }
    if (!m) return out;
    out.at[q] = m + off;
  }
  out.hash = tags_hash(tags.data(), n);
  return out;
}

// Every kReapPeriod, on the reaper's thread: (1) this rank's exports that no tensor uses any more
// are withdrawn (a peer maps nothing new of them, and its reaper closes what it mapped); (2) the
// peers' withdrawals are closed here and reported; (3) the holds of withdrawals every peer
// reported are dropped. CUDA calls and drops (which may free torch's memory) outside mu_, so a
// call on another thread waits for nothing but a few map operations.
void Imports::reap() {
  const int r = rank_, n = nranks_;
  std::vector<char*> to_close;
  std::vector<std::pair<int, uint64_t>> seen;  // (peer, kills) to report once closed
  std::vector<std::unique_ptr<Hold>> to_drop;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!board_) return;
    // (1) A hold nobody else refers to goes now if the export keeps another in use, else the
    // export is withdrawn with its holds (some hold stays while a peer may map the allocation).
    bool withdrew = false;
    for (auto it = exports_.begin(); it != exports_.end();) {
      auto& holds = it->second.holds;
      bool any = false;
      for (const auto& [key, h] : holds) any = any || h->in_use();
      if (any) {
        for (auto h = holds.begin(); h != holds.end();)
          if (h->second->in_use()) ++h;
          else to_drop.push_back(std::move(h->second)), h = holds.erase(h);
        ++it;
        continue;
      }
      const uint64_t id = it->second.id;
      store_release(&board_->exp[r][id % kBoardSlots].id, 0);
      for (auto p = predict_.begin(); p != predict_.end();)
        p = (p->first >> kTagShift) == id ? predict_.erase(p) : std::next(p);
      Retiring t{0, {}};
      for (auto& [key, h] : holds) t.holds.push_back(std::move(h));
      retiring_.push_back(std::move(t));
      it = exports_.erase(it);
      withdrew = true;
    }
    if (withdrew) {
      const uint64_t k = __atomic_add_fetch(&board_->kills[r], 1, __ATOMIC_ACQ_REL);
      for (Retiring& t : retiring_)
        if (!t.kills) t.kills = k;
    }
    // (2) What the peers withdrew, unless a CUDA graph pins this ring (its captured launches may
    // read those mappings): then nothing is closed or reported, and the owner keeps its memory.
    if (pins_->load() == 0)
      for (int q = 0; q < n; ++q) {
        if (q == r) continue;
        const uint64_t k = load_acquire(&board_->kills[q]);
        if (k == kills_seen_[q]) continue;
        for (auto it = mappings_.begin(); it != mappings_.end();) {
          const auto [owner, id] = it->first;
          if (owner == q && load_acquire(&board_->exp[q][id % kBoardSlots].id) != id) {
            to_close.push_back(it->second.p);
            it = mappings_.erase(it);
          } else {
            ++it;
          }
        }
        for (auto it = unmappable_.begin(); it != unmappable_.end();)
          it = it->first == q && load_acquire(&board_->exp[q][it->second % kBoardSlots].id) != it->second
                   ? unmappable_.erase(it) : std::next(it);
        kills_seen_[q] = k;
        seen.emplace_back(q, k);
      }
    // (3) Withdrawals every peer has closed (a closed peer reports kReapedAll).
    while (!retiring_.empty()) {
      const uint64_t k = retiring_.front().kills;
      bool done = true;
      for (int q = 0; q < n && done; ++q) done = q == r || load_acquire(&board_->reaped[q][r]) >= k;
      if (!done) break;
      for (auto& h : retiring_.front().holds) to_drop.push_back(std::move(h));
      retiring_.pop_front();
    }
  }
  close_all(to_close);
  for (const auto& [q, k] : seen) store_release(&board_->reaped[r][q], k);
  to_drop.clear();  // may free the memory (torch's allocator): no lock of ours held
}

void Imports::close_mappings() {
  std::vector<char*> to_close;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& [key, m] : mappings_) to_close.push_back(m.p);
    mappings_.clear();
  }
  close_all(to_close);
  std::lock_guard<std::mutex> lk(mu_);
  if (board_)
    for (int q = 0; q < nranks_; ++q) store_release(&board_->reaped[rank_][q], kReapedAll);
}

void Imports::release(bool peers_done) {
  std::vector<std::unique_ptr<Hold>> all;
  RegBoard* board = nullptr;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& [base, e] : exports_) {
      if (board_) store_release(&board_->exp[rank_][e.id % kBoardSlots].id, 0);
      for (auto& [key, h] : e.holds) all.push_back(std::move(h));
    }
    exports_.clear();
    for (Retiring& t : retiring_)
      for (auto& h : t.holds) all.push_back(std::move(h));
    retiring_.clear();
    predict_.clear();
    board = board_;
    board_ = nullptr;
  }
  attached_.store(false, std::memory_order_release);
  if (board) runtime::shm_unmap(reinterpret_cast<char*>(board), sizeof(RegBoard));
  // Dropped: torch may free the memory now (its free path calls nothing of ours). Kept until exit
  // where a peer may still map it.
  if (!peers_done)
    for (auto& h : all) (void)h.release();
  all.clear();
}

}  // namespace ringreduce::cuda::p2p
