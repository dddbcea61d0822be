// Transfer jobs from submit() to their completion: admission, posting
// within the window, direct copies, the state machine that flushes and
// notifies, and UCX's completions. Flushes are in flushes.cpp, early ends
// (deadlines, cancellation, abandoned jobs) in job_cancel.cpp.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>

#include "engine_internal.hpp"
#include "fault_guard.hpp"

namespace akv {

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
  stats_.live_jobs.fetch_add(ids.size());
  stats_.jobs_submitted.fetch_add(ids.size());
  {
    std::lock_guard<std::mutex> lk(live_mu_);
    live_ids_.insert(ids.begin(), ids.end());
  }
  try {
    commands_.post([this, jobs]() {
      for (auto& j : *jobs) admit(std::move(j));
    });
  } catch (...) {
    stats_.live_jobs.fetch_sub(ids.size());
    {
      std::lock_guard<std::mutex> lk(live_mu_);
      for (uint64_t id : ids) live_ids_.erase(id);
    }
    live_cv_.notify_all();
    signal_release();
    throw;
  }
  return ids;
}

void Engine::cancel(uint64_t job_id) {
  // Cancelling after close is a no-op: close already released every job.
  if (commands_.closed()) return;
  try {
    commands_.post([this, job_id]() {
      auto it = jobs_.find(job_id);
      if (it == jobs_.end()) return;  // already finished; its completion is queued
      cancel_job(it->second.get(), Status::kCANCELLED);
    });
  } catch (const ClosedError&) {
  }
}

