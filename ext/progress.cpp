// The progress thread's loop, and the command queue through which other
// threads reach it.
#include <sys/epoll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <mutex>

#include "engine_internal.hpp"

namespace akv {

void Engine::wake() {
  uint64_t one = 1;
  ssize_t rc;
  do {
    rc = ::write(cmd_efd_, &one, sizeof(one));
  } while (rc < 0 && errno == EINTR);
}

void Engine::post_command(std::function<void()> fn) {
  bool signal;
  {
    std::lock_guard<std::mutex> lk(cmd_mu_);
    // Checked under the lock close() takes, so nothing is queued after the
    // progress thread's last look at the queue.
    if (closed_.load()) throw ClosedError();
    signal = commands_.empty();
    commands_.push_back(std::move(fn));
  }
  if (signal) wake();
}

// ---------------------------------------------------------- progress thread

void Engine::run_commands() {
  std::vector<std::function<void()>> cmds;
  {
    std::lock_guard<std::mutex> lk(cmd_mu_);
    cmds.swap(commands_);
  }
  for (auto& c : cmds) c();
}

int Engine::wait_timeout_ms() {
  int ms = jobs_.empty() ? kIdleWaitMs : kSafetyWaitMs;
  if (!deadlines_.empty()) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                    deadlines_.begin()->first - std::chrono::steady_clock::now())
                    .count();
    ms = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(ms, left + 1)));
  }
  return ms;
}

bool Engine::step() {
  run_commands();
  bool busy = post_all();
  while (ucp_worker_progress(worker_) != 0) busy = true;
  reap_endpoints();
  if (!touched_.empty()) busy = true;
  process_touched();
  check_deadlines();
  process_touched();
  while (post_flushes()) {
    busy = true;
    process_touched();  // flushes that completed at once move their jobs on
  }
  check_stuck();
  inflight_snapshot_.store(inflight_bytes_);
  return busy;
}

void Engine::run() {
  while (!stop_.load()) {
    int idle = 0;
    while (!stop_.load()) {
      if (step()) {
        idle = 0;
        continue;
      }
      bool pending_cmds;
      {
        std::lock_guard<std::mutex> lk(cmd_mu_);
        pending_cmds = !commands_.empty();
      }
      if (pending_cmds) continue;
      if (jobs_.empty() || ++idle > kSpinPolls) break;
    }
    if (stop_.load()) break;
    ucs_status_t st = ucp_worker_arm(worker_);
    if (st == UCS_ERR_BUSY) continue;
    epoll_event evs[4];
    int n = ::epoll_wait(epfd_, evs, 4, wait_timeout_ms());
    for (int i = 0; i < n; ++i) {
      if (evs[i].data.fd == cmd_efd_) {
        uint64_t v;
        while (::read(cmd_efd_, &v, sizeof(v)) > 0) {
        }
      }
    }
  }
  shutdown_all();
}

}  // namespace akv
