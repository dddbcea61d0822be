// Endpoints to peers: connecting, and every way one ends (disconnect, a
// local or UCX-reported failure, a forced close).
#include <vector>

#include "engine_internal.hpp"

namespace akv {

// ---------------------------------------------------------------- API side

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

bool Engine::endpoint_closed(uint64_t ep_id) {
  if (closed_.load()) return true;  // close() closed every endpoint
  return call<bool>([this, ep_id]() {
    auto it = eps_.find(ep_id);
    // Closed = UCX reported the close done: nothing more goes out or comes in
    // on it. A failed endpoint gets there by its forced close.
    return it == eps_.end() || (it->second->close_posted && it->second->close_done);
  });
}

// ---------------------------------------------------------- progress thread

void Engine::on_ep_error(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
  auto* ep = static_cast<Endpoint*>(arg);
  // Called inside ucp_worker_progress: record now, act in the main loop.
  if (!ep->broken) {
    ep->broken = true;
    ep->ucs_status = status;
    ep->owner->failed_eps_.push_back(ep);
  }
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

}  // namespace akv
