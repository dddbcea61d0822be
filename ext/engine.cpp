// The engine's life: UCX context and worker setup, introspection, and
// close(), which drains the progress thread and tears everything down.
#include <sys/epoll.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>

#include "engine_internal.hpp"
#include "fault_guard.hpp"

namespace akv {
namespace {

// UCX's TLS for transport ``t`` (transports.def); nullptr: UCX's own choice.
const char* transport_list(const std::string& t) {
  std::string names;
#define AKV_TRANSPORT(name, tls, means, use_when)  \
  if (t == #name) return *(tls) ? (tls) : nullptr; \
  names += names.empty() ? #name : ", " #name;
#include "transports.def"
#undef AKV_TRANSPORT
  throw InvalidArgument("transport must be one of " + names + ", not '" + t + "'");
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
  init_context(read_config());
  init_worker();
  init_wakeup();
  if (cfg_.prewarm) prewarm();
  // Copies through peers' mappings survive a peer that shrinks its segment.
  install_fault_guard();
  start_threads();
}

// The context's configuration: UCX's defaults and environment, the
// transport, our defaults, the caller's ucx_options.
UcxConfig Engine::read_config() {
  const char* tls = transport_list(cfg_.transport);

  UcxConfig owned_config;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, owned_config.out());
  if (st != UCS_OK) throw UcxFailure("ucp_config_read", st);
  ucp_config_t* config = owned_config.get();
  // Transport choice lives in this context's config, not the process env, so
  // several engines in one process can differ.
  if (tls != nullptr) st = ucp_config_modify(config, "TLS", tls);
  // UCX's TCP connect is blocking by default: to a host that vanished it
  // holds the progress thread for the whole SYN timeout (minutes), and with
  // it every deadline and cancel. Non-blocking, a failed connect is an
  // endpoint error like any other. (Caller options below may override.)
  if (st == UCS_OK) st = ucp_config_modify(config, "TCP_CONN_NB", "y");
  // UCX binds a TCP endpoint's source address to the interface of the
  // default route: on a multi-homed host (a namespace reached over a veth
  // while eth0 has the default route) the SYN then leaves with an address
  // the peer cannot answer. Unbound, the kernel picks the route's own
  // address. Only where this UCX knows the option (1.22 does; older ones
  // answer INVALID_PARAM and keep their behaviour), and caller options below
  // still win.
  // Our defaults, each best effort; the caller's choice (ucx_options or
  // the UCX_* environment) stands, since UCX would otherwise keep both.
  auto default_option = [&](const std::string& name, const char* value) {
    bool caller_set = std::getenv(("UCX_" + name).c_str()) != nullptr;
    for (const auto& kv : cfg_.ucx_options) caller_set = caller_set || kv.first == name;
    if (st == UCS_OK && !caller_set) (void)ucp_config_modify(config, name.c_str(), value);
  };
  default_option("TCP_EP_BIND_SRC_ADDR", "n");
  // An endpoint sends its wireup request when it is created, not with its
  // first active message, so connect() can wait for the peer's answer before
  // any put goes out (see Engine::connect).
  default_option("RESOLVE_REMOTE_EP_ID", "y");
  // A name starting with '?' is best effort: set where this UCX build has
  // it (IB_* options without the IB transport module are unknown to UCX).
  std::string bad;
  for (const auto& kv : cfg_.ucx_options) {
    if (st != UCS_OK) break;
    bool optional = !kv.first.empty() && kv.first[0] == '?';
    std::string name = optional ? kv.first.substr(1) : kv.first;
    st = ucp_config_modify(config, name.c_str(), kv.second.c_str());
    if (st != UCS_OK && optional) st = UCS_OK;
    if (st != UCS_OK) bad = name;
  }
  if (st != UCS_OK) throw InvalidArgument("bad UCX option " + bad + ": " + ucs_status_string(st));
  return owned_config;
}

void Engine::init_context(UcxConfig owned_config) {
  ucp_config_t* config = owned_config.get();
  config_text_ = capture([config](FILE* f) { ucp_config_print(config, f, "", UCS_CONFIG_PRINT_CONFIG); });

  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_REQUEST_SIZE |
                      UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  params.request_size = sizeof(RequestCtx);
  params.mt_workers_shared = 0;
  ucs_status_t st = ucp_init(&params, config, context_.out());
  owned_config.reset();
  if (st != UCS_OK) {
    throw UcxFailure("ucp_init (transport " + cfg_.transport + ")", st);
  }

  if (cfg_.transport == "rdma") {
    // UCX falls back to what it has (and only warns); an "rdma" engine
    // without a verbs transport would silently be useless.
    std::string resources = capture([this](FILE* f) { ucp_context_print_info(context_.get(), f); });
    bool verbs = resources.find("/rc_") != std::string::npos || resources.find("/ud_") != std::string::npos ||
                 resources.find("/dc_") != std::string::npos || resources.find("rc_verbs") != std::string::npos ||
                 resources.find("ud_verbs") != std::string::npos;
    if (!verbs) {
      throw Error(
          "no RDMA (verbs) transport in this UCX; set RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true to use a "
          "system UCX built with verbs");
    }
  }
}

// The worker, its address, and the handlers of our active messages.
void Engine::init_worker() {
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  ucs_status_t st = ucp_worker_create(context_.get(), &wp, worker_.out());
  if (st != UCS_OK) throw UcxFailure("ucp_worker_create", st);

  ucp_worker_attr_t attr{};
  attr.field_mask = UCP_WORKER_ATTR_FIELD_ADDRESS;
  st = ucp_worker_query(worker_.get(), &attr);
  if (st != UCS_OK) throw UcxFailure("ucp_worker_query", st);
  worker_address_.assign(reinterpret_cast<const char*>(attr.address), attr.address_length);
  ucp_worker_release_address(worker_.get(), attr.address);

  ucp_am_handler_param_t am{};
  am.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                  UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
  am.id = kAmId;
  am.cb = &Engine::on_am;
  am.arg = this;
  am.flags = UCP_AM_FLAG_WHOLE_MSG;
  st = ucp_worker_set_am_recv_handler(worker_.get(), &am);
  if (st != UCS_OK) throw UcxFailure("ucp_worker_set_am_recv_handler", st);
  am.id = kKeepaliveAmId;
  am.cb = &Engine::on_keepalive;
  st = ucp_worker_set_am_recv_handler(worker_.get(), &am);
  if (st != UCS_OK) throw UcxFailure("ucp_worker_set_am_recv_handler", st);
}

// What the progress thread sleeps on: the worker's wake-ups and commands.
void Engine::init_wakeup() {
  release_efd_ = UniqueFd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (release_efd_.get() < 0) throw Error("eventfd failed");
  ucs_status_t st = ucp_worker_get_efd(worker_.get(), &worker_efd_);
  if (st != UCS_OK) throw UcxFailure("ucp_worker_get_efd", st);
  epfd_ = UniqueFd(::epoll_create1(EPOLL_CLOEXEC));
  if (epfd_.get() < 0) throw Error("eventfd/epoll_create1 failed");
  for (int fd : {worker_efd_, commands_.fd()}) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    if (::epoll_ctl(epfd_.get(), EPOLL_CTL_ADD, fd, &ev) != 0) throw Error("epoll_ctl failed");
  }
}

void Engine::start_threads() {
  if (cfg_.copy_lanes == 0) {
    unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    cfg_.copy_lanes = std::clamp(cores / 2, 1u, 8u);
  }
  // The progress thread is the first lane; the others are lane threads.
  lanes_.start(cfg_.copy_lanes - 1, [this] {
    commands_.wake_if_sleeping();
  });
  progress_.start([this] { run(); });
}

Engine::~Engine() { close(); }

void Engine::check_open() const {
  if (commands_.closed()) throw ClosedError();
}

std::vector<Completion> Engine::counted(std::vector<Completion>&& items) {
  uint64_t notes = 0;
  for (const Completion& c : items) notes += c.kind == EntryKind::kNotify ? 1 : 0;
  if (notes != 0) notes_queued_.fetch_sub(notes);
  return std::move(items);
}

// ---------------------------------------------------------------- API side

EngineStats Engine::stats() const { return stats_.snapshot(); }

std::string Engine::info() {
  return call<std::string>([this]() {
    return capture([this](FILE* f) {
      ucp_context_print_info(context_.get(), f);
      ucp_worker_print_info(worker_.get(), f);
    });
  });
}

void Engine::close() {
  {
    std::lock_guard<std::mutex> lk(close_mu_);
    if (!commands_.close()) return;
    progress_.request_stop();
    commands_.wake();
    progress_.join();
    lanes_.stop();  // shutdown_all() did; a no-op then
  }
  epfd_.reset();
  commands_.release_fd();
  worker_.reset();
  {
    // shutdown_all() reported every job already; this only makes sure no
    // waiter outlives close(): with the worker gone nothing touches a buffer.
    std::lock_guard<std::mutex> lk(live_mu_);
    live_ids_.clear();
  }
  live_cv_.notify_all();
  signal_release(true);
  {
    // Its watcher's dup still sees that last write; the engine's own
    // descriptor goes now, not with the object (finalized instances that
    // live on until a garbage collection held one each).
    std::lock_guard<std::mutex> lk(release_mu_);
    release_efd_.reset();
  }
  // Only now: requests that outlived shutdown pointed at these.
  jobs_.clear();
  graveyard_.clear();
  ep_graveyard_.clear();
  active_.clear();
  touched_.clear();
  flush_eps_.clear();
  failed_eps_.clear();
  rkeys_.clear();
  eps_.clear();
  regions_.clear();  // unmaps them, quarantined ones included
  stats_.regions = 0;
  n_quarantined_ = 0;
  stats_.quarantined_bytes = 0;
  context_.reset();
  // Only now is the engine closed: until here the progress thread drained
  // and peers' bytes could still land in registered memory.
  closed_.store(true);
}

// ---------------------------------------------------------- progress thread

void Engine::shutdown_all() {
  commands_.run();  // nothing can be queued after this: the queue is closed
  {
    // No copy_inline from here on (they also check closing() first).
    std::lock_guard<std::mutex> lk(inline_mu_);
    inline_keys_.clear();
  }
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
      if (!kv.second->close_done() && kv.second->handle != nullptr) eps_done = false;
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
      ::epoll_wait(epfd_.get(), &ev, 1, 1);
    }
  }
  // No lane copies a byte past this point (before any key unmaps below).
  lanes_.stop();
  // From here UCX callbacks only free their requests (see on_data_done);
  // objects they point at stay allocated until close() destroyed the worker.
  destroying_ = true;
  release_leftovers();
  stats_.endpoints = 0;
}

