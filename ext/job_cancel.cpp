// How jobs end early: deadlines, cancellation, the detection of cancels a
// frozen peer holds up, and the release of jobs whose endpoint was forced.
#include <atomic>
#include <vector>

#include "engine_internal.hpp"

namespace akv {

void Engine::check_deadlines() {
  if (deadlines_.empty()) return;
  auto now = std::chrono::steady_clock::now();
  while (!deadlines_.empty() && deadlines_.begin()->first <= now) {
    auto it = jobs_.find(deadlines_.begin()->second);
    deadlines_.erase(deadlines_.begin());
    if (it == jobs_.end()) continue;
    it->second->has_deadline = false;
    cancel_job(it->second.get(), Status::kTIMEOUT);
  }
}

void Engine::cancel_job(Job* j, Status why) {
  if (j->phase == Phase::kDone) return;
  // Past the flush the bytes have landed; a job still sending its
  // notification is cancelled all the same (it fails: the peer may or may
  // not see the notification), so that its deadline, and the stuck
  // detector behind a cancel, hold in this phase too.
  j->fail(why);
  j->stop_copies.store(true, std::memory_order_relaxed);
  if (!j->cancel) {
    j->cancel = true;
    j->cancelled_at = std::chrono::steady_clock::now();
    cancelling_++;
  }
  touch(j);
}

void Engine::check_stuck() {
  if (cancelling_ == 0 && !any_forced_) return;
  // Only while something is cancelling or was forced, and at most every
  // kStuckCheckEvery: the scan stays off the hot path.
  auto now = std::chrono::steady_clock::now();
  if (now < next_stuck_check_) return;
  next_stuck_check_ = now + kStuckCheckEvery;
  std::vector<Endpoint*> stuck;
  for (auto& kv : jobs_) {
    Job* j = kv.second.get();
    // UCX operations only: chunks on copy lanes are local work that ends
    // on its own (a starved lane is no sign of a dead peer).
    if (j->cancel && j->inflight_ops > 0 && j->ep != nullptr && !j->ep->broken &&
        now - j->cancelled_at > j->cancel_grace) {
      stuck.push_back(j->ep);
    }
  }
  for (Endpoint* ep : stuck) {
    if (ep->broken) continue;
    endpoint_failed(ep, UCS_ERR_ENDPOINT_TIMEOUT);
    close_endpoint(ep, true);  // purges the requests the peer never answered
  }
  // A forced close of a peer-failure endpoint purges what it held, so jobs
  // on it end at once; on other endpoints UCX refuses to force and the
  // flushing close waits for the frozen peer. Deadlines must still mean
  // something: such jobs are reported released after their forced-close
  // grace, although UCX still holds their requests and would move their
  // bytes if the peer thawed (docs/design.md, "Cancellation and quiescence").
  std::vector<Job*> gone;
  for (auto& kv : jobs_) {
    Job* j = kv.second.get();
    // Never while a lane still copies for it: that would report released a
    // job whose buffer a lane is about to write (it is released once the
    // lanes are done with it; only UCX's requests can outlive the release).
    if (j->inflight_ops > 0 && j->lane_ops == 0 && j->ep != nullptr && j->ep->forced &&
        now - j->ep->forced_at > j->fail_grace) {
      gone.push_back(j);
    }
  }
  for (Job* j : gone) abandon(j);
}

void Engine::abandon(Job* j) {
  j->abandoned = true;
  j->ep->unproven = true;
  j->fail(Status::kLINK_FAILED, j->ep->ucs_status);
  detach(j);
  inflight_bytes_ -= j->inflight_bytes;
  j->inflight_bytes = 0;
  j->ep->jobs--;
  if (j->cancel) cancelling_--;
  // Its keys stay counted and pinned: a request UCX still holds may name
  // them. The Job itself stays allocated (graveyard_) until the worker is
  // destroyed.
  for (RemoteKey* rk : j->keys) rk->pinned = true;
  stats_.jobs_failed.fetch_add(1);
  stats_.live_jobs.fetch_sub(1);
  push_job_completion(Completion{EntryKind::kJob, j->id, j->status, j->ucs_status, j->bytes_done, {},
                               j->posted_ns, monotonic_ns()});
  auto it = jobs_.find(j->id);
  graveyard_.push_back(std::move(it->second));
  jobs_.erase(it);
}

}  // namespace akv
