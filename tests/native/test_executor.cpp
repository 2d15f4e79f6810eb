// The executor every communicator runs its calls on (csrc/runtime/executor.h): calls in the order they
// were made whoever runs them, a waiter runs its own queued call, a synchronous call waits for the
// queued ones (running them itself), errors reach done(), stop() runs or fails what is left.
#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "runtime/executor.h"

using ringreduce::runtime::Executor;
using namespace std::chrono_literals;

namespace {

struct Log {
  std::mutex mu;
  std::vector<int> order;
  std::vector<std::thread::id> threads;
  void add(int i) {
    std::lock_guard<std::mutex> lk(mu);
    order.push_back(i);
    threads.push_back(std::this_thread::get_id());
  }
};

void test_order_and_help() {
  Executor ex;
  Log log;
  std::atomic<int> done{0};
  std::vector<Executor::JobPtr> jobs;
  // The worker is held inside job 0 until released: jobs 1..3 stay queued behind it.
  std::atomic<bool> hold{true};
  jobs.push_back(ex.submit([&](const Executor::Interrupted*) {
    while (hold) std::this_thread::sleep_for(1ms);
    log.add(0);
  }, [&](const std::string& e) { CHECK(e.empty(), "job 0 error %s", e.c_str()); ++done; }));
  for (int i = 1; i <= 3; ++i)
    jobs.push_back(ex.submit([&, i](const Executor::Interrupted*) { log.add(i); },
                             [&](const std::string& e) { CHECK(e.empty(), "%s", e.c_str()); ++done; }));
  CHECK(ex.inflight() == 4, "inflight %d, want 4", ex.inflight());
  CHECK(!ex.try_claim(), "claimed a busy executor");
  std::this_thread::sleep_for(20ms);
  hold = false;
  CHECK(ex.wait(jobs[3], nullptr), "wait interrupted");
  CHECK(done == 4, "done %d", done.load());
  CHECK(log.order == std::vector<int>({0, 1, 2, 3}), "order %d %d %d %d", log.order[0], log.order[1],
        log.order[2], log.order[3]);
  CHECK(ex.inflight() == 0, "inflight %d after all done", ex.inflight());

  // Nothing running: a waiter that comes first runs its own call (and any ahead of it) itself.
  // The worker may win the race for some; over 200 tries the waiter must win at least once.
  int here = 0;
  for (int k = 0; k < 200; ++k) {
    std::thread::id ran;
    auto a = ex.submit([&](const Executor::Interrupted*) {}, nullptr);
    auto b = ex.submit([&](const Executor::Interrupted*) { ran = std::this_thread::get_id(); }, nullptr);
    CHECK(ex.wait(b, nullptr), "wait interrupted");
    CHECK(a->finished && b->finished, "a call ahead was not finished");
    here += ran == std::this_thread::get_id();
  }
  CHECK(here > 0, "the waiter never ran its own call in 200 tries");

  // A call nobody waits for runs on the worker once its grace period has passed.
  std::atomic<std::thread::id> ran{};
  auto alone = ex.submit([&](const Executor::Interrupted*) { ran = std::this_thread::get_id(); }, nullptr);
  for (int i = 0; i < 1000 && ex.inflight(); ++i) std::this_thread::sleep_for(1ms);
  CHECK(ex.inflight() == 0 && ran.load() != std::thread::id() && ran.load() != std::this_thread::get_id(),
        "an unwaited call did not run on the worker");
}

void test_sync_after_async_and_errors() {
  Executor ex;
  Log log;
  std::string err;
  std::atomic<bool> hold{true};
  auto j = ex.submit([&](const Executor::Interrupted*) {
    while (hold) std::this_thread::sleep_for(1ms);
    log.add(1);
    throw ringreduce::RingError("boom");
  }, [&](const std::string& e) { err = e; });
  std::thread release([&] {
    std::this_thread::sleep_for(20ms);
    hold = false;
  });
  // A synchronous call made after the async one runs after it.
  CHECK(ex.run([&](const Executor::Interrupted*) { log.add(2); }, nullptr), "run interrupted");
  release.join();
  CHECK(log.order == std::vector<int>({1, 2}), "sync ran before the queued call");
  CHECK(j->finished && err == "boom", "error '%s'", err.c_str());
  // A synchronous body's exception reaches its caller; the executor stays usable.
  bool threw = false;
  try {
    ex.run([](const Executor::Interrupted*) { throw ringreduce::RingError("sync boom"); }, nullptr);
  } catch (const ringreduce::RingError& e) {
    threw = std::string(e.what()) == "sync boom";
  }
  CHECK(threw, "sync error not raised");
  CHECK(ex.try_claim(), "idle executor not claimable");
  ex.release();
}

void test_interrupt_and_stop() {
  Executor ex;
  std::atomic<bool> hold{true}, started{false};
  auto j = ex.submit([&](const Executor::Interrupted*) {
    started = true;
    while (hold) std::this_thread::sleep_for(1ms);
  }, nullptr);
  // The worker has it (a fixed sleep was not enough on a loaded machine: run() below then claimed
  // the job itself and spun in it on this thread, forever).
  while (!started) std::this_thread::sleep_for(1ms);
  int polls = 0;
  const Executor::Interrupted stop_after_two = [&] { return ++polls >= 2; };
  const auto t0 = std::chrono::steady_clock::now();
  CHECK(!ex.run([](const Executor::Interrupted*) {}, &stop_after_two), "run not interrupted");
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
      std::chrono::steady_clock::now() - t0).count();
  CHECK(polls == 2 && ms >= 90 && ms < 2000, "polls %d after %lld ms", polls, (long long)ms);
  // stop(): the running call ends, later submissions fail at once with "closed".
  std::thread release([&] {
    std::this_thread::sleep_for(20ms);
    hold = false;
  });
  ex.stop();
  release.join();
  CHECK(j->finished, "the running call did not finish before stop() returned");
  std::string err;
  auto late = ex.submit([](const Executor::Interrupted*) {}, [&](const std::string& e) { err = e; });
  CHECK(late->finished && err.find("closed") != std::string::npos, "late call: '%s'", err.c_str());
  bool threw = false;
  try {
    ex.run([](const Executor::Interrupted*) {}, nullptr);
  } catch (const ringreduce::RingError& e) {
    threw = std::string(e.what()).find("closed") != std::string::npos;
  }
  CHECK(threw, "a sync call after stop() did not raise 'closed'");
  CHECK(!ex.try_claim(), "claimed a stopped executor");
}

}  // namespace

