#include "engine.hpp"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

namespace akv {
namespace {

constexpr unsigned kAmId = 7;
// Empty progress polls before the thread arms the worker and sleeps. A short
// spin keeps latency low for back-to-back jobs without burning a core.
constexpr int kSpinPolls = 64;
// UCX wakeups have known gaps: never sleep longer than this with work pending.
constexpr int kSafetyWaitMs = 5;
constexpr int kIdleWaitMs = 100;
// How long close() lets in-flight operations drain before forcing endpoints.
constexpr auto kShutdownGrace = std::chrono::seconds(3);
// How long a locally failed endpoint waits for its in-flight ops to drain.
constexpr auto kFailGrace = std::chrono::seconds(1);
// How long a cancelled job may wait for in-flight ops before its endpoint is
// declared dead: a frozen peer must not make cancellation hang.
constexpr auto kCancelGrace = std::chrono::seconds(2);

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

const char* transport_list(const std::string& t) {
  if (t == "auto") return nullptr;
  if (t == "shm") return "sm,self";
  if (t == "tcp") return "tcp,self";
  if (t == "rdma") return "ib,self";
  throw InvalidArgument("transport must be one of auto, shm, tcp, rdma, not '" + t + "'");
}

std::string capture(const std::function<void(FILE*)>& fn) {
  char* buf = nullptr;
  size_t size = 0;
  FILE* f = open_memstream(&buf, &size);
  if (f == nullptr) return {};
  fn(f);
  std::fclose(f);
  std::string out(buf, size);
  std::free(buf);
  return out;
}

}  // namespace

Engine::Engine(EngineConfig cfg) : cfg_(std::move(cfg)) {
  if (cfg_.max_inflight_bytes == 0) throw InvalidArgument("max_inflight_bytes must be > 0");
  if (cfg_.chunk_bytes == 0) throw InvalidArgument("chunk_bytes must be > 0");
  const char* tls = transport_list(cfg_.transport);

  ucp_config_t* config = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
  if (st != UCS_OK) throw UcxFailure("ucp_config_read", st);
  // Transport choice lives in this context's config, not the process env, so
  // several engines in one process can differ.
  if (tls != nullptr) st = ucp_config_modify(config, "TLS", tls);
  // UCX's TCP connect is blocking by default: to a host that vanished it
  // holds the progress thread for the whole SYN timeout (minutes), and with
  // it every deadline and cancel. Non-blocking, a failed connect is an
  // endpoint error like any other. (Caller options below may override.)
  if (st == UCS_OK) st = ucp_config_modify(config, "TCP_CONN_NB", "y");
  for (const auto& kv : cfg_.ucx_options) {
    if (st != UCS_OK) break;
    st = ucp_config_modify(config, kv.first.c_str(), kv.second.c_str());
  }
  if (st != UCS_OK) {
    ucp_config_release(config);
    throw InvalidArgument(std::string("bad UCX option: ") + ucs_status_string(st));
  }

  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_REQUEST_SIZE |
                      UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  params.request_size = sizeof(RequestCtx);
  params.mt_workers_shared = 0;
  st = ucp_init(&params, config, &context_);
  ucp_config_release(config);
  if (st != UCS_OK) {
    throw UcxFailure("ucp_init (transport " + cfg_.transport + ")", st);
  }

  if (cfg_.transport == "rdma") {
    // UCX falls back to what it has (and only warns); an "rdma" engine
    // without a verbs transport would silently be useless.
    std::string resources = capture([this](FILE* f) { ucp_context_print_info(context_, f); });
    bool verbs = resources.find("/rc_") != std::string::npos || resources.find("/ud_") != std::string::npos ||
                 resources.find("/dc_") != std::string::npos || resources.find("rc_verbs") != std::string::npos ||
                 resources.find("ud_verbs") != std::string::npos;
    if (!verbs) {
      ucp_cleanup(context_);
      throw Error(
          "no RDMA (verbs) transport in this UCX; set RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true to use a "
          "system UCX built with verbs");
    }
  }

  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  st = ucp_worker_create(context_, &wp, &worker_);
  if (st != UCS_OK) {
    ucp_cleanup(context_);
    throw UcxFailure("ucp_worker_create", st);
  }

  auto fail = [&](const auto& error) {
    if (cmd_efd_ >= 0) ::close(cmd_efd_);
    if (epfd_ >= 0) ::close(epfd_);
    ucp_worker_destroy(worker_);
    ucp_cleanup(context_);
    throw error;
  };

  ucp_worker_attr_t attr{};
  attr.field_mask = UCP_WORKER_ATTR_FIELD_ADDRESS;
  st = ucp_worker_query(worker_, &attr);
  if (st != UCS_OK) fail(UcxFailure("ucp_worker_query", st));
  worker_address_.assign(reinterpret_cast<const char*>(attr.address), attr.address_length);
  ucp_worker_release_address(worker_, attr.address);

  ucp_am_handler_param_t am{};
  am.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                  UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
  am.id = kAmId;
  am.cb = &Engine::on_am;
  am.arg = this;
  am.flags = UCP_AM_FLAG_WHOLE_MSG;
  st = ucp_worker_set_am_recv_handler(worker_, &am);
  if (st != UCS_OK) fail(UcxFailure("ucp_worker_set_am_recv_handler", st));

  st = ucp_worker_get_efd(worker_, &worker_efd_);
  if (st != UCS_OK) fail(UcxFailure("ucp_worker_get_efd", st));
  cmd_efd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  epfd_ = ::epoll_create1(EPOLL_CLOEXEC);
  if (cmd_efd_ < 0 || epfd_ < 0) fail(Error("eventfd/epoll_create1 failed"));
  for (int fd : {worker_efd_, cmd_efd_}) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    if (::epoll_ctl(epfd_, EPOLL_CTL_ADD, fd, &ev) != 0) fail(Error("epoll_ctl failed"));
  }
  thread_ = std::thread(&Engine::run, this);
}

