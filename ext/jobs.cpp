// Transfer jobs from submit() to their completion: admission, posting
// within the window, direct copies, flushes, notifications, deadlines,
// cancellation, and the release of jobs a dead peer never answered.
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>

#include "engine_internal.hpp"
#include "fault_guard.hpp"

namespace akv {
namespace {

Status status_from_ucs(ucs_status_t st) {
  switch (st) {
    case UCS_OK:
      return Status::kOK;
    case UCS_ERR_CANCELED:
      return Status::kCANCELLED;
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_REJECTED:
    case UCS_ERR_NOT_CONNECTED:
    case UCS_ERR_IO_ERROR:
      return Status::kLINK_FAILED;
    default:
      return Status::kERROR;
  }
}

}  // namespace

// ---------------------------------------------------------------- API side

static void check_spec(const JobSpec& spec) {
  if (spec.payload.size() > Engine::kMaxPayload) throw InvalidArgument("notification payload too large");
  if (spec.op == Op::kGet && !spec.payload.empty()) throw InvalidArgument("get jobs carry no payload");
}

std::unique_ptr<Job> Engine::make_job(JobSpec&& spec) {
  auto j = std::make_unique<Job>();
  j->id = next_job_.fetch_add(1);
  j->op = spec.op;
  j->ep_id = spec.ep_id;
  j->raw = std::move(spec.segs);
  j->payload = std::move(spec.payload);
  j->guard_in = spec.guard;
  j->cancel_grace = kCancelGrace;
  j->fail_grace = kFailGrace;
  if (spec.timeout_ms > 0) {
    j->has_deadline = true;
    // Past a few centuries now() + timeout would overflow the clock.
    auto span = std::chrono::milliseconds(std::min<uint64_t>(spec.timeout_ms, uint64_t{1} << 40));
    j->deadline = std::chrono::steady_clock::now() + span;
    j->cancel_grace = scaled_grace(span, 0.25, kCancelGraceMin, kCancelGrace);
    j->fail_grace = scaled_grace(span, 0.1, kFailGraceMin, kFailGrace);
  }
  return j;
}

uint64_t Engine::submit(Op op, uint64_t ep_id, std::vector<SegmentIn>&& segs, std::string&& payload,
                        uint64_t timeout_ms) {
  std::vector<JobSpec> one;
  one.push_back(JobSpec{op, ep_id, std::move(segs), std::move(payload), timeout_ms});
  return submit_many(std::move(one)).front();
}

std::vector<uint64_t> Engine::submit_many(std::vector<JobSpec>&& specs) {
  for (const auto& spec : specs) check_spec(spec);
  check_open();
  // Shared with the command, which admits them in order on the progress thread.
  auto jobs = std::make_shared<std::vector<std::unique_ptr<Job>>>();
  jobs->reserve(specs.size());
  std::vector<uint64_t> ids;
  ids.reserve(specs.size());
  for (auto& spec : specs) {
    jobs->push_back(make_job(std::move(spec)));
    ids.push_back(jobs->back()->id);
  }
  if (ids.empty()) return ids;
  live_jobs_.fetch_add(ids.size());
  jobs_submitted_.fetch_add(ids.size());
  {
    std::lock_guard<std::mutex> lk(live_mu_);
    live_ids_.insert(ids.begin(), ids.end());
  }
  try {
    post_command([this, jobs]() {
      for (auto& j : *jobs) admit(std::move(j));
    });
  } catch (...) {
    live_jobs_.fetch_sub(ids.size());
    {
      std::lock_guard<std::mutex> lk(live_mu_);
      for (uint64_t id : ids) live_ids_.erase(id);
    }
    live_cv_.notify_all();
    throw;
  }
  return ids;
}

void Engine::cancel(uint64_t job_id) {
  // Cancelling after close is a no-op: close already released every job.
  if (closing_.load()) return;
  try {
    post_command([this, job_id]() {
      auto it = jobs_.find(job_id);
      if (it == jobs_.end()) return;  // already finished; its completion is queued
      cancel_job(it->second.get(), Status::kCANCELLED);
    });
  } catch (const ClosedError&) {
  }
}

void Engine::cancel_many(std::vector<uint64_t> job_ids) {
  // As cancel(): a no-op after close.
  if (job_ids.empty() || closing_.load()) return;
  try {
    post_command([this, ids = std::move(job_ids)]() {
      for (uint64_t job_id : ids) {
        auto it = jobs_.find(job_id);
        if (it == jobs_.end()) continue;  // already finished; its completion is queued
        cancel_job(it->second.get(), Status::kCANCELLED);
      }
    });
  } catch (const ClosedError&) {
  }
}

bool Engine::wait_released(const std::vector<uint64_t>& job_ids, double timeout_s) {
  if (std::isnan(timeout_s)) throw InvalidArgument("timeout must be a number of seconds");
  // Ids are unique and never reused, so one seen released stays released:
  // each wakeup resumes where the last one stopped instead of rescanning.
  size_t done = 0;
  auto all_released = [&]() {
    while (done < job_ids.size() && live_ids_.count(job_ids[done]) == 0) ++done;
    return done == job_ids.size();
  };
  std::unique_lock<std::mutex> lk(live_mu_);
  // Past a few centuries now() + timeout would overflow the clock.
  if (timeout_s > 1e9) {
    live_cv_.wait(lk, all_released);
    return true;
  }
  auto deadline = std::chrono::steady_clock::now() +
                  std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                      std::chrono::duration<double>(std::max(0.0, timeout_s)));
  return live_cv_.wait_until(lk, deadline, all_released);
}

