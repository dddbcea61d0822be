// Copy lanes: threads that run same-host direct copies (memcpy through a
// peer's mapping) chunk by chunk, beside the progress thread, which queues
// the chunks and collects what the lanes did.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "job.hpp"

namespace akv {

// One chunk for a lane, and what the lane did with it.
struct CopyTask {
  uint8_t* dst;
  const uint8_t* src;
  uint64_t n;
  Job* job;
  bool copied;
  bool faulted;  // SIGBUS: the peer's memory under the mapping went away
};

class CopyLanes {
 public:
  CopyLanes() = default;
  ~CopyLanes() { stop(); }
  CopyLanes(const CopyLanes&) = delete;
  CopyLanes& operator=(const CopyLanes&) = delete;

  // Starts n lane threads; done() runs on a lane after each chunk it
  // reports (the progress thread's wake-up).
  void start(unsigned n, std::function<void()> done);
  // The number of lane threads (0: the progress thread copies alone).
  size_t size() const { return threads_.size(); }
  bool empty() const { return threads_.empty(); }
  void push(const CopyTask& t);
  // Some chunk was reported since the last take_done() (any thread).
  bool done_pending() const { return done_pending_.load(); }
  std::vector<CopyTask> take_done();
  // Lanes skip what is still queued, then exit; joined on return. No lane
  // copies a byte after it (idempotent).
  void stop();

 private:
  void lane_main();

  std::vector<std::thread> threads_;
  std::function<void()> on_done_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<CopyTask> queue_;
  bool stop_ = false;
  std::mutex done_mu_;
  std::vector<CopyTask> done_;
  std::atomic<bool> done_pending_{false};
};

}  // namespace akv