Engine::~Engine() { close(); }

void Engine::check_open() const {
  if (closed_.load()) throw ClosedError();
}

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

template <typename T>
T Engine::call(std::function<T()> fn) {
  auto prom = std::make_shared<std::promise<T>>();
  auto fut = prom->get_future();
  post_command([prom, fn = std::move(fn)]() {
    try {
      if constexpr (std::is_void_v<T>) {
        fn();
        prom->set_value();
      } else {
        prom->set_value(fn());
      }
    } catch (...) {
      prom->set_exception(std::current_exception());
    }
  });
  return fut.get();
}

// ---------------------------------------------------------------- API side

std::pair<uint64_t, uint64_t> Engine::mem_alloc(uint64_t len) {
  return call<std::pair<uint64_t, uint64_t>>([this, len]() {
    auto r = std::make_unique<Region>(map_region(context_, nullptr, len, true));
    r->id = next_region_++;
    auto out = std::make_pair(r->id, reinterpret_cast<uint64_t>(r->addr));
    regions_[r->id] = std::move(r);
    n_regions_ = regions_.size();
    return out;
  });
}

uint64_t Engine::mem_register(uint64_t addr, uint64_t len) {
  if (addr == 0) throw InvalidArgument("address must not be 0");
  return call<uint64_t>([this, addr, len]() {
    auto r = std::make_unique<Region>(map_region(context_, reinterpret_cast<void*>(addr), len, false));
    r->id = next_region_++;
    uint64_t id = r->id;
    regions_[id] = std::move(r);
    n_regions_ = regions_.size();
    return id;
  });
}

void Engine::mem_release(uint64_t region_id) {
  call<void>([this, region_id]() {
    auto it = regions_.find(region_id);
    if (it == regions_.end()) throw InvalidArgument("unknown region id");
    unmap_region(context_, *it->second);
    regions_.erase(it);
    n_regions_ = regions_.size();
  });
}

std::string Engine::rkey_pack(uint64_t region_id) {
  return call<std::string>([this, region_id]() {
    auto it = regions_.find(region_id);
    if (it == regions_.end()) throw InvalidArgument("unknown region id");
    return pack_rkey(context_, *it->second);
  });
}