// ---------------------------------------------------------- progress thread

void Engine::admit(std::unique_ptr<Job> j) {
  Job* job = j.get();
  jobs_[job->id] = std::move(j);
  auto eit = eps_.find(job->ep_id);
  if (eit == eps_.end()) {
    // An id we issued belongs to an endpoint that ended (its record is
    // gone once it closed): the link failed. Any other id is a bad argument.
    bool ended = job->ep_id != 0 && job->ep_id < next_ep_;
    job->fail(ended ? Status::kLINK_FAILED : Status::kINVALID);
  } else {
    job->ep = eit->second.get();
    job->ep->jobs++;
    if (job->ep->broken || job->ep->closing || job->ep->handle == nullptr) {
      job->fail(Status::kLINK_FAILED, job->ep->ucs_status);
    }
  }
  if (job->status == Status::kOK) {
    job->segs.reserve(job->raw.size());
    for (const SegmentIn& s : job->raw) {
      if (s.len == 0) continue;
      auto kit = rkeys_.find(s.rkey_id);
      if (kit == rkeys_.end() || kit->second->released || kit->second->ep_id != job->ep_id ||
          kit->second->handle == nullptr) {
        job->fail(Status::kINVALID);
        break;
      }
      RemoteKey* rk = kit->second.get();
      // Defence in depth: Python checked bounds against the peer's
      // descriptor; the key's region is checked again here.
      if (!segment_fits(s, rk->base, rk->len)) {
        job->fail(Status::kINVALID);
        break;
      }
      if (!job->segs.empty()) {
        Segment& last = job->segs.back();
        if (last.rkey == rk && last.local + last.len == s.local && last.remote + last.len == s.remote) {
          last.len += s.len;
          continue;
        }
      }
      if (std::find(job->keys.begin(), job->keys.end(), rk) == job->keys.end()) {
        job->keys.push_back(rk);
        rk->users++;
      }
      job->segs.push_back(Segment{s.local, s.remote, s.len, rk});
    }
  }
  if (job->status == Status::kOK && job->guard_in.rkey_id != 0 && !job->segs.empty()) {
    auto kit = rkeys_.find(job->guard_in.rkey_id);
    SegmentIn word{0, job->guard_in.addr, sizeof(uint64_t), job->guard_in.rkey_id};
    if (kit == rkeys_.end() || kit->second->released || kit->second->ep_id != job->ep_id ||
        kit->second->handle == nullptr || !segment_fits(word, kit->second->base, kit->second->len)) {
      job->fail(Status::kINVALID);
    } else {
      RemoteKey* rk = kit->second.get();
      job->guard_key = rk;
      if (std::find(job->keys.begin(), job->keys.end(), rk) == job->keys.end()) {
        job->keys.push_back(rk);
        rk->users++;
      }
    }
  }
  job->raw.clear();
  job->raw.shrink_to_fit();
  if (job->has_deadline) job->dl_it = deadlines_.emplace(job->deadline, job->id);
  if (job->status == Status::kOK && !job->segs.empty()) {
    job->in_active = true;
    active_.push_back(job);
  } else {
    touch(job);
  }
}