// What shutdown could not drain: jobs reported released anyway, keys
// destroyed where UCX allows it.
void Engine::release_leftovers() {
  bool clean = jobs_.empty();
  for (auto& kv : jobs_) {
    // Could not be drained: report it released anyway, so Python never
    // waits forever. Its UCX requests die with the worker.
    Job* j = kv.second.get();
    if (j->phase == Phase::kDone) continue;
    j->phase = Phase::kDone;
    stats_.jobs_failed.fetch_add(1);
    stats_.live_jobs.fetch_sub(1);
    push_job_completion(
        Completion{EntryKind::kJob, j->id, Status::kENGINE_CLOSED, j->ucs_status, j->bytes_done, {},
                               j->posted_ns, monotonic_ns()});
  }
  for (auto& kv : rkeys_) {
    RemoteKey* rk = kv.second.get();
    auto eit = eps_.find(rk->ep_id);
    bool ep_gone = eit == eps_.end() || eit->second->close_done() || eit->second->handle == nullptr;
    // A key whose endpoint still has operations outstanding is leaked: UCX
    // wants keys destroyed only after their operations.
    if (clean || ep_gone) release_key_handle(rk);  // a pinned key stays: see RemoteKey
    (void)rk->handle.release();  // one still held here is never destroyed: see above
    rk->mapped = nullptr;
  }
}

}  // namespace akv
