// The progress thread's loop, and the command queue through which other
// threads reach it.
#include <pthread.h>
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
  {
    std::lock_guard<std::mutex> lk(cmd_mu_);
    // Checked under the lock close() takes, so nothing is queued after the
    // progress thread's last look at the queue.
    if (closing_.load()) throw ClosedError();
    commands_.push_back(std::move(fn));
    cmd_pending_.store(true);
  }
  // A spinning thread sees cmd_pending_ on its next step; only a thread
  // that is (about to be) asleep needs the eventfd: one write per sleep.
  if (sleeping_.exchange(false)) wake();
}

// ---------------------------------------------------------- progress thread

void Engine::run_commands() {
  if (!cmd_pending_.load()) return;  // the common case, without the lock
  std::vector<std::function<void()>> cmds;
  {
    std::lock_guard<std::mutex> lk(cmd_mu_);
    cmds.swap(commands_);
    cmd_pending_.store(false);
  }
  for (auto& c : cmds) c();
}

int Engine::wait_timeout_ms() {
  int ms = jobs_.empty() ? kIdleWaitMs : kSafetyWaitMs;
  if (cfg_.keepalive.count() > 0) {
    // Keep-alives go out on time even when nothing else wakes this thread
    // (a peer whose Python threads are starved posts no command).
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(next_keepalive_ -
                                                                      std::chrono::steady_clock::now())
                    .count();
    ms = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(ms, left + 1)));
  }
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
  bool busy = drain_lanes();
  // Deadlines before posting: a thread that was not scheduled (a frozen or
  // starved process) past a job's deadline must not post for it first.
  check_deadlines();
  if (!touched_.empty()) busy = true;
  process_touched();
  busy = post_all() || busy;
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
  send_keepalives();
  inflight_snapshot_.store(inflight_bytes_);
  return busy;
}

void Engine::run() {
  // Named for tools (top -H, benchmarks reading /proc/self/task/*/comm).
  pthread_setname_np(pthread_self(), "akv-progress");
  while (!stop_.load()) {
    int idle = 0;
    while (!stop_.load()) {
      if (step()) {
        idle = 0;
        spin_until_ = std::chrono::steady_clock::now() + cfg_.spin;
        continue;
      }
      if (cmd_pending_.load() || lane_done_pending_.load()) continue;
      // Spin a little after work (the next call of a caller awaiting each
      // one comes soon, and a sleeping thread costs a wake-up); never when
      // there is nothing to do.
      // With jobs in flight it also polls through the spin (a small job's
      // answer comes within it) and at least kSpinPolls steps.
      if (spin_until_ <= std::chrono::steady_clock::now() && (jobs_.empty() || ++idle > kSpinPolls)) break;
    }
    if (stop_.load()) break;
    // Announce the sleep, then look once more: a command posted before the
    // announcement is seen here, one posted after it writes the eventfd.
    sleeping_.store(true);
    if (cmd_pending_.load() || lane_done_pending_.load()) {
      sleeping_.store(false);
      continue;
    }
    ucs_status_t st = ucp_worker_arm(worker_);
    if (st == UCS_ERR_BUSY) {
      sleeping_.store(false);
      continue;
    }
    epoll_event evs[4];
    int n = ::epoll_wait(epfd_, evs, 4, wait_timeout_ms());
    sleeping_.store(false);
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