bool Engine::post_guard(Job* j) {
  RemoteKey* rk = j->guard_key;
  uint64_t off = j->guard_in.addr - rk->base;
  if (rk->mapped != nullptr) {
    j->guard_posted = true;
    if (!guard_checked_) {
      install_fault_guard();
      guard_checked_ = true;
    }
    uint64_t word = 0;
    if (!guarded_load(reinterpret_cast<volatile uint64_t*>(rk->mapped + off), &word)) {
      j->fail(Status::kLINK_FAILED, UCS_ERR_IO_ERROR);
      copy_fault(j->ep);
      return false;
    }
    if (word != j->guard_in.expect) j->fail(Status::kRETIRED);
    return j->status == Status::kOK;
  }
  Endpoint* ep = j->ep;
  if (ep->wiring) {
    j->parked = true;
    ep->parked.push_back(j);
    return false;
  }
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.send = &Engine::on_data_done;
  p.user_data = this;
  ucs_status_ptr_t r = ucp_get_nbx(ep->handle, &j->guard_word, sizeof(uint64_t), j->guard_in.addr, rk->handle, &p);
  j->guard_posted = true;
  posted_++;
  if (UCS_PTR_IS_ERR(r)) {
    ucs_status_t st = UCS_PTR_STATUS(r);
    j->fail(ep->broken ? Status::kLINK_FAILED : status_from_ucs(st), st);
    return false;
  }
  if (r == nullptr) {
    if (j->guard_word != j->guard_in.expect) j->fail(Status::kRETIRED);
    return j->status == Status::kOK;
  }
  auto* ctx = static_cast<RequestCtx*>(r);
  ctx->kind = RequestCtx::kGuard;
  ctx->job = j;
  ctx->ep = ep;
  ctx->len = 0;
  ctx->batch = nullptr;
  j->inflight_ops++;
  if (j->guard_in.strict) {
    // Nothing moves before the word says the cache is live: the job leaves
    // the posting queue (post_all) and comes back when the get answers.
    j->guard_wait = true;
    return false;
  }
  return true;
}

void Engine::copy_fault(Endpoint* ep) {
  copy_faults_.fetch_add(1);
  if (ep != nullptr && !ep->broken) endpoint_failed(ep, UCS_ERR_IO_ERROR);
}

