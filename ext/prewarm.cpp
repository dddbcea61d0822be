// The warm-up at start: one endpoint of ours to a helper worker of the same
// context, used once for each operation a link uses, then closed.
//
// UCX selects protocols per endpoint configuration (the lanes an endpoint to
// a peer with such resources gets) and per remote-key configuration, and
// caches the choice in the worker. Selecting them the first time is most of
// what a link costs: UCX 1.22's TCP transport re-reads every interface's
// capabilities (sysfs, the route table) for each candidate, some 6000 system
// calls and 40-50 ms of the progress thread's CPU here, against 8-10 ms for
// every later link. The helper is a peer on this host with this context's
// resources, so a first real peer on this host (and any with the same
// devices) finds its configurations made. Best effort: whatever fails or
// takes too long leaves the engine exactly as it would be without it.
#include <dirent.h>
#include <sys/resource.h>

#include <chrono>
#include <cstring>
#include <new>

#include "engine_internal.hpp"

namespace akv {

namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kPrewarmBudget = std::chrono::seconds(2);
// After a cancel, how long a request may take to end before it is left.
constexpr auto kCancelGrace = std::chrono::seconds(1);

ucs_status_t am_sink(void*, const void*, size_t, void*, size_t, const ucp_am_recv_param_t*) {
  return UCS_OK;  // the helper drops what it is sent
}

void ignore_ep_error(void*, ucp_ep_h, ucs_status_t) {}

class Warmup {
 public:
  Warmup(ucp_context_h ctx, ucp_worker_h ours, bool peer_errors)
      : ctx_(ctx), ours_(ours), peer_errors_(peer_errors), until_(Clock::now() + kPrewarmBudget) {}

  // A request that never ended still names this object's memory, the
  // helper and the endpoint: then nothing here may go (the object leaks).
  bool abandoned() const { return abandoned_; }

  // Our endpoint closed (if a step failed before): after this, if not
  // abandoned, the object may go.
  void finish() {
    if (ep_ != nullptr) close_ep();
  }

  // Only once finish() ran and left nothing pending.
  ~Warmup() {
    if (rkey_ != nullptr) ucp_rkey_destroy(rkey_);
    memh_ = UcxMemHandle();
    helper_.reset();  // after our endpoint to it went
  }

  bool run() {
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;
    if (ucp_worker_create(ctx_, &wp, helper_.out()) != UCS_OK) return false;
    ucp_am_handler_param_t am{};
    am.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                    UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    am.id = kAmId;
    am.cb = &am_sink;
    am.flags = UCP_AM_FLAG_WHOLE_MSG;
    if (ucp_worker_set_am_recv_handler(helper_.get(), &am) != UCS_OK) return false;
    if (!connect() || !wait(ucp_ep_flush_nbx(ep_, &plain_))) return false;
    if (!map_target()) return false;
    std::memset(src_, 1, sizeof(src_));
    uint64_t remote = reinterpret_cast<uint64_t>(dst_);
    // A link's operations: put, get (the probe, pulls, guard words), and
    // notifications (active messages), each small and large enough for the
    // protocols a transfer's chunks take.
    for (size_t n : {sizeof(uint64_t), sizeof(src_)}) {
      if (!wait(ucp_put_nbx(ep_, src_, n, remote, rkey_, &plain_))) return false;
      if (!wait(ucp_get_nbx(ep_, src_, n, remote, rkey_, &plain_))) return false;
    }
    ucp_request_param_t ap{};
    ap.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    ap.flags = UCP_AM_SEND_FLAG_EAGER | UCP_AM_SEND_FLAG_COPY_HEADER;
    uint64_t header = 0;
    if (!wait(ucp_am_send_nbx(ep_, kAmId, &header, sizeof(header), src_, 64, &ap))) return false;
    if (!wait(ucp_ep_flush_nbx(ep_, &plain_))) return false;
    return close_ep();
  }

 private:
  bool connect() {
    ucp_worker_attr_t attr{};
    attr.field_mask = UCP_WORKER_ATTR_FIELD_ADDRESS;
    if (ucp_worker_query(helper_.get(), &attr) != UCS_OK) return false;
    ucp_ep_params_t p{};
    p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                   UCP_EP_PARAM_FIELD_ERR_HANDLER;
    p.address = attr.address;
    // The mode a link's endpoints get (links.py): it is part of the
    // configuration UCX caches.
    p.err_mode = peer_errors_ ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
    p.err_handler.cb = &ignore_ep_error;
    p.err_handler.arg = nullptr;
    ucs_status_t st = ucp_ep_create(ours_, &p, &ep_);
    ucp_worker_release_address(helper_.get(), attr.address);
    if (st != UCS_OK) ep_ = nullptr;
    return st == UCS_OK;
  }