uint64_t Engine::connect(const std::string& address, bool peer_errors) {
  if (address.empty()) throw InvalidArgument("worker address is empty");
  return call<uint64_t>([this, address, peer_errors]() {
    auto ep = std::make_unique<Endpoint>();
    ep->id = next_ep_++;
    ep->owner = this;
    ucp_ep_params_t p{};
    p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                   UCP_EP_PARAM_FIELD_ERR_HANDLER;
    p.address = reinterpret_cast<const ucp_address_t*>(address.data());
    p.err_mode = peer_errors ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
    p.err_handler.cb = &Engine::on_ep_error;
    p.err_handler.arg = ep.get();
    ucs_status_t st = ucp_ep_create(worker_, &p, &ep->handle);
    if (st != UCS_OK) throw UcxFailure("ucp_ep_create", st);
    uint64_t id = ep->id;
    eps_[id] = std::move(ep);
    n_eps_ = eps_.size();
    return id;
  });
}

void Engine::disconnect(uint64_t ep_id) {
  call<void>([this, ep_id]() {
    auto it = eps_.find(ep_id);
    if (it == eps_.end()) return;
    Endpoint* ep = it->second.get();
    ep->closing = true;
    for (auto& kv : jobs_) {
      Job* j = kv.second.get();
      if (j->ep == ep) cancel_job(j, Status::kLINK_FAILED);
    }
  });
}

void Engine::fail_endpoint(uint64_t ep_id) {
  call<void>([this, ep_id]() {
    auto it = eps_.find(ep_id);
    if (it == eps_.end() || it->second->broken) return;
    endpoint_failed(it->second.get(), UCS_ERR_CONNECTION_RESET);
    it->second->force_after = std::chrono::steady_clock::now() + kFailGrace;
  });
}

uint64_t Engine::rkey_unpack(uint64_t ep_id, const std::string& packed, uint64_t base, uint64_t len) {
  if (packed.empty()) throw InvalidArgument("packed rkey is empty");
  return call<uint64_t>([this, ep_id, packed, base, len]() {
    auto it = eps_.find(ep_id);
    if (it == eps_.end()) throw InvalidArgument("unknown endpoint id");
    Endpoint* ep = it->second.get();
    if (ep->broken || ep->closing || ep->handle == nullptr) {
      throw Error("endpoint is broken or closing");
    }
    auto rk = std::make_unique<RemoteKey>();
    ucs_status_t st = ucp_ep_rkey_unpack(ep->handle, packed.data(), &rk->handle);
    if (st != UCS_OK) throw UcxFailure("ucp_ep_rkey_unpack", st);
    // Same-host shared memory can be mapped here: then a transfer is one
    // memcpy on the progress thread, whatever lane UCX would have picked.
    void* mapped = nullptr;
    void* last = nullptr;
    // Both ends of the advertised range must map, contiguously: a peer that
    // claims more than it registered must not make us copy past its segment.
    if (cfg_.direct_copy && len > 0 && ucp_rkey_ptr(rk->handle, base, &mapped) == UCS_OK &&
        ucp_rkey_ptr(rk->handle, base + len - 1, &last) == UCS_OK &&
        static_cast<uint8_t*>(last) == static_cast<uint8_t*>(mapped) + (len - 1)) {
      rk->mapped = static_cast<uint8_t*>(mapped);
    }
    rk->id = next_rkey_++;
    rk->ep_id = ep_id;
    rk->base = base;
    rk->len = len;
    ep->rkeys.push_back(rk.get());
    uint64_t id = rk->id;
    rkeys_[id] = std::move(rk);
    return id;
  });
}

void Engine::rkey_release(uint64_t rkey_id) {
  call<void>([this, rkey_id]() {
    auto it = rkeys_.find(rkey_id);
    if (it == rkeys_.end()) return;
    it->second->released = true;
    if (it->second->users == 0) destroy_rkey(it->second.get());
  });
}

uint64_t Engine::submit(Op op, uint64_t ep_id, std::vector<SegmentIn>&& segs, std::string&& payload,
                        uint64_t timeout_ms) {
  if (payload.size() > kMaxPayload) throw InvalidArgument("notification payload too large");
  if (op == Op::kGet && !payload.empty()) throw InvalidArgument("get jobs carry no payload");
  check_open();
  auto j = std::make_unique<Job>();
  j->id = next_job_.fetch_add(1);
  j->op = op;
  j->ep_id = ep_id;
  j->raw = std::move(segs);
  j->payload = std::move(payload);
  if (timeout_ms > 0) {
    j->has_deadline = true;
    j->deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  }
  uint64_t id = j->id;
  live_jobs_.fetch_add(1);
  jobs_submitted_.fetch_add(1);
  {
    std::lock_guard<std::mutex> lk(live_mu_);
    live_ids_.insert(id);
  }
  Job* raw = j.release();
  try {
    post_command([this, raw]() { admit(std::unique_ptr<Job>(raw)); });
  } catch (...) {
    delete raw;
    live_jobs_.fetch_sub(1);
    {
      std::lock_guard<std::mutex> lk(live_mu_);
      live_ids_.erase(id);
    }
    live_cv_.notify_all();
    throw;
  }
  return id;
}