void Engine::post_job(Job* j) {
  // The retirement guard goes first: before any of the job's bytes.
  if (j->guard_key != nullptr && !j->guard_posted && !j->cancel && j->status == Status::kOK &&
      !post_guard(j)) {
    return;
  }
  while (j->seg_idx < j->segs.size() && !j->cancel && j->status == Status::kOK) {
    // The deadline, per chunk: a thread stopped mid-step (a frozen process,
    // page faults) that resumes past it moves at most the chunk it was in.
    if (j->has_deadline && std::chrono::steady_clock::now() >= j->deadline) {
      cancel_job(j, Status::kTIMEOUT);
      return;
    }
    const Segment& s = j->segs[j->seg_idx];
    uint64_t n = std::min(s.len - j->seg_off, cfg_.chunk_bytes);
    // Through UCX, a chunk never exceeds the confirmation window by itself:
    // the window is then a bound, whatever chunk_bytes is.
    if (s.rkey->mapped == nullptr && cfg_.max_unconfirmed_bytes > 0) {
      n = std::min(n, cfg_.max_unconfirmed_bytes);
    }
    if (inflight_bytes_ > 0 && inflight_bytes_ + n > cfg_.max_inflight_bytes) {
      window_full_ = true;
      return;
    }
    void* local = reinterpret_cast<void*>(s.local + j->seg_off);
    uint64_t remote = s.remote + j->seg_off;
    if (s.rkey->mapped != nullptr && !lanes_.empty() && lane_inflight_ < kLaneDepth * lanes_.size()) {
      // Copy lanes: this thread is one, the lane threads the others. A lane
      // gets at most kLaneDepth chunks queued (a cancel or a deadline makes
      // it skip the queued ones: the job stops within about one chunk per
      // lane); past that this thread copies the next chunk itself, below.
      uint8_t* peer = s.rkey->mapped + (remote - s.rkey->base);
      auto* mine = static_cast<uint8_t*>(local);
      CopyTask t = j->op == Op::kPut ? CopyTask{peer, mine, n, j, false, false}
                                     : CopyTask{mine, peer, n, j, false, false};
      j->lane_ops++;
      j->inflight_bytes += n;
      inflight_bytes_ += n;
      j->copied_any = true;
      lane_inflight_++;
      posted_++;
      {
        std::lock_guard<std::mutex> lk(lane_mu_);
        lane_q_.push_back(t);
      }
      lane_cv_.notify_one();
      j->seg_off += n;
      if (j->seg_off == s.len) {
        j->seg_idx++;
        j->seg_off = 0;
      }
      continue;
    }
    if (s.rkey->mapped != nullptr && !guard_checked_) {
      install_fault_guard();
      guard_checked_ = true;
    }
    if (s.rkey->mapped != nullptr) {
      // Copies run on this thread: yield to commands (cancel) and deadlines
      // every few chunks so a huge job stays cancellable.
      if (copy_budget_ < n) {
        window_full_ = true;
        return;
      }
      copy_budget_ -= n;
      uint8_t* peer = s.rkey->mapped + (remote - s.rkey->base);
      bool copied = j->op == Op::kPut ? guarded_copy(peer, local, n) : guarded_copy(local, peer, n);
      j->copied_any = true;
      if (!copied) {
        j->fail(Status::kLINK_FAILED, UCS_ERR_IO_ERROR);
        copy_fault(j->ep);
        return;
      }
      posted_++;
      bytes_direct_.fetch_add(n);
      j->bytes_done += n;
      (j->op == Op::kPut ? bytes_put_ : bytes_get_).fetch_add(n);
      j->seg_off += n;
      if (j->seg_off == s.len) {
        j->seg_idx++;
        j->seg_off = 0;
      }
      continue;
    }
    Endpoint* ep = j->ep;
    if (ep->wiring) {
      // Not before the peer answered our wireup (Engine::connect): it waits
      // in the endpoint's list, out of the posting queue, so jobs on other
      // endpoints go on.
      j->parked = true;
      ep->parked.push_back(j);
      return;
    }
    // The confirmation window: a frozen peer can apply at most this many
    // bytes of ours after we stopped (see EngineConfig).
    if (cfg_.max_unconfirmed_bytes > 0 && ep->unconfirmed > 0 &&
        ep->unconfirmed + n > cfg_.max_unconfirmed_bytes) {
      post_window_flush(ep);
      window_full_ = true;
      return;
    }
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.send = &Engine::on_data_done;
    p.user_data = this;
    ucs_status_ptr_t r = j->op == Op::kPut
                             ? ucp_put_nbx(j->ep->handle, local, n, remote, s.rkey->handle, &p)
                             : ucp_get_nbx(j->ep->handle, local, n, remote, s.rkey->handle, &p);
    j->posted_any = true;
    posted_++;
    if (UCS_PTR_IS_ERR(r)) {
      ucs_status_t st = UCS_PTR_STATUS(r);
      j->fail(j->ep->broken ? Status::kLINK_FAILED : status_from_ucs(st), st);
      return;
    }
    // A put is confirmed by a later flush, a get by its own completion.
    if (j->op == Op::kPut) {
      add_unconfirmed(ep, n);
      ep->unflushed += n;
    } else if (r != nullptr) {
      add_unconfirmed(ep, n);
    }
    if (r == nullptr) {
      j->bytes_done += n;
      (j->op == Op::kPut ? bytes_put_ : bytes_get_).fetch_add(n);
    } else {
      auto* ctx = static_cast<RequestCtx*>(r);
      ctx->kind = RequestCtx::kData;
      ctx->job = j;
      ctx->ep = j->ep;
      ctx->len = n;
      j->inflight_ops++;
      j->inflight_bytes += n;
      inflight_bytes_ += n;
    }
    j->seg_off += n;
    if (j->seg_off == s.len) {
      j->seg_idx++;
      j->seg_off = 0;
    }
    // Half a window unflushed: confirm it while the other half streams.
    if (cfg_.max_unconfirmed_bytes > 0 && ep->unflushed * 2 >= cfg_.max_unconfirmed_bytes) {
      post_window_flush(ep);
    }
  }
}

