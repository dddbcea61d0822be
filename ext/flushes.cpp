// Flushes: the one a put waits for before it is reported (shared by the
// jobs of an endpoint that reach it in one step), and the window flushes
// that confirm an endpoint's put bytes (EngineConfig::max_unconfirmed_bytes).
#include <algorithm>

#include "engine_internal.hpp"

namespace akv {

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

void Engine::add_unconfirmed(Endpoint* ep, uint64_t n) {
  ep->unconfirmed += n;
  unconfirmed_ += n;
  stats_.unconfirmed_bytes.store(unconfirmed_, std::memory_order_relaxed);
}

void Engine::confirm(Endpoint* ep, uint64_t n) {
  n = std::min(n, ep->unconfirmed);
  ep->unconfirmed -= n;
  unconfirmed_ -= n;
  // Before the completions this confirmation lets through are queued.
  stats_.unconfirmed_bytes.store(unconfirmed_, std::memory_order_relaxed);
}

void Engine::post_window_flush(Endpoint* ep) {
  if (ep->window_flush || ep->unflushed == 0 || ep->broken || ep->handle == nullptr ||
      ep->close_posted()) {
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

}  // namespace akv