void Engine::cancel(uint64_t job_id) {
  // Cancelling after close is a no-op: close already released every job.
  if (closed_.load()) return;
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
  if (job_ids.empty() || closed_.load()) return;
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

void Engine::push_job_completion(Completion&& c) {
  uint64_t id = c.id;
  cq_.push(std::move(c));
  {
    std::lock_guard<std::mutex> lk(live_mu_);
    live_ids_.erase(id);
  }
  live_cv_.notify_all();
}

EngineStats Engine::stats() const {
  return EngineStats{live_jobs_.load(),      jobs_submitted_.load(), jobs_completed_.load(),
                     jobs_failed_.load(),    bytes_put_.load(),      bytes_get_.load(),
                     notes_sent_.load(),     notes_received_.load(), n_eps_.load(),
                     ep_errors_.load(),      n_regions_.load(),      inflight_snapshot_.load(),
                     bytes_direct_.load()};
}

std::string Engine::info() {
  return call<std::string>([this]() {
    return capture([this](FILE* f) {
      ucp_context_print_info(context_, f);
      ucp_worker_print_info(worker_, f);
    });
  });
}

void Engine::close() {
  {
    std::lock_guard<std::mutex> lk(close_mu_);
    {
      std::lock_guard<std::mutex> lk2(cmd_mu_);
      if (closed_.load()) return;
      closed_.store(true);
    }
    stop_.store(true);
    wake();
    if (thread_.joinable()) thread_.join();
  }
  ::close(epfd_);
  ::close(cmd_efd_);
  epfd_ = cmd_efd_ = -1;
  ucp_worker_destroy(worker_);
  {
    // shutdown_all() reported every job already; this only makes sure no
    // waiter outlives close(): with the worker gone nothing touches a buffer.
    std::lock_guard<std::mutex> lk(live_mu_);
    live_ids_.clear();
  }
  live_cv_.notify_all();
  // Only now: requests that outlived shutdown pointed at these.
  jobs_.clear();
  graveyard_.clear();
  active_.clear();
  touched_.clear();
  flush_eps_.clear();
  failed_eps_.clear();
  rkeys_.clear();
  eps_.clear();
  for (auto& kv : regions_) unmap_region(context_, *kv.second);
  regions_.clear();
  n_regions_ = 0;
  ucp_cleanup(context_);
  worker_ = nullptr;
  context_ = nullptr;
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

void Engine::admit(std::unique_ptr<Job> j) {
  Job* job = j.get();
  jobs_[job->id] = std::move(j);
  auto eit = eps_.find(job->ep_id);
  if (eit == eps_.end()) {
    job->fail(Status::kINVALID);
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
      if (s.remote < rk->base || s.len > rk->len || s.remote - rk->base > rk->len - s.len ||
          s.local + s.len < s.local) {
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

void Engine::post_job(Job* j) {
  while (j->seg_idx < j->segs.size() && !j->cancel && j->status == Status::kOK) {
    const Segment& s = j->segs[j->seg_idx];
    uint64_t n = std::min(s.len - j->seg_off, cfg_.chunk_bytes);
    if (inflight_bytes_ > 0 && inflight_bytes_ + n > cfg_.max_inflight_bytes) {
      window_full_ = true;
      return;
    }
    void* local = reinterpret_cast<void*>(s.local + j->seg_off);
    uint64_t remote = s.remote + j->seg_off;
    if (s.rkey->mapped != nullptr) {
      // Copies run on this thread: yield to commands (cancel) and deadlines
      // every few chunks so a huge job stays cancellable.
      if (copy_budget_ < n) {
        window_full_ = true;
        return;
      }
      copy_budget_ -= n;
      uint8_t* peer = s.rkey->mapped + (remote - s.rkey->base);
      if (j->op == Op::kPut) {
        std::memcpy(peer, local, n);
      } else {
        std::memcpy(local, peer, n);
      }
      j->copied_any = true;
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
  }
}

bool Engine::post_all() {
  // Busy only when something moved: a full window with nothing posted must
  // let the thread sleep until a completion frees room.
  uint64_t before = posted_;
  bool any = false;
  window_full_ = false;
  copy_budget_ = 4 * cfg_.chunk_bytes;
  while (!active_.empty() && !window_full_) {
    Job* j = active_.front();
    post_job(j);
    any = any || posted_ != before;
    bool done_posting = j->seg_idx >= j->segs.size() || j->cancel || j->status != Status::kOK;
    if (!done_posting) break;  // window full: keep FIFO order
    active_.pop_front();
    j->in_active = false;
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
  if (j->abandoned || j->inflight_ops > 0) return;
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
      p.flags = UCP_AM_SEND_FLAG_EAGER;
      ucs_status_ptr_t r =
          ucp_am_send_nbx(j->ep->handle, kAmId, nullptr, 0, j->payload.data(), j->payload.size(), &p);
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

void Engine::finish(Job* j) {
  j->phase = Phase::kDone;
  if (j->in_active) {
    active_.erase(std::find(active_.begin(), active_.end(), j));
    j->in_active = false;
  }
  if (j->has_deadline) {
    deadlines_.erase(j->dl_it);
    j->has_deadline = false;
  }
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

bool Engine::post_flushes() {
  if (flush_eps_.empty()) return false;
  std::vector<Endpoint*> eps;
  eps.swap(flush_eps_);
  for (Endpoint* ep : eps) {
    ep->flush_queued = false;
    auto* batch = new std::vector<Job*>();
    batch->swap(ep->flush_wait);
    if (ep->broken || ep->handle == nullptr) {
      complete_flush(batch, UCS_ERR_CONNECTION_RESET);
      continue;
    }
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.send = &Engine::on_data_done;
    p.user_data = this;
    ucs_status_ptr_t r = ucp_ep_flush_nbx(ep->handle, &p);
    if (UCS_PTR_IS_ERR(r)) {
      complete_flush(batch, UCS_PTR_STATUS(r));
    } else if (r == nullptr) {
      complete_flush(batch, UCS_OK);
    } else {
      auto* ctx = static_cast<RequestCtx*>(r);
      ctx->kind = RequestCtx::kFlush;
      ctx->job = nullptr;
      ctx->ep = ep;
      ctx->len = 0;
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
  if (ctx->kind == RequestCtx::kFlush) {
    complete_flush(ctx->batch, st);
    return;
  }
  if (ctx->kind == RequestCtx::kClose) {
    ctx->ep->handle = nullptr;
    ctx->ep->close_done = true;
    return;
  }
  Job* j = ctx->job;
  j->inflight_ops--;
  // An abandoned job was reported long ago; its window share was returned.
  if (j->abandoned) return;
  if (ctx->kind == RequestCtx::kData) {
    j->inflight_bytes -= ctx->len;
    inflight_bytes_ -= ctx->len;
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

void Engine::on_ep_error(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
  auto* ep = static_cast<Endpoint*>(arg);
  // Called inside ucp_worker_progress: record now, act in the main loop.
  if (!ep->broken) {
    ep->broken = true;
    ep->ucs_status = status;
    ep->owner->failed_eps_.push_back(ep);
  }
}

ucs_status_t Engine::on_am(void* arg, const void* /*header*/, size_t /*header_length*/, void* data,
                           size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<Engine*>(arg);
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) {
    // Our peers send notifications eagerly; anything else is dropped
    // (returning UCS_OK releases a rendezvous descriptor).
    return UCS_OK;
  }
  self->notes_received_.fetch_add(1);
  self->cq_.push(Completion{EntryKind::kNotify, 0, Status::kOK, 0, length,
                            std::string(static_cast<const char*>(data), length)});
  return UCS_OK;
}

void Engine::endpoint_failed(Endpoint* ep, ucs_status_t st) {
  ep->broken = true;
  if (ep->ucs_status == 0) ep->ucs_status = st;
  ep_errors_.fetch_add(1);
  for (auto& kv : jobs_) {
    Job* j = kv.second.get();
    if (j->ep == ep) {
      j->fail(Status::kLINK_FAILED, ep->ucs_status);
      cancel_job(j, Status::kLINK_FAILED);
    }
  }
  cq_.push(Completion{EntryKind::kEndpoint, ep->id, Status::kLINK_FAILED, ep->ucs_status, 0, {}});
}

void Engine::destroy_rkey(RemoteKey* rk) {
  if (rk->handle != nullptr) {
    ucp_rkey_destroy(rk->handle);
    rk->handle = nullptr;
  }
  if (!rk->released) return;  // Python still holds the id; the record stays
  auto eit = eps_.find(rk->ep_id);
  if (eit != eps_.end()) {
    auto& v = eit->second->rkeys;
    v.erase(std::remove(v.begin(), v.end(), rk), v.end());
  }
  rkeys_.erase(rk->id);
}

void Engine::close_endpoint(Endpoint* ep, bool force) {
  if (ep->close_posted || ep->handle == nullptr) return;
  ep->close_posted = true;
  if (force) {
    any_forced_ = true;
    ep->forced = true;
    ep->forced_at = std::chrono::steady_clock::now();
  }
  // Keys must go before their endpoint; jobs using them are done by now
  // (or, when forced, will complete with an error as the close purges them).
  if (ep->jobs == 0) {
    for (RemoteKey* rk : std::vector<RemoteKey*>(ep->rkeys)) {
      if (rk->handle != nullptr) {
        ucp_rkey_destroy(rk->handle);
        rk->handle = nullptr;
      }
    }
  }
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  p.cb.send = &Engine::on_data_done;
  p.user_data = this;
  p.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  ucs_status_ptr_t r = ucp_ep_close_nbx(ep->handle, &p);
  if (r == nullptr || UCS_PTR_IS_ERR(r)) {
    ep->handle = nullptr;
    ep->close_done = true;
  } else {
    auto* ctx = static_cast<RequestCtx*>(r);
    ctx->kind = RequestCtx::kClose;
    ctx->job = nullptr;
    ctx->ep = ep;
    ctx->len = 0;
  }
}

void Engine::reap_endpoints() {
  while (!failed_eps_.empty()) {
    std::vector<Endpoint*> failed;
    failed.swap(failed_eps_);
    for (Endpoint* ep : failed) {
      endpoint_failed(ep, static_cast<ucs_status_t>(ep->ucs_status));
      // UCX asks for a forced close after an endpoint error.
      close_endpoint(ep, true);
    }
  }
  auto now = std::chrono::steady_clock::now();
  for (auto it = eps_.begin(); it != eps_.end();) {
    Endpoint* ep = it->second.get();
    if ((ep->closing || ep->broken) && !ep->close_posted) {
      bool forced = ep->broken && now >= ep->force_after;
      if (ep->jobs == 0 || forced) close_endpoint(ep, ep->broken);
    }
    if (ep->close_posted && ep->close_done && ep->jobs == 0) {
      for (RemoteKey* rk : std::vector<RemoteKey*>(ep->rkeys)) {
        if (rk->handle != nullptr) {
          ucp_rkey_destroy(rk->handle);
          rk->handle = nullptr;
        }
      }
      if (ep->closing) {
        for (RemoteKey* rk : ep->rkeys) rkeys_.erase(rk->id);
        it = eps_.erase(it);
        n_eps_ = eps_.size();
        continue;
      }
    }
    ++it;
  }
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
  // Past the flush the bytes have landed (and the peer may be notified):
  // the job's outcome stands.
  if (j->phase == Phase::kNotifying || j->phase == Phase::kDone) return;
  j->fail(why);
  if (!j->cancel) {
    j->cancel = true;
    j->cancelled_at = std::chrono::steady_clock::now();
    cancelling_++;
  }
  touch(j);
}

void Engine::check_stuck() {
  if (cancelling_ == 0 && !any_forced_) return;
  // Timers of seconds: a look every 50 ms is plenty, and keeps this scan
  // off the hot path.
  auto now = std::chrono::steady_clock::now();
  if (now < next_stuck_check_) return;
  next_stuck_check_ = now + std::chrono::milliseconds(50);
  std::vector<Endpoint*> stuck;
  for (auto& kv : jobs_) {
    Job* j = kv.second.get();
    if (j->cancel && j->inflight_ops > 0 && j->ep != nullptr && !j->ep->broken &&
        now - j->cancelled_at > kCancelGrace) {
      stuck.push_back(j->ep);
    }
  }
  for (Endpoint* ep : stuck) {
    if (ep->broken) continue;
    endpoint_failed(ep, UCS_ERR_ENDPOINT_TIMEOUT);
    close_endpoint(ep, true);  // purges the requests the peer never answered
  }
  // Without UCX peer-failure mode a forced close may not complete what was
  // outstanding (a peer host that vanished answers nothing). Such jobs are
  // reported released once their endpoint has been closed for a while: it
  // sends and receives nothing more, so their buffers are no longer used.
  std::vector<Job*> gone;
  for (auto& kv : jobs_) {
    Job* j = kv.second.get();
    if (j->inflight_ops > 0 && j->ep != nullptr && j->ep->forced &&
        now - j->ep->forced_at > kFailGrace) {
      gone.push_back(j);
    }
  }
  for (Job* j : gone) abandon(j);
}

void Engine::abandon(Job* j) {
  j->abandoned = true;
  j->fail(Status::kLINK_FAILED, j->ep->ucs_status);
  if (j->in_active) {
    active_.erase(std::find(active_.begin(), active_.end(), j));
    j->in_active = false;
  }
  if (j->has_deadline) {
    deadlines_.erase(j->dl_it);
    j->has_deadline = false;
  }
  inflight_bytes_ -= j->inflight_bytes;
  j->inflight_bytes = 0;
  j->ep->jobs--;
  if (j->cancel) cancelling_--;
  // Its keys stay counted: a request may still name them. The Job itself
  // stays allocated (graveyard_) until the worker is destroyed.
  jobs_failed_.fetch_add(1);
  live_jobs_.fetch_sub(1);
  push_job_completion(Completion{EntryKind::kJob, j->id, j->status, j->ucs_status, j->bytes_done, {}});
  auto it = jobs_.find(j->id);
  graveyard_.push_back(std::move(it->second));
  jobs_.erase(it);
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

void Engine::shutdown_all() {
  run_commands();  // nothing can be queued after this: closed_ is set
  for (auto& kv : jobs_) {
    cancel_job(kv.second.get(), Status::kENGINE_CLOSED);
  }
  for (auto& kv : eps_) kv.second->closing = true;
  auto give_up = std::chrono::steady_clock::now() + kShutdownGrace;
  bool forced = false;
  while (true) {
    bool busy = step();
    bool eps_done = true;
    for (auto& kv : eps_) {
      if (!kv.second->close_done && kv.second->handle != nullptr) eps_done = false;
    }
    if (jobs_.empty() && eps_done) break;
    auto now = std::chrono::steady_clock::now();
    if (now >= give_up) {
      if (forced) break;
      // Peers that do not answer must not hold close() forever.
      for (auto& kv : eps_) {
        kv.second->broken = true;
        kv.second->force_after = now;
        close_endpoint(kv.second.get(), true);  // no-op where a close is already posted
      }
      forced = true;
      give_up = now + std::chrono::seconds(1);
    }
    if (!busy) {
      epoll_event ev;
      ::epoll_wait(epfd_, &ev, 1, 1);
    }
  }
  // From here UCX callbacks only free their requests (see on_data_done);
  // objects they point at stay allocated until close() destroyed the worker.
  destroying_ = true;
  bool clean = jobs_.empty();
  for (auto& kv : jobs_) {
    // Could not be drained: report it released anyway, so Python never
    // waits forever. Its UCX requests die with the worker.
    Job* j = kv.second.get();
    if (j->phase == Phase::kDone) continue;
    j->phase = Phase::kDone;
    jobs_failed_.fetch_add(1);
    live_jobs_.fetch_sub(1);
    push_job_completion(
        Completion{EntryKind::kJob, j->id, Status::kENGINE_CLOSED, j->ucs_status, j->bytes_done, {}});
  }
  for (auto& kv : rkeys_) {
    RemoteKey* rk = kv.second.get();
    auto eit = eps_.find(rk->ep_id);
    bool ep_gone = eit == eps_.end() || eit->second->close_done || eit->second->handle == nullptr;
    // A key whose endpoint still has operations outstanding is leaked: UCX
    // wants keys destroyed only after their operations.
    if (rk->handle != nullptr && (clean || ep_gone)) ucp_rkey_destroy(rk->handle);
    rk->handle = nullptr;
  }
  n_eps_ = 0;
}

}  // namespace akv