void Engine::lane_main() {
  pthread_setname_np(pthread_self(), "akv-copy");
  while (true) {
    CopyTask t{};
    bool stopping;
    {
      std::unique_lock<std::mutex> lk(lane_mu_);
      lane_cv_.wait(lk, [this] { return lanes_stop_ || !lane_q_.empty(); });
      if (lane_q_.empty()) return;  // stopping, nothing left
      t = lane_q_.front();
      lane_q_.pop_front();
      stopping = lanes_stop_;
    }
    // After a stop only skip: stop_lanes() runs before any mapping goes.
    if (!stopping && !t.job->stop_copies.load(std::memory_order_relaxed)) {
      install_fault_guard();
      t.copied = guarded_copy(t.dst, t.src, t.n);
      t.faulted = !t.copied;
      // Non-temporal stores included: visible before the completion (and
      // any notification the progress thread sends after it).
      std::atomic_thread_fence(std::memory_order_seq_cst);
    }
    {
      std::lock_guard<std::mutex> lk(lane_done_mu_);
      lane_done_.push_back(t);
      lane_done_pending_.store(true);
    }
    if (sleeping_.exchange(false)) wake();
  }
}

bool Engine::drain_lanes() {
  if (!lane_done_pending_.load()) return false;
  std::vector<CopyTask> done;
  {
    std::lock_guard<std::mutex> lk(lane_done_mu_);
    done.swap(lane_done_);
    lane_done_pending_.store(false);
  }
  for (const CopyTask& t : done) {
    lane_inflight_--;
    Job* j = t.job;
    j->lane_ops--;
    j->inflight_bytes -= t.n;
    inflight_bytes_ -= t.n;
    if (t.faulted) {
      j->fail(Status::kLINK_FAILED, UCS_ERR_IO_ERROR);
      copy_fault(j->ep);
    }
    if (t.copied) {
      j->bytes_done += t.n;
      bytes_direct_.fetch_add(t.n);
      (j->op == Op::kPut ? bytes_put_ : bytes_get_).fetch_add(t.n);
    }
    touch(j);
  }
  return !done.empty();
}

void Engine::stop_lanes() {
  {
    std::lock_guard<std::mutex> lk(lane_mu_);
    if (lanes_stop_) return;
    lanes_stop_ = true;
  }
  lane_cv_.notify_all();
  for (auto& t : lanes_) {
    if (t.joinable()) t.join();
  }
}

void Engine::add_unconfirmed(Endpoint* ep, uint64_t n) {
  ep->unconfirmed += n;
  unconfirmed_ += n;
  unconfirmed_snapshot_.store(unconfirmed_, std::memory_order_relaxed);
}

void Engine::confirm(Endpoint* ep, uint64_t n) {
  n = std::min(n, ep->unconfirmed);
  ep->unconfirmed -= n;
  unconfirmed_ -= n;
  // Before the completions this confirmation lets through are queued.
  unconfirmed_snapshot_.store(unconfirmed_, std::memory_order_relaxed);
}

void Engine::post_window_flush(Endpoint* ep) {
  if (ep->window_flush || ep->unflushed == 0 || ep->broken || ep->handle == nullptr ||
      ep->close_posted) {
    return;
  }
  uint64_t covered = ep->unflushed;
  ep->unflushed = 0;
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.send = &Engine::on_data_done;
  p.user_data = this;
  ucs_status_ptr_t r = ucp_ep_flush_nbx(ep->handle, &p);
  if (r == nullptr || UCS_PTR_IS_ERR(r)) {
    // Done at once, or failed: a failed endpoint's jobs fail on their own
    // requests, and nothing posts to it again.
    confirm(ep, covered);
    return;
  }
  ep->window_flush = true;
  auto* ctx = static_cast<RequestCtx*>(r);
  ctx->kind = RequestCtx::kWindow;
  ctx->job = nullptr;
  ctx->ep = ep;
  ctx->len = covered;
  ctx->batch = nullptr;
}

