// Runs one communicator's calls one at a time, in the order they were made. Torch-free.
//
// A call runs on the calling thread when nothing is queued or running (a synchronous call: no
// hand-off), else on the executor's worker. A thread that waits for a queued call runs the calls
// ahead of it, and then the call itself, when the worker has not picked them up yet: an async call
// followed at once by its wait() costs what a synchronous call does (no hand-off to another thread
// and back, which on a busy machine costs tens of microseconds), while a call nobody waits for
// (DDP's buckets during backward) runs on the worker, overlapping the caller. The worker leaves a
// call queued for a short grace period after it was made (kGrace) so that the usual
// `work = call(async_op=True); work.wait()` finds it still queued.
#pragma once
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "ring/call.h"  // RingError

namespace ringreduce::runtime {

// Owned by a shared_ptr (as communicators own theirs), the worker holds a reference while it runs a
// call: a done() callback may drop the last owner (Python code in a future's callback can free the
// communicator). The executor then dies on its own worker after the call, detaching it.
class Executor : public std::enable_shared_from_this<Executor> {
 public:
  // Whether a wait was asked to stop (Ctrl-C on the main thread): polled every 50 ms.
  using Interrupted = std::function<bool()>;
  // The call itself: throws on failure. interrupted (may be null) is for the call's own waits.
  using Body = std::function<void(const Interrupted* interrupted)>;
  // Called once, on the thread that ran the call: "" on success, else the error's message.
  using Done = std::function<void(const std::string& error)>;

  struct Job {
    Body body;
    Done done;
    std::chrono::steady_clock::time_point made;
    bool finished = false;  // guarded by the executor's mutex
  };
  // How long the worker leaves a new call for a waiter to run. Python's return from the call and
  // its wait() take ~5-20 us on a loaded 2-core machine; a DDP bucket's all-reduce takes ms.
  static constexpr std::chrono::microseconds kGrace{100};
  // After a call was made the worker polls the queue every kPoll for kDoze instead of sleeping
  // until woken: a call made meanwhile needs no wake-up (a system call, and on a loaded machine a
  // context switch onto a core the ranks use) when its waiter runs it; one nobody waits for starts
  // within kPoll.
  static constexpr std::chrono::microseconds kPoll{1000};
  static constexpr std::chrono::milliseconds kDoze{100};
  using JobPtr = std::shared_ptr<Job>;

  Executor() = default;
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;
  ~Executor() {
    stop();
    if (worker_.joinable()) worker_.detach();  // dying on the worker itself: nothing touches *this after
  }

  // Claims the executor for one inline call if it is idle (nothing queued or running): true, and
  // the caller must call release() after running it. Never blocks.
  bool try_claim() {
    std::lock_guard<std::mutex> lk(mu_);
    if (busy_locked() || stopped_) return false;
    running_ = true;
    return true;
  }
  void release() {
    std::lock_guard<std::mutex> lk(mu_);
    running_ = false;
    cv_.notify_all();
    if (!queue_.empty()) wcv_.notify_one();
  }

  // A synchronous call: runs body on this thread after every call made before it (running the
  // queued ones itself when the worker has not taken them). Throws body's exception. Returns false
  // without running body if interrupted while waiting for its turn.
  bool run(const Body& body, const Interrupted* interrupted) {
    if (!wait_turn(interrupted)) return false;
    struct Release {
      Executor* e;
      ~Release() { e->release(); }
    } r{this};
    body(interrupted);
    return true;
  }

