// The command queue: how callers' threads reach the progress thread. A
// command is a function the progress thread runs on its next step; the
// eventfd wakes that thread only when it sleeps (or is about to).
#pragma once

#include <atomic>
#include <functional>
#include <mutex>
#include <vector>

#include "ucx_handles.hpp"

namespace akv {

class CommandQueue {
 public:
  // Throws Error when no eventfd can be made.
  CommandQueue();
  CommandQueue(const CommandQueue&) = delete;
  CommandQueue& operator=(const CommandQueue&) = delete;

  // Readable after wake(): the progress thread waits on it with the worker's.
  int fd() const { return efd_.get(); }
  // Queues fn (any thread); throws ClosedError once close() began.
  void post(std::function<void()> fn);
  // Takes no command from now on; false when it was already closed. Checked
  // under the lock post() takes, so nothing is queued after the progress
  // thread's last look at the queue.
  bool close();
  bool closed() const { return closed_.load(); }
  // Some command is queued (read without the lock).
  bool pending() const { return pending_.load(); }
  // Runs the queued commands (progress thread).
  void run();

  // The sleep handshake: the progress thread announces a sleep, then looks
  // once more for work; whoever hands it work after the announcement writes
  // the eventfd (one write per sleep), a spinning thread is not woken.
  void announce_sleep() { sleeping_.store(true); }
  void end_sleep() { sleeping_.store(false); }
  void wake_if_sleeping() {
    if (sleeping_.exchange(false)) wake();
  }
  void wake();
  // Reads the eventfd empty after a wake-up (progress thread).
  void clear_wakeups();
  // The eventfd goes (close(), once the progress thread is joined).
  void release_fd() { efd_.reset(); }

 private:
  UniqueFd efd_;
  std::mutex mu_;
  std::vector<std::function<void()>> commands_;
  std::atomic<bool> pending_{false};  // commands_ non-empty
  std::atomic<bool> closed_{false};
  std::atomic<bool> sleeping_{false};
};

}  // namespace akv
