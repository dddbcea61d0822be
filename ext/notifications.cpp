// What arrives as active messages: notifications for Python and keep-alives,
// each attributed by the link key in its header.
#include <string>

#include "engine_internal.hpp"

namespace akv {

ucs_status_t Engine::on_am(void* arg, const void* header, size_t header_length, void* data,
                           size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<Engine*>(arg);
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) {
    // Our peers send notifications eagerly; anything else is dropped
    // (returning UCS_OK releases a rendezvous descriptor).
    self->stats_.notifications_dropped.fetch_add(1);
    return UCS_OK;
  }
  // Attributed by the key in its header, which only the link's peer knows;
  // anything else (no key, an unknown or retired one) is dropped.
  const NoteKey* key = self->keyed(header, header_length);
  if (key == nullptr) {
    self->stats_.notifications_dropped.fetch_add(1);
    return UCS_OK;
  }
  if (self->notes_queued_.load() >= kMaxQueuedNotes) {
    self->stats_.notifications_dropped.fetch_add(1);
    return UCS_OK;
  }
  self->stats_.notifications_received.fetch_add(1);
  self->notes_queued_.fetch_add(1);
  // posted_ns carries the endpoint it arrived on: a link made anew since
  // (the peer restarted) is another endpoint, whatever the cluster id says.
  self->cq_.push(Completion{EntryKind::kNotify, key->peer_id, Status::kOK, 0, length,
                            std::string(static_cast<const char*>(data), length), key->ep_id});
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

}  // namespace akv
