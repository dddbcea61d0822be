// Endpoints to peers: connecting, and every way one ends (disconnect, a
// local or UCX-reported failure, a forced close).
#include <string>
#include <vector>

#include "engine_internal.hpp"

namespace akv {

// ---------------------------------------------------------------- API side

uint64_t Engine::connect(const std::string& address, bool peer_errors, const NoteKeys& keys) {
  check_open();
  check_worker_address(address, worker_address_);
  if (keys.given()) check_note_keys(keys.send, keys.recv);
  return call<uint64_t>([this, address, peer_errors, keys]() {
    auto ep = std::make_unique<Endpoint>();
    ep->id = next_ep_++;
    ep->owner = this;
    ep->err_handling = peer_errors;
    ucp_ep_params_t p{};
    p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                   UCP_EP_PARAM_FIELD_ERR_HANDLER;
    std::string padded = address;
    padded.append(kAddressPad, '\0');
    p.address = reinterpret_cast<const ucp_address_t*>(padded.data());
    p.err_mode = peer_errors ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
    p.err_handler.cb = &Engine::on_ep_error;
    p.err_handler.arg = ep.get();
    ucs_status_t st = ucp_ep_create(worker_.get(), &p, &ep->handle);
    if (st != UCS_OK) throw UcxFailure("ucp_ep_create", st);
    // Nothing goes on the wire before the wireup handshake is done. The peer
    // creates its endpoint to us when our wireup request arrives, and UCX's
    // TCP transport (1.22 and master, uct_tcp_ep_replace_ep) then hands each
    // connection we opened to that endpoint, dropping the receive buffer of
    // a put it is in the middle of receiving while keeping the put state: the
    // peer's next read of that put dereferences a null buffer (SIGSEGV), its
    // sockets reset, and our transfer fails with LINK_FAILED. The context
    // resolves the remote endpoint at creation (RESOLVE_REMOTE_EP_ID, see the
    // constructor): the request leaves now, and this flush completes only
    // once the peer answered it, its endpoint made. Until then jobs that
    // reach a UCX operation wait (post_job); copies into mapped memory don't.
    ucp_request_param_t fp{};
    fp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    fp.cb.send = &Engine::on_data_done;
    fp.user_data = this;
    ucs_status_ptr_t r = ucp_ep_flush_nbx(ep->handle, &fp);
    // Done at once (nothing to wire up, or a UCX without the option: then
    // nothing waits for the wireup) or failed: nothing to wait for; a failed
    // endpoint fails its jobs itself.
    if (r != nullptr && !UCS_PTR_IS_ERR(r)) {
      auto* ctx = static_cast<RequestCtx*>(r);
      ctx->kind = RequestCtx::kWireup;
      ctx->job = nullptr;
      ctx->ep = nullptr;
      ctx->len = ep->id;
      ctx->batch = nullptr;
      ep->wiring = true;
    }
    uint64_t id = ep->id;
    Endpoint* made = ep.get();
    eps_[id] = std::move(ep);
    stats_.endpoints = eps_.size();
    // In the same command: a link's set-up waited for the progress thread
    // once more for its keys alone.
    if (keys.given()) install_note_keys(made, keys);
    return id;
  });
}

std::vector<uint64_t> Engine::disconnect(uint64_t ep_id) {
  return call<std::vector<uint64_t>>([this, ep_id]() {
    std::vector<uint64_t> live;
    auto it = eps_.find(ep_id);
    if (it == eps_.end()) return live;
    Endpoint* ep = it->second.get();
    ep->closing = true;
    forget_inline_ep(ep_id);
    note_keys_.erase(ep->note_key);  // its notifications are no longer ours to take
    for (auto& kv : jobs_) {
      Job* j = kv.second.get();
      if (j->ep == ep) {
        cancel_job(j, Status::kLINK_FAILED);
        live.push_back(j->id);
      }
    }
    return live;
  });
}

void Engine::set_note_keys(uint64_t ep_id, const std::string& send_key, const std::string& recv_key,
                           uint64_t peer_id) {
  check_note_keys(send_key, recv_key);
  NoteKeys keys{send_key, recv_key, peer_id};
  call<void>([this, ep_id, keys]() {
    auto it = eps_.find(ep_id);
    if (it == eps_.end()) throw InvalidArgument("unknown endpoint id");
    install_note_keys(it->second.get(), keys);
  });
}

void Engine::check_note_keys(const std::string& send_key, const std::string& recv_key) {
  if (send_key.size() != kNoteKeyLen || recv_key.size() != kNoteKeyLen) {
    throw InvalidArgument("notification keys must be " + std::to_string(kNoteKeyLen) + " bytes");
  }
}

void Engine::install_note_keys(Endpoint* ep, const NoteKeys& keys) {
  if (!ep->note_key.empty()) note_keys_.erase(ep->note_key);
  ep->note_header = keys.send;
  ep->note_key = keys.recv;
  ep->heard = std::chrono::steady_clock::now();
  note_keys_[keys.recv] = NoteKey{keys.peer_id, ep->id};
}

double Engine::silent_s(uint64_t ep_id) {
  return call<double>([this, ep_id]() {
    auto it = eps_.find(ep_id);
    if (it == eps_.end() || it->second->note_key.empty()) return -1.0;
    std::chrono::duration<double> d = std::chrono::steady_clock::now() - it->second->heard;
    return d.count();
  });
}

void Engine::heard_from(uint64_t ep_id) {
  auto it = eps_.find(ep_id);
  if (it != eps_.end()) it->second->heard = std::chrono::steady_clock::now();
}

void Engine::keepalive_now(uint64_t ep_id) {
  call<void>([this, ep_id]() {
    auto it = eps_.find(ep_id);
    if (it == eps_.end()) return;
    it->second->ping_due = it->second->ask_echo = true;
    keepalive_due_ = true;
  });
}

void Engine::send_keepalives() {
  auto now = std::chrono::steady_clock::now();
  if (cfg_.keepalive.count() > 0 && now >= next_keepalive_) {
    next_keepalive_ = now + cfg_.keepalive;
    for (auto& kv : eps_) kv.second->ping_due = true;
    keepalive_due_ = true;
  }
  if (!keepalive_due_) return;
  keepalive_due_ = false;
  for (auto& kv : eps_) {
    Endpoint* ep = kv.second.get();
    if (!ep->ping_due) continue;
    // Linked (keyed) and not ending; one at a time, so a frozen peer never
    // grows our send queue. Not before the wireup is done: nothing goes on
    // the wire before (see connect()).
    if (ep->note_header.empty() || ep->closing || ep->broken || ep->close_posted() || ep->handle == nullptr) {
      ep->ping_due = ep->ask_echo = false;
      continue;
    }
    if (ep->wiring || ep->ping_inflight) {
      keepalive_due_ = true;  // later, once it can go
      continue;
    }
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    p.cb.send = &Engine::on_data_done;
    p.user_data = this;
    p.flags = UCP_AM_SEND_FLAG_EAGER | UCP_AM_SEND_FLAG_COPY_HEADER;
    static const uint8_t kPlain = 0, kEcho = 1;
    const uint8_t* flag = ep->ask_echo ? &kEcho : &kPlain;
    ep->ping_due = ep->ask_echo = false;
    ucs_status_ptr_t r = ucp_am_send_nbx(ep->handle, kKeepaliveAmId, ep->note_header.data(),
                                         ep->note_header.size(), flag, 1, &p);
    if (r != nullptr && !UCS_PTR_IS_ERR(r)) {
      auto* ctx = static_cast<RequestCtx*>(r);
      ctx->kind = RequestCtx::kKeepalive;
      ctx->job = nullptr;
      ctx->ep = nullptr;
      ctx->len = ep->id;
      ctx->batch = nullptr;
      ep->ping_inflight = true;
    }
    // An error: the endpoint's failure is reported through its handler (or
    // the link's other traffic); the peer stays unheard until then.
  }
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
  if (closed_.load()) return true;    // close() finished: every endpoint is gone
  if (commands_.closed()) return false;  // close() is still draining them
  try {
    return endpoint_closed_now(ep_id);
  } catch (const ClosedError&) {
    return closed_.load();  // close() began meanwhile
  }
}

bool Engine::endpoint_unproven(uint64_t ep_id) {
  if (closed_.load()) return false;
  if (commands_.closed()) return true;  // close() is still draining it
  try {
    return call<bool>([this, ep_id]() {
      auto it = eps_.find(ep_id);
      if (it != eps_.end()) return it->second->unproven && !it->second->close_done();
      for (const auto& ep : ep_graveyard_) {
        if (ep->id == ep_id) return ep->unproven && !ep->close_done();
      }
      return false;
    });
  } catch (const ClosedError&) {
    return !closed_.load();
  }
}

bool Engine::endpoint_closed_now(uint64_t ep_id) {
  return call<bool>([this, ep_id]() {
    // Closed = UCX reported the close done: nothing more goes out or comes in
    // on it. A record retired while its close was stuck (a frozen peer) is
    // not closed until that close completes, however long it takes.
    auto it = eps_.find(ep_id);
    if (it != eps_.end()) return it->second->close_done();
    for (const auto& ep : ep_graveyard_) {
      if (ep->id == ep_id) return ep->close_done();
    }
    return true;
  });
}

// ---------------------------------------------------------- progress thread

void Engine::wired(uint64_t ep_id) {
  // Whatever the flush's status: a failed endpoint fails its parked jobs
  // (endpoint_failed), and posting them only finds that out.
  auto it = eps_.find(ep_id);
  if (it == eps_.end()) return;  // retired: no job was left on it
  Endpoint* ep = it->second.get();
  ep->wiring = false;
  for (Job* j : ep->parked) {
    j->parked = false;
    j->in_active = true;
    active_.push_back(j);
  }
  ep->parked.clear();
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

void Engine::endpoint_failed(Endpoint* ep, ucs_status_t st) {
  ep->broken = true;
  forget_inline_ep(ep->id);  // its transfers fail on the job path from now
  if (ep->ucs_status == 0) ep->ucs_status = st;
  stats_.endpoint_errors.fetch_add(1);
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
  if (ep->close_posted() || ep->handle == nullptr) return;
  forget_inline_ep(ep->id);
  ep->begin_close(std::chrono::steady_clock::now(), kCancelGrace, force);
  if (force) any_forced_ = true;
  // Keys go before their endpoint, once no request uses them. Those that
  // requests still name go as those requests complete (op_done) or, for a
  // forced close, right after it purged them (below).
  destroy_idle_keys(ep);
  // UCX accepts FORCE only on endpoints with peer-failure handling; on the
  // others it refuses it and closes nothing. There the close flushes: the
  // endpoint goes once what it holds completes or fails.
  bool hard = force && ep->err_handling;
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  p.cb.send = &Engine::on_data_done;
  p.user_data = this;
  p.flags = hard ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  ucs_status_ptr_t r = ucp_ep_close_nbx(ep->handle, &p);
  if (r == nullptr || UCS_PTR_IS_ERR(r)) {
    ep->close_finished();
  } else {
    auto* ctx = static_cast<RequestCtx*>(r);
    ctx->kind = RequestCtx::kClose;
    ctx->job = nullptr;
    ctx->ep = ep;
    ctx->len = 0;
  }
  // A forced close purges inside ucp_ep_close_nbx (callbacks included) and
  // may destroy the endpoint before returning: keys the purged requests
  // named can only go now. UCX has no way to end an endpoint's requests
  // without closing it, so this is the one order that cannot be kept.
  if (hard) destroy_idle_keys(ep);
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
    if (ep->ending() && !ep->close_posted()) {
      bool forced = ep->broken && now >= ep->force_after;
      if (ep->jobs == 0 || forced) close_endpoint(ep, ep->broken);
    }
    bool done = ep->close_done();
    // A disconnect whose close a frozen peer never lets complete (its flush
    // waits for the peer) must not keep the record forever. No job uses the
    // endpoint any more, and UCX offers no second, forced close of an
    // endpoint already closing: the record retires, and the close request,
    // whose callback names it, keeps it allocated until the worker goes.
    // A broken endpoint goes like a disconnected one: Python may keep its
    // link (a peer that force-unlinked us), but the record serves nothing.
    bool ending = ep->ending();
    bool stuck = ending && ep->close_posted() && !ep->close_done() && ep->jobs == 0 && now >= ep->close_by;
    if ((done || stuck) && ep->jobs == 0) {
      destroy_idle_keys(ep);  // normally none left: see close_endpoint()
      if (ending) {
        note_keys_.erase(ep->note_key);
        for (RemoteKey* rk : ep->rkeys) rkeys_.erase(rk->id);
        ep->rkeys.clear();
        confirm(ep, ep->unconfirmed);  // the record goes, and its count with it
        if (!done) ep_graveyard_.push_back(std::move(it->second));
        it = eps_.erase(it);
        stats_.endpoints = eps_.size();
        continue;
      }
    }
    ++it;
  }
}

}  // namespace akv