  // The helper's memory, mapped and its key unpacked on our endpoint.
  bool map_target() {
    ucp_mem_map_params_t mp{};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    mp.address = dst_;
    mp.length = sizeof(dst_);
    ucp_mem_h memh = nullptr;
    if (ucp_mem_map(ctx_, &mp, &memh) != UCS_OK) return false;
    memh_ = UcxMemHandle(ctx_, memh);
    void* packed = nullptr;
    size_t size = 0;
    if (ucp_rkey_pack(ctx_, memh, &packed, &size) != UCS_OK) return false;
    ucs_status_t st = ucp_ep_rkey_unpack(ep_, packed, &rkey_);
    ucp_rkey_buffer_release(packed);
    return st == UCS_OK;
  }

  bool close_ep() {
    if (abandoned_) return false;  // a pending request still uses the key and endpoint
    if (rkey_ != nullptr) {
      ucp_rkey_destroy(rkey_);
      rkey_ = nullptr;
    }
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = peer_errors_ ? UCP_EP_CLOSE_FLAG_FORCE : 0;  // FORCE only with peer errors
    ucs_status_ptr_t r = ucp_ep_close_nbx(ep_, &p);
    ep_ = nullptr;
    return wait(r);
  }

  // Progress both workers until ``r`` completes (true: it succeeded). Past
  // the budget the request is cancelled and still waited for: nothing it
  // names may go before it is done.
  bool wait(ucs_status_ptr_t r) {
    if (r == nullptr) return true;
    if (UCS_PTR_IS_ERR(r) || abandoned_) return false;
    bool cancelled = false;
    for (;;) {
      ucp_worker_progress(ours_);
      ucp_worker_progress(helper_.get());
      ucs_status_t st = ucp_request_check_status(r);
      if (st != UCS_INPROGRESS) {
        ucp_request_free(r);
        return st == UCS_OK && !cancelled;
      }
      if (!cancelled && Clock::now() > until_) {
        ucp_request_cancel(ours_, r);
        cancelled = true;
      } else if (cancelled && Clock::now() > until_ + kCancelGrace) {
        abandoned_ = true;
        return false;
      }
    }
  }

  ucp_context_h ctx_;
  ucp_worker_h ours_;
  bool peer_errors_;
  bool abandoned_ = false;
  Clock::time_point until_;
  UcxWorker helper_;
  ucp_ep_h ep_ = nullptr;
  UcxMemHandle memh_;
  ucp_rkey_h rkey_ = nullptr;
  ucp_request_param_t plain_{};
  alignas(64) char src_[16384] = {};
  alignas(64) char dst_[16384] = {};
};

// Descriptors the process may still open. Over tcp the helper opens its own
// listening sockets and connections; one that fails to (EMFILE) leaves UCX
// 1.22's async handlers registered on closed descriptors when the helper is
// destroyed, and a later worker whose descriptor reuses the number fails.
// With too little room the warm-up is not tried.
constexpr long kPrewarmFdRoom = 256;

bool fd_room() {
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0) return false;
  if (lim.rlim_cur == RLIM_INFINITY) return true;
  long open = 0;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (::readdir(d) != nullptr) open++;
    ::closedir(d);
  } else {
    return false;
  }
  return static_cast<long>(lim.rlim_cur) - open >= kPrewarmFdRoom;
}

}  // namespace

// Before the threads start: this thread alone uses the worker.
void Engine::prewarm() noexcept {
  auto t0 = Clock::now();
  bool ok = false;
  if (!fd_room()) return;
  auto* w = new (std::nothrow) Warmup(context_.get(), worker_.get(), cfg_.transport == "rdma");
  if (w != nullptr) {
    try {
      ok = w->run();
      w->finish();
    } catch (...) {
      ok = false;
    }
    if (!w->abandoned()) delete w;  // else UCX may still write into it
  }
  prewarm_ns_ = static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count());
  prewarmed_ = ok;
}

}  // namespace akv