bool Engine::post_all() {
  // Busy only when something moved: a full window with nothing posted must
  // let the thread sleep until a completion frees room.
  uint64_t before = posted_;
  bool any = false;
  window_full_ = false;
  // With lane threads, one chunk per step: the lanes' queues are refilled
  // between this thread's own chunks, so they never wait for it.
  copy_budget_ = (lanes_.empty() ? 4 : 1) * cfg_.chunk_bytes;
  guard_checked_ = false;  // install_fault_guard() before this step's first mapped copy
  while (!active_.empty() && !window_full_) {
    Job* j = active_.front();
    post_job(j);
    any = any || posted_ != before;
    bool done_posting = j->seg_idx >= j->segs.size() || j->cancel || j->status != Status::kOK;
    if (!done_posting && !j->parked && !j->guard_wait) break;  // window full: keep FIFO order
    active_.pop_front();
    j->in_active = false;
    if (!done_posting) continue;  // parked until wired up, or its strict guard answers
    touch(j);
    any = true;
  }
  return any;
}

void Engine::touch(Job* j) {
  if (!j->touched) {
    j->touched = true;
    touched_.push_back(j);
  }
}

void Engine::process_touched() {
  while (!touched_.empty()) {
    std::vector<Job*> batch;
    batch.swap(touched_);
    // touch() queues a job at most once, and only advance() frees a job, so
    // no pointer in the batch dangles.
    for (Job* j : batch) {
      j->touched = false;
      advance(j);
    }
  }
}

void Engine::advance(Job* j) {
  // Each step starts only when the previous step has nothing in flight.
  if (j->abandoned || j->inflight_ops > 0 || j->lane_ops > 0) return;
  if (j->phase == Phase::kPosting) {
    bool done_posting = j->seg_idx >= j->segs.size() || j->cancel || j->status != Status::kOK;
    if (!done_posting) return;
    if (j->in_active) {
      active_.erase(std::find(active_.begin(), active_.end(), j));
      j->in_active = false;
    }
    j->phase = Phase::kFlushing;
    // A put has landed only when the peer has it: flush, even after a cancel,
    // so nothing this job posted can still arrive once it is reported.
    // Jobs that reach this point in the same step share one endpoint flush
    // (it covers every operation posted before it): see post_flushes().
    if (j->op == Op::kPut && j->posted_any && !j->ep->broken && j->ep->handle != nullptr) {
      j->inflight_ops++;
      j->ep->flush_wait.push_back(j);
      if (!j->ep->flush_queued) {
        j->ep->flush_queued = true;
        flush_eps_.push_back(j->ep);
      }
      return;
    }
  }
  if (j->phase == Phase::kFlushing) {
    j->phase = Phase::kNotifying;
    if (j->status == Status::kOK && !j->cancel && !j->payload.empty()) {
      // Copies into mapped memory may use non-temporal stores: make them
      // visible before the notification that announces them.
      if (j->copied_any) std::atomic_thread_fence(std::memory_order_seq_cst);
      ucp_request_param_t p{};
      p.op_attr_mask =
          UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
      p.cb.send = &Engine::on_data_done;
      p.user_data = this;
      // The header is the key the peer gave this link: it attributes the
      // notification to us, whatever the payload says.
      p.flags = UCP_AM_SEND_FLAG_EAGER | UCP_AM_SEND_FLAG_COPY_HEADER;
      const std::string& hdr = j->ep->note_header;
      ucs_status_ptr_t r = ucp_am_send_nbx(j->ep->handle, kAmId, hdr.empty() ? nullptr : hdr.data(), hdr.size(),
                                           j->payload.data(), j->payload.size(), &p);
      if (UCS_PTR_IS_ERR(r)) {
        ucs_status_t st = UCS_PTR_STATUS(r);
        j->fail(status_from_ucs(st), st);
      } else if (r != nullptr) {
        auto* ctx = static_cast<RequestCtx*>(r);
        ctx->kind = RequestCtx::kNotify;
        ctx->job = j;
        ctx->ep = j->ep;
        ctx->len = 0;
        j->inflight_ops++;
        return;
      } else {
        notes_sent_.fetch_add(1);
      }
    }
  }
  finish(j);
}

// Out of the posting queue and the deadline map: nothing schedules it again.
void Engine::detach(Job* j) {
  if (j->in_active) {
    active_.erase(std::find(active_.begin(), active_.end(), j));
    j->in_active = false;
  }
  if (j->parked) {
    auto& parked = j->ep->parked;
    parked.erase(std::find(parked.begin(), parked.end(), j));
    j->parked = false;
  }
  if (j->has_deadline) {
    deadlines_.erase(j->dl_it);
    j->has_deadline = false;
  }
}