// A done() callback that drops the last owner of the executor runs on the worker: the executor dies
// there (a communicator freed by Python code in a future's callback). It must not join itself, nor
// destroy a joinable std::thread (std::terminate), nor be touched after it is gone.
void test_last_owner_dropped_on_the_worker() {
  for (int k = 0; k < 20; ++k) {
    auto ex = std::make_shared<Executor>();
    std::atomic<bool> dropped{false};
    std::atomic<bool> ran_on_worker{false};
    const auto main_id = std::this_thread::get_id();
    auto owner = std::make_shared<std::shared_ptr<Executor>>(ex);
    std::weak_ptr<Executor> seen = ex;
    ex->submit([](const Executor::Interrupted*) {},
               [&, owner](const std::string& e) {
                 CHECK(e.empty(), "%s", e.c_str());
                 ran_on_worker = std::this_thread::get_id() != main_id;
                 owner->reset();  // the last owner: ~Executor runs here, on the worker
                 dropped = true;
               });
    ex.reset();  // the callback's copy is now the only owner
    for (int i = 0; i < 5000 && !dropped; ++i) std::this_thread::sleep_for(1ms);
    CHECK(dropped, "the job never finished");
    CHECK(ran_on_worker, "the job ran on the main thread");
    for (int i = 0; i < 5000 && !seen.expired(); ++i) std::this_thread::sleep_for(1ms);
    CHECK(seen.expired(), "the executor outlived its last owner");
  }
}

int main() {
  test_last_owner_dropped_on_the_worker();
  test_order_and_help();
  test_sync_after_async_and_errors();
  test_interrupt_and_stop();
  return finish("test_executor");
}
