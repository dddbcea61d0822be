// The progress thread's loop: its steps, and its sleeps between them on the
// worker's and the command queue's file descriptors.
#include <sys/epoll.h>

#include <algorithm>

#include "engine_internal.hpp"

namespace akv {

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
  commands_.run();
  bool busy = drain_lanes();
  // Work on jobs of our own (some listed, or one moved) starts the spin
  // below; UCX's own traffic or a command alone does not.
  bool job_work = busy || !jobs_.empty();
  // Deadlines before posting: a thread that was not scheduled (a frozen or
  // starved process) past a job's deadline must not post for it first.
  check_deadlines();
  if (!touched_.empty()) busy = job_work = true;
  process_touched();
  if (post_all()) busy = job_work = true;
  // Bounded: under a steady stream of arrivals (many peers pushing into
  // this one) progress never returns 0, and an unbounded loop here starved
  // the rest of the step: keep-alives (peers declared this one silent and
  // broke their links at 32 peers on 2 cores), deadlines, flushes.
  for (int i = 0; i < kProgressBurst && ucp_worker_progress(worker_.get()) != 0; ++i) busy = true;
  reap_endpoints();
  if (!touched_.empty()) busy = job_work = true;
  process_touched();
  check_deadlines();
  process_touched();
  while (post_flushes()) {
    busy = true;
    process_touched();  // flushes that completed at once move their jobs on
  }
  check_stuck();
  send_keepalives();
  stats_.inflight_bytes.store(inflight_bytes_);
  if (busy && job_work) spin_until_ = std::chrono::steady_clock::now() + cfg_.spin;
  return busy;
}

void Engine::run() {
  while (!progress_.stopping()) {
    int idle = 0;
    while (!progress_.stopping()) {
      if (step()) {  // after work on our own jobs it set spin_until_
        idle = 0;
        continue;
      }
      if (commands_.pending() || lanes_.done_pending()) continue;
      // Spin a little after work (the next call of a caller awaiting each
      // one comes soon, and a sleeping thread costs a wake-up); never when
      // there is nothing to do.
      // With jobs in flight it also polls through the spin (a small job's
      // answer comes within it) and at least kSpinPolls steps.
      if (spin_until_ <= std::chrono::steady_clock::now() && (jobs_.empty() || ++idle > kSpinPolls)) break;
    }
    if (progress_.stopping()) break;
    // Announce the sleep, then look once more: a command posted before the
    // announcement is seen here, one posted after it writes the eventfd.
    commands_.announce_sleep();
    if (commands_.pending() || lanes_.done_pending()) {
      commands_.end_sleep();
      continue;
    }
    ucs_status_t st = ucp_worker_arm(worker_.get());
    if (st == UCS_ERR_BUSY) {
      commands_.end_sleep();
      continue;
    }
    epoll_event evs[4];
    int n = ::epoll_wait(epfd_.get(), evs, 4, wait_timeout_ms());
    commands_.end_sleep();
    for (int i = 0; i < n; ++i) {
      if (evs[i].data.fd == commands_.fd()) commands_.clear_wakeups();
    }
  }
  shutdown_all();
}

}  // namespace akv