  // An asynchronous call: queued; the worker (started on first use) or a waiter runs it.
  // After stop(), done() is called at once with an error.
  JobPtr submit(Body body, Done done) {
    auto job = std::make_shared<Job>();
    job->body = std::move(body);
    job->done = std::move(done);
    job->made = std::chrono::steady_clock::now();
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!stopped_) {
        last_made_ = job->made;
        queue_.push_back(job);
        if (!worker_.joinable())
          worker_ = std::thread([this] { work_loop(); });
        if (worker_asleep_) wcv_.notify_one();
        return job;
      }
    }
    finish(job, kClosedMessage);
    return job;
  }

  // Waits until job has finished, running it (and the queued calls ahead of it) on this thread when
  // the worker has not started them. False if interrupted first.
  bool wait(const JobPtr& job, const Interrupted* interrupted) {
    std::unique_lock<std::mutex> lk(mu_);
    while (!job->finished) {
      if (!running_ && !queue_.empty()) {
        JobPtr next = take_locked();
        lk.unlock();
        execute(next, interrupted);
        lk.lock();
        continue;
      }
      if (wait_slice(lk, interrupted)) return false;
    }
    return true;
  }

  // Waits until everything submitted so far has finished (helping as wait() does).
  bool synchronize(const Interrupted* interrupted) {
    std::unique_lock<std::mutex> lk(mu_);
    while (busy_locked()) {
      if (!running_ && !queue_.empty()) {
        JobPtr next = take_locked();
        lk.unlock();
        execute(next, interrupted);
        lk.lock();
        continue;
      }
      if (wait_slice(lk, interrupted)) return false;
    }
    return true;
  }

  // Calls queued or running.
  int inflight() {
    std::lock_guard<std::mutex> lk(mu_);
    return static_cast<int>(queue_.size()) + (running_ ? 1 : 0);
  }

  // Refuses new calls, lets the worker finish the queued ones, and joins it. Idempotent.
  void stop() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stopped_ = true;
      cv_.notify_all();
      wcv_.notify_all();
    }
    if (worker_.joinable() && worker_.get_id() != std::this_thread::get_id()) worker_.join();
    // Jobs a waiter left queued (interrupted) with no worker to run them: fail them.
    std::deque<JobPtr> left;
    {
      std::lock_guard<std::mutex> lk(mu_);
      left.swap(queue_);
    }
    for (auto& j : left) finish(j, kClosedMessage);
  }

 private:
  bool busy_locked() const { return running_ || !queue_.empty(); }

  JobPtr take_locked() {
    JobPtr j = queue_.front();
    queue_.pop_front();
    running_ = true;
    return j;
  }

  // One wait on the condition: true if interrupted.
  bool wait_slice(std::unique_lock<std::mutex>& lk, const Interrupted* interrupted) {
    if (interrupted == nullptr) {
      cv_.wait(lk);
      return false;
    }
    cv_.wait_for(lk, std::chrono::milliseconds(50));
    lk.unlock();
    const bool stop = (*interrupted)();
    lk.lock();
    return stop;
  }

  // Waits until the executor is idle and claims it for this thread. False if interrupted.
  bool wait_turn(const Interrupted* interrupted) {
    std::unique_lock<std::mutex> lk(mu_);
    while (busy_locked() || stopped_) {
      if (stopped_) throw closed_error();
      if (!running_ && !queue_.empty()) {
        JobPtr next = take_locked();
        lk.unlock();
        execute(next, interrupted);
        lk.lock();
        continue;
      }
      if (wait_slice(lk, interrupted)) return false;
    }
    running_ = true;
    return true;
  }

  // Runs a taken job (running_ is set) and marks the executor free again.
  void execute(const JobPtr& job, const Interrupted* interrupted) {
    std::string error;
    try {
      job->body(interrupted);
    } catch (const std::exception& e) {
      error = e.what();
      if (error.empty()) error = "ringreduce: call failed";
    } catch (...) {
      error = "ringreduce: call failed (unknown exception)";
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      running_ = false;
      if (!queue_.empty()) wcv_.notify_one();  // the next call, if this thread does not take it
    }
    finish(job, error);
  }

  void finish(const JobPtr& job, const std::string& error) {
    Done done;
    {
      std::lock_guard<std::mutex> lk(mu_);
      done = std::move(job->done);
      job->body = nullptr;
    }
    // done() before finished: a waiter returns only once the call's Work is complete.
    if (done) done(error);
    std::lock_guard<std::mutex> lk(mu_);
    job->finished = true;
    cv_.notify_all();
  }

  void work_loop() {
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      if (!running_ && !queue_.empty()) {
        const auto due = queue_.front()->made + kGrace;
        if (!stopped_ && std::chrono::steady_clock::now() < due) {
          wcv_.wait_until(lk, due);  // a waiter may take it meanwhile
          continue;
        }
        JobPtr next = take_locked();
        lk.unlock();
        std::shared_ptr<Executor> keep = weak_from_this().lock();  // null if not shared-owned
        const std::weak_ptr<Executor> self = keep;
        execute(next, nullptr);
        if (keep) {
          keep.reset();  // the last reference if done() dropped the owners: ~Executor runs here
          if (self.expired()) return;  // *this is gone
        }
        lk.lock();
        continue;
      }
      if (stopped_ && queue_.empty()) return;
      if (std::chrono::steady_clock::now() - last_made_ < kDoze) {
        wcv_.wait_for(lk, kPoll);
        continue;
      }
      worker_asleep_ = true;
      wcv_.wait(lk);
      worker_asleep_ = false;
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;   // waiters: a call finished, the executor was released
  std::condition_variable wcv_;  // the worker: a call was queued
  bool worker_asleep_ = false;   // waiting on wcv_ until woken
  std::chrono::steady_clock::time_point last_made_{};
  std::deque<JobPtr> queue_;
  bool running_ = false;
  bool stopped_ = false;
  std::thread worker_;
};

}  // namespace ringreduce::runtime