void Engine::cancel_many(std::vector<uint64_t> job_ids) {
  // As cancel(): a no-op after close.
  if (job_ids.empty() || commands_.closed()) return;
  try {
    commands_.post([this, ids = std::move(job_ids)]() {
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
  if (job->status == Status::kOK) resolve_segments(job);
  if (job->status == Status::kOK && job->guard_in.rkey_id != 0 && !job->segs.empty()) resolve_guard(job);
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

// The job's segments against its keys, merged where contiguous; its keys
// counted as used. Fails the job on an unknown key or one out of range.
void Engine::resolve_segments(Job* job) {
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

// The key of the job's retirement guard, checked and counted like a segment's.
void Engine::resolve_guard(Job* job) {
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
  ucs_status_ptr_t r = ucp_get_nbx(ep->handle, &j->guard_word, sizeof(uint64_t), j->guard_in.addr, rk->handle.get(), &p);
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
  stats_.copy_faults.fetch_add(1);
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
    Chunk c{reinterpret_cast<uint8_t*>(s.local + j->seg_off), s.remote + j->seg_off, n};
    bool posted;
    if (s.rkey->mapped != nullptr && !lanes_.empty() && lane_inflight_ < kLaneDepth * lanes_.size()) {
      posted = queue_lane_copy(j, s, c);
    } else if (s.rkey->mapped != nullptr) {
      posted = copy_chunk(j, s, c);
    } else {
      posted = post_chunk(j, s, c);
    }
    if (!posted) return;
    j->seg_off += n;
    if (j->seg_off == s.len) {
      j->seg_idx++;
      j->seg_off = 0;
    }
  }
}

bool Engine::queue_lane_copy(Job* j, const Segment& s, const Chunk& c) {
  // Copy lanes: this thread is one, the lane threads the others. A lane
  // gets at most kLaneDepth chunks queued (a cancel or a deadline makes
  // it skip the queued ones: the job stops within about one chunk per
  // lane); past that this thread copies the next chunk itself (copy_chunk).
  uint8_t* peer = s.rkey->mapped + (c.remote - s.rkey->base);
  CopyTask t = j->op == Op::kPut ? CopyTask{peer, c.local, c.n, j, false, false}
                                 : CopyTask{c.local, peer, c.n, j, false, false};
  j->lane_ops++;
  j->inflight_bytes += c.n;
  inflight_bytes_ += c.n;
  j->copied_any = true;
  lane_inflight_++;
  posted_++;
  lanes_.push(t);
  return true;
}

bool Engine::copy_chunk(Job* j, const Segment& s, const Chunk& c) {
  if (!guard_checked_) {
    install_fault_guard();
    guard_checked_ = true;
  }
  // Copies run on this thread: yield to commands (cancel) and deadlines
  // every few chunks so a huge job stays cancellable.
  if (copy_budget_ < c.n) {
    window_full_ = true;
    return false;
  }
  copy_budget_ -= c.n;
  uint8_t* peer = s.rkey->mapped + (c.remote - s.rkey->base);
  bool copied = j->op == Op::kPut ? guarded_copy(peer, c.local, c.n) : guarded_copy(c.local, peer, c.n);
  j->copied_any = true;
  if (!copied) {
    j->fail(Status::kLINK_FAILED, UCS_ERR_IO_ERROR);
    copy_fault(j->ep);
    return false;
  }
  posted_++;
  stats_.bytes_direct.fetch_add(c.n);
  j->bytes_done += c.n;
  (j->op == Op::kPut ? stats_.bytes_put : stats_.bytes_get).fetch_add(c.n);
  return true;
}

bool Engine::post_chunk(Job* j, const Segment& s, const Chunk& c) {
  Endpoint* ep = j->ep;
  if (ep->wiring) {
    // Not before the peer answered our wireup (Engine::connect): it waits
    // in the endpoint's list, out of the posting queue, so jobs on other
    // endpoints go on.
    j->parked = true;
    ep->parked.push_back(j);
    return false;
  }
  // The confirmation window: a frozen peer can apply at most this many
  // bytes of ours after we stopped (see EngineConfig).
  if (cfg_.max_unconfirmed_bytes > 0 && ep->unconfirmed > 0 &&
      ep->unconfirmed + c.n > cfg_.max_unconfirmed_bytes) {
    post_window_flush(ep);
    window_full_ = true;
    return false;
  }
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.send = &Engine::on_data_done;
  p.user_data = this;
  ucs_status_ptr_t r = j->op == Op::kPut
                           ? ucp_put_nbx(ep->handle, c.local, c.n, c.remote, s.rkey->handle.get(), &p)
                           : ucp_get_nbx(ep->handle, c.local, c.n, c.remote, s.rkey->handle.get(), &p);
  j->posted_any = true;
  posted_++;
  if (UCS_PTR_IS_ERR(r)) {
    ucs_status_t st = UCS_PTR_STATUS(r);
    j->fail(ep->broken ? Status::kLINK_FAILED : status_from_ucs(st), st);
    return false;
  }
  // A put is confirmed by a later flush, a get by its own completion.
  if (j->op == Op::kPut) {
    add_unconfirmed(ep, c.n);
    ep->unflushed += c.n;
  } else if (r != nullptr) {
    add_unconfirmed(ep, c.n);
  }
  if (r == nullptr) {
    j->bytes_done += c.n;
    (j->op == Op::kPut ? stats_.bytes_put : stats_.bytes_get).fetch_add(c.n);
  } else {
    auto* ctx = static_cast<RequestCtx*>(r);
    ctx->kind = RequestCtx::kData;
    ctx->job = j;
    ctx->ep = ep;
    ctx->len = c.n;
    j->inflight_ops++;
    j->inflight_bytes += c.n;
    inflight_bytes_ += c.n;
  }
  // Half a window unflushed: confirm it while the other half streams.
  if (cfg_.max_unconfirmed_bytes > 0 && ep->unflushed * 2 >= cfg_.max_unconfirmed_bytes) {
    post_window_flush(ep);
  }
  return true;
}

bool Engine::drain_lanes() {
  std::vector<CopyTask> done = lanes_.take_done();
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
      stats_.bytes_direct.fetch_add(t.n);
      (j->op == Op::kPut ? stats_.bytes_put : stats_.bytes_get).fetch_add(t.n);
    }
    touch(j);
  }
  return !done.empty();
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
    j->posted_ns = monotonic_ns();
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
        stats_.notifications_sent.fetch_add(1);
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
    stats_.jobs_completed.fetch_add(1);
  } else {
    stats_.jobs_failed.fetch_add(1);
  }
  Completion c{EntryKind::kJob, j->id, j->status, j->ucs_status, j->bytes_done, {}, j->posted_ns,
               monotonic_ns()};
  jobs_.erase(j->id);  // frees j
  // The counter drops before the entry is visible, so a reader who has seen
  // every completion also sees zero live jobs.
  stats_.live_jobs.fetch_sub(1);
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
  signal_release();
}

void Engine::signal_release(bool always) {
  if (release_armed_.exchange(false) || always) {
    // Under the lock close() takes to close it: never a write to a number
    // the process may have reused.
    std::lock_guard<std::mutex> lk(release_mu_);
    if (release_efd_.get() < 0) return;
    uint64_t one = 1;
    ssize_t n = ::write(release_efd_.get(), &one, sizeof(one));
    (void)n;  // full (2^64 - 2 unread): a waiter polls anyway
  }
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
    ctx->ep->close_finished();
    return;
  }
  if (ctx->kind == RequestCtx::kGuard) {
    guard_done(ctx->job, st);
    return;
  }
  Job* j = ctx->job;
  j->inflight_ops--;
  // An abandoned job was reported long ago; its window share was returned.
  if (j->abandoned) return;
  // A close waits for this endpoint's operations: keys they no longer use
  // must go now, before that close can complete and destroy the endpoint.
  if (ctx->kind == RequestCtx::kData && j->inflight_ops == 0 && j->ep->close_posted() &&
      !j->ep->close_done()) {
    destroy_idle_keys(j->ep);
  }
  if (ctx->kind == RequestCtx::kData) {
    j->inflight_bytes -= ctx->len;
    inflight_bytes_ -= ctx->len;
    if (j->op == Op::kGet) confirm(j->ep, ctx->len);
    if (st == UCS_OK) {
      j->bytes_done += ctx->len;
      (j->op == Op::kPut ? stats_.bytes_put : stats_.bytes_get).fetch_add(ctx->len);
    }
  } else if (ctx->kind == RequestCtx::kNotify && st == UCS_OK) {
    stats_.notifications_sent.fetch_add(1);
  }
  if (st != UCS_OK) {
    Status s = status_from_ucs(st);
    if (j->ep->broken || s == Status::kCANCELLED) s = Status::kLINK_FAILED;
    j->fail(s, st);
  }
  touch(j);
}

// The guard's get answered: the word says whether the cache is still live.
void Engine::guard_done(Job* g, ucs_status_t st) {
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
}

void Engine::on_data_done(void* request, ucs_status_t status, void* user_data) {
  auto* self = static_cast<Engine*>(user_data);
  // During ucp_worker_destroy the jobs were already reported released.
  if (!self->destroying_) self->op_done(static_cast<RequestCtx*>(request), status);
  ucp_request_free(request);
}

}  // namespace akv