void Engine::finish(Job* j) {
  j->phase = Phase::kDone;
  detach(j);
  for (RemoteKey* rk : j->keys) {
    rk->users--;
    if (rk->released && rk->users == 0) destroy_rkey(rk);
  }
  if (j->ep != nullptr) j->ep->jobs--;
  if (j->cancel) cancelling_--;
  if (j->status == Status::kOK) {
    jobs_completed_.fetch_add(1);
  } else {
    jobs_failed_.fetch_add(1);
  }
  Completion c{EntryKind::kJob, j->id, j->status, j->ucs_status, j->bytes_done, {}};
  jobs_.erase(j->id);  // frees j
  // The counter drops before the entry is visible, so a reader who has seen
  // every completion also sees zero live jobs.
  live_jobs_.fetch_sub(1);
  push_job_completion(std::move(c));
}

void Engine::push_job_completion(Completion&& c) {
  uint64_t id = c.id;
  cq_.push(std::move(c));
  {
    std::lock_guard<std::mutex> lk(live_mu_);
    live_ids_.erase(id);
  }
  live_cv_.notify_all();
}

bool Engine::post_flushes() {
  if (flush_eps_.empty()) return false;
  std::vector<Endpoint*> eps;
  eps.swap(flush_eps_);
  for (Endpoint* ep : eps) {
    ep->flush_queued = false;
    auto* batch = new std::vector<Job*>();
    batch->swap(ep->flush_wait);
    // This flush also confirms the put bytes posted since the last one.
    uint64_t covered = ep->unflushed;
    ep->unflushed = 0;
    if (ep->broken || ep->handle == nullptr) {
      confirm(ep, covered);
      complete_flush(batch, UCS_ERR_CONNECTION_RESET);
      continue;
    }
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.send = &Engine::on_data_done;
    p.user_data = this;
    ucs_status_ptr_t r = ucp_ep_flush_nbx(ep->handle, &p);
    if (UCS_PTR_IS_ERR(r)) {
      confirm(ep, covered);
      complete_flush(batch, UCS_PTR_STATUS(r));
    } else if (r == nullptr) {
      confirm(ep, covered);
      complete_flush(batch, UCS_OK);
    } else {
      auto* ctx = static_cast<RequestCtx*>(r);
      ctx->kind = RequestCtx::kFlush;
      ctx->job = nullptr;
      ctx->ep = ep;
      ctx->len = covered;
      ctx->batch = batch;
    }
  }
  return true;
}

void Engine::complete_flush(std::vector<Job*>* batch, ucs_status_t st) {
  for (Job* j : *batch) {
    j->inflight_ops--;
    if (j->abandoned) continue;
    if (st != UCS_OK) {
      Status s = status_from_ucs(st);
      j->fail(s == Status::kCANCELLED || s == Status::kERROR ? Status::kLINK_FAILED : s, st);
    }
    touch(j);
  }
  delete batch;
}

