// The thread that runs the engine's progress loop (Engine::run): started
// once, asked to stop, joined. The loop polls stopping() between steps; a
// sleeping loop is woken through the command queue.
#pragma once

#include <pthread.h>

#include <atomic>
#include <functional>
#include <thread>
#include <utility>

namespace akv {

class ProgressThread {
 public:
  ProgressThread() = default;
  ~ProgressThread() { join(); }
  ProgressThread(const ProgressThread&) = delete;
  ProgressThread& operator=(const ProgressThread&) = delete;

  void start(std::function<void()> loop) {
    thread_ = std::thread([loop = std::move(loop)]() {
      // Named for tools (top -H, benchmarks reading /proc/self/task/*/comm).
      pthread_setname_np(pthread_self(), "akv-progress");
      loop();
    });
  }
  void request_stop() { stop_.store(true); }
  bool stopping() const { return stop_.load(); }
  void join() {
    if (thread_.joinable()) thread_.join();
  }

 private:
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace akv