void Engine::op_done(RequestCtx* ctx, ucs_status_t st) {
  if (ctx->kind == RequestCtx::kWireup) {
    wired(ctx->len);
    return;
  }
  if (ctx->kind == RequestCtx::kKeepalive) {
    auto it = eps_.find(ctx->len);
    if (it != eps_.end()) it->second->ping_inflight = false;
    return;
  }
  if (ctx->kind == RequestCtx::kFlush) {
    confirm(ctx->ep, ctx->len);
    complete_flush(ctx->batch, st);
    return;
  }
  if (ctx->kind == RequestCtx::kWindow) {
    // Whatever its status: a failed endpoint posts nothing again.
    ctx->ep->window_flush = false;
    confirm(ctx->ep, ctx->len);
    return;
  }
  if (ctx->kind == RequestCtx::kClose) {
    ctx->ep->handle = nullptr;
    ctx->ep->close_done = true;
    return;
  }
  if (ctx->kind == RequestCtx::kGuard) {
    Job* g = ctx->job;
    g->inflight_ops--;
    if (g->abandoned) return;
    if (st != UCS_OK) {
      g->fail(g->ep->broken || st == UCS_ERR_CANCELED ? Status::kLINK_FAILED : status_from_ucs(st), st);
    } else if (g->guard_word != g->guard_in.expect) {
      g->fail(Status::kRETIRED);
    }
    if (g->guard_wait) {
      g->guard_wait = false;
      if (g->status == Status::kOK && !g->cancel && !g->in_active) {
        g->in_active = true;
        active_.push_back(g);  // its bytes may move now
      }
    }
    touch(g);
    return;
  }
  Job* j = ctx->job;
  j->inflight_ops--;
  // An abandoned job was reported long ago; its window share was returned.
  if (j->abandoned) return;
  // A close waits for this endpoint's operations: keys they no longer use
  // must go now, before that close can complete and destroy the endpoint.
  if (ctx->kind == RequestCtx::kData && j->inflight_ops == 0 && j->ep->close_posted &&
      !j->ep->close_done) {
    destroy_idle_keys(j->ep);
  }
  if (ctx->kind == RequestCtx::kData) {
    j->inflight_bytes -= ctx->len;
    inflight_bytes_ -= ctx->len;
    if (j->op == Op::kGet) confirm(j->ep, ctx->len);
    if (st == UCS_OK) {
      j->bytes_done += ctx->len;
      (j->op == Op::kPut ? bytes_put_ : bytes_get_).fetch_add(ctx->len);
    }
  } else if (ctx->kind == RequestCtx::kNotify && st == UCS_OK) {
    notes_sent_.fetch_add(1);
  }
  if (st != UCS_OK) {
    Status s = status_from_ucs(st);
    if (j->ep->broken || s == Status::kCANCELLED) s = Status::kLINK_FAILED;
    j->fail(s, st);
  }
  touch(j);
}

void Engine::on_data_done(void* request, ucs_status_t status, void* user_data) {
  auto* self = static_cast<Engine*>(user_data);
  // During ucp_worker_destroy the jobs were already reported released.
  if (!self->destroying_) self->op_done(static_cast<RequestCtx*>(request), status);
  ucp_request_free(request);
}

ucs_status_t Engine::on_am(void* arg, const void* header, size_t header_length, void* data,
                           size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<Engine*>(arg);
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) {
    // Our peers send notifications eagerly; anything else is dropped
    // (returning UCS_OK releases a rendezvous descriptor).
    self->notes_dropped_.fetch_add(1);
    return UCS_OK;
  }
  // Attributed by the key in its header, which only the link's peer knows;
  // anything else (no key, an unknown or retired one) is dropped.
  const NoteKey* key = self->keyed(header, header_length);
  if (key == nullptr) {
    self->notes_dropped_.fetch_add(1);
    return UCS_OK;
  }
  if (self->notes_queued_.load() >= kMaxQueuedNotes) {
    self->notes_dropped_.fetch_add(1);
    return UCS_OK;
  }
  self->notes_received_.fetch_add(1);
  self->notes_queued_.fetch_add(1);
  self->cq_.push(Completion{EntryKind::kNotify, key->peer_id, Status::kOK, 0, length,
                            std::string(static_cast<const char*>(data), length)});
  return UCS_OK;
}

const Engine::NoteKey* Engine::keyed(const void* header, size_t header_length) {
  if (header_length != kNoteKeyLen) return nullptr;
  auto it = note_keys_.find(std::string(static_cast<const char*>(header), header_length));
  if (it == note_keys_.end()) return nullptr;
  heard_from(it->second.ep_id);  // any message carrying the link's key: its peer is alive
  return &it->second;
}

ucs_status_t Engine::on_keepalive(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                  const ucp_am_recv_param_t* param) {
  auto* self = static_cast<Engine*>(arg);
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) return UCS_OK;
  const NoteKey* key = self->keyed(header, header_length);
  if (key == nullptr) return UCS_OK;
  if (length == 1 && *static_cast<const uint8_t*>(data) == 1) {
    // Asked for an answer: a plain one, at the next step (not from inside
    // UCX's callback).
    auto ep = self->eps_.find(key->ep_id);
    if (ep != self->eps_.end()) {
      ep->second->ping_due = true;
      self->keepalive_due_ = true;
    }
  }
  return UCS_OK;
}

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
  jobs_failed_.fetch_add(1);
  live_jobs_.fetch_sub(1);
  push_job_completion(Completion{EntryKind::kJob, j->id, j->status, j->ucs_status, j->bytes_done, {}});
  auto it = jobs_.find(j->id);
  graveyard_.push_back(std::move(it->second));
  jobs_.erase(it);
}

}  // namespace akv
