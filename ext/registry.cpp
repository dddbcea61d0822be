// Memory regions of this process and remote keys to peers' regions.
#include <algorithm>
#include <iterator>

#include "engine_internal.hpp"
#include "fault_guard.hpp"

namespace akv {
// ---------------------------------------------------------------- API side

std::pair<uint64_t, uint64_t> Engine::mem_alloc(uint64_t len) {
  return call<std::pair<uint64_t, uint64_t>>([this, len]() {
    auto r = std::make_unique<Region>(map_region(context_.get(), nullptr, len, true));
    r->id = next_region_++;
    auto out = std::make_pair(r->id, reinterpret_cast<uint64_t>(r->addr));
    regions_[r->id] = std::move(r);
    count_regions();
    return out;
  });
}

uint64_t Engine::mem_register(uint64_t addr, uint64_t len) {
  if (addr == 0) throw InvalidArgument("address must not be 0");
  return call<uint64_t>([this, addr, len]() {
    auto r = std::make_unique<Region>(map_region(context_.get(), reinterpret_cast<void*>(addr), len, false));
    r->id = next_region_++;
    uint64_t id = r->id;
    regions_[id] = std::move(r);
    count_regions();
    return id;
  });
}

void Engine::mem_release(uint64_t region_id) {
  call<void>([this, region_id]() {
    auto it = regions_.find(region_id);
    if (it == regions_.end()) throw InvalidArgument("unknown region id");
    if (it->second->quarantined) throw InvalidArgument("region is quarantined until close");
    regions_.erase(it);  // unmaps it
    count_regions();
  });
}

void Engine::mem_quarantine(uint64_t region_id) {
  call<void>([this, region_id]() {
    auto it = regions_.find(region_id);
    if (it == regions_.end()) throw InvalidArgument("unknown region id");
    // Its registration stays: UCX's free would unmap the addresses, which
    // must not be handed out again while a late write could reach them.
    // close() unregisters it after the worker (and its sockets) went.
    if (it->second->quarantined) return;
    quarantine_region(*it->second);
    ++n_quarantined_;
    stats_.quarantined_bytes += it->second->span;
    count_regions();
  });
}

void Engine::count_regions() { stats_.regions = regions_.size() - n_quarantined_; }

std::string Engine::rkey_pack(uint64_t region_id) {
  return call<std::string>([this, region_id]() {
    auto it = regions_.find(region_id);
    if (it == regions_.end()) throw InvalidArgument("unknown region id");
    return pack_rkey(context_.get(), *it->second);
  });
}

uint64_t Engine::rkey_unpack(uint64_t ep_id, const std::string& key, uint64_t base, uint64_t len) {
  check_open();
  // A peer chose these bytes: walked with bounds, and padded, before UCX
  // reads them (peer_input.hpp).
  check_packed_rkey(key);
  uint8_t* mapped_at = nullptr;
  uint64_t key_id = call<uint64_t>([this, ep_id, packed = padded_rkey(key), base, len, &mapped_at]() {
    auto it = eps_.find(ep_id);
    if (it == eps_.end()) throw InvalidArgument("unknown endpoint id");
    Endpoint* ep = it->second.get();
    if (ep->broken || ep->closing || ep->handle == nullptr) {
      throw Error("endpoint is broken or closing");
    }
    if (base + len < base) throw PeerInput("remote region wraps around the address space");
    auto rk = std::make_unique<RemoteKey>();
    ucs_status_t st = ucp_ep_rkey_unpack(ep->handle, packed.data(), rk->handle.out());
    if (st != UCS_OK) throw UcxFailure("ucp_ep_rkey_unpack", st);
    // A key that maps (same-host shared memory) is checked whether or not
    // direct copy is on: UCX's own shm lanes copy through that mapping too.
    // The check needs /proc/self/maps from just before the unpack, and
    // reading it cost about 1 ms a key (a Python process maps some thousand
    // ranges): most keys never map (tcp, rdma), so the key is unpacked once
    // to learn whether it does, and only one that does is dropped (which
    // unmaps its segment) and unpacked again between the two readings.
    void* mapped = nullptr;
    if (len > 0 && ucp_rkey_ptr(rk->handle.get(), base, &mapped) == UCS_OK) {
      rk->handle.reset();
      std::vector<Vma> before = read_maps();
      st = ucp_ep_rkey_unpack(ep->handle, packed.data(), rk->handle.out());
      if (st != UCS_OK) throw UcxFailure("ucp_ep_rkey_unpack", st);
      mapped = nullptr;
      if (ucp_rkey_ptr(rk->handle.get(), base, &mapped) != UCS_OK ||
          !mapping_covers(before, static_cast<uint8_t*>(mapped), len)) {
        throw PeerInput("remote key does not cover the claimed region (base, length)");
      }
      // Then a transfer is one memcpy on the progress thread, whatever lane
      // UCX would have picked.
      if (cfg_.direct_copy) rk->mapped = static_cast<uint8_t*>(mapped);
      mapped_at = static_cast<uint8_t*>(mapped);
    }
    rk->id = next_rkey_++;
    rk->ep_id = ep_id;
    rk->base = base;
    rk->len = len;
    ep->rkeys.push_back(rk.get());
    uint64_t id = rk->id;
    if (rk->mapped != nullptr) {
      std::lock_guard<std::mutex> lk(inline_mu_);
      inline_keys_[id] = InlineKey{ep_id, rk->mapped, base, len};
    }
    rkeys_[id] = std::move(rk);
    return id;
  });
  // The peer's pages in our page tables now, on the caller's thread (the
  // progress thread carries on): a first transfer faulted each of them in.
  if (cfg_.prefault && mapped_at != nullptr) prefault(mapped_at, len, Prefault::kMapped);
  return key_id;
}

void Engine::rkey_release(uint64_t rkey_id) {
  call<void>([this, rkey_id]() {
    auto it = rkeys_.find(rkey_id);
    if (it == rkeys_.end()) return;
    forget_inline(rkey_id);  // Python let go: no new copy through it
    it->second->released = true;
    if (it->second->users == 0) destroy_rkey(it->second.get());
  });
}

// ---------------------------------------------------------- progress thread

void Engine::forget_inline(uint64_t rkey_id) {
  std::lock_guard<std::mutex> lk(inline_mu_);
  inline_keys_.erase(rkey_id);
}

void Engine::forget_inline_ep(uint64_t ep_id) {
  std::lock_guard<std::mutex> lk(inline_mu_);
  for (auto it = inline_keys_.begin(); it != inline_keys_.end();) {
    it = it->second.ep_id == ep_id ? inline_keys_.erase(it) : std::next(it);
  }
}

int Engine::copy_inline(Op op, uint64_t ep_id, const std::vector<std::vector<SegmentIn>>& jobs,
                        uint64_t max_bytes, const GuardIn& guard) {
  check_open();
  std::lock_guard<std::mutex> lk(inline_mu_);
  // Every segment first: all of it moves, or none.
  uint64_t total = 0;
  for (const auto& segs : jobs) {
    for (const SegmentIn& s : segs) {
      if (s.len == 0) continue;
      auto it = inline_keys_.find(s.rkey_id);
      if (it == inline_keys_.end() || it->second.ep_id != ep_id) return kInlineNo;
      const InlineKey& k = it->second;
      if (!segment_fits(s, k.base, k.len)) return kInlineNo;
      total += s.len;
      if (total > max_bytes) return kInlineNo;
    }
  }
  // Our SIGBUS handler on top (a sigaction query, about 0.4 us): on every
  // 64th inline copy, not on each, which would cost the small-transfer path
  // a fifth of its time; the job path checks it every step.
  if ((stats_.inline_copies.load(std::memory_order_relaxed) & 63) == 0) install_fault_guard();
  bool faulted = false;
  if (guard.rkey_id != 0) {
    auto it = inline_keys_.find(guard.rkey_id);
    SegmentIn word{0, guard.addr, sizeof(uint64_t), guard.rkey_id};
    if (it == inline_keys_.end() || it->second.ep_id != ep_id || !segment_fits(word, it->second.base, it->second.len)) {
      return kInlineNo;
    }
    uint64_t v = 0;
    const InlineKey& k = it->second;
    faulted = !guarded_load(reinterpret_cast<volatile uint64_t*>(k.mapped + (guard.addr - k.base)), &v);
    if (!faulted && v != guard.expect) return kInlineRetired;
  }
  for (const auto& segs : jobs) {
    for (const SegmentIn& s : segs) {
      if (s.len == 0) continue;
      const InlineKey& k = inline_keys_.find(s.rkey_id)->second;
      uint8_t* peer = k.mapped + (s.remote - k.base);
      auto* local = reinterpret_cast<uint8_t*>(s.local);
      bool copied = !faulted && (op == Op::kPut ? guarded_copy(peer, local, s.len) : guarded_copy(local, peer, s.len));
      if (!copied) inline_fault(ep_id);
    }
  }
  // Visible before anything the caller does next (a notification, a reply).
  std::atomic_thread_fence(std::memory_order_seq_cst);
  stats_.bytes_direct.fetch_add(total);
  (op == Op::kPut ? stats_.bytes_put : stats_.bytes_get).fetch_add(total);
  stats_.inline_copies.fetch_add(1);
  return kInlineCopied;
}

void Engine::inline_fault(uint64_t ep_id) {
  // The peer shrank the memory under its key: no copy through its keys
  // from here on, and its endpoint fails on the progress thread.
  stats_.copy_faults.fetch_add(1);
  for (auto it = inline_keys_.begin(); it != inline_keys_.end();) {
    it = it->second.ep_id == ep_id ? inline_keys_.erase(it) : std::next(it);
  }
  try {
    commands_.post([this, ep_id]() {
      auto eit = eps_.find(ep_id);
      if (eit != eps_.end() && !eit->second->broken) endpoint_failed(eit->second.get(), UCS_ERR_IO_ERROR);
    });
  } catch (const ClosedError&) {
  }
  throw Error("the peer's memory went away under a copy (its segment shrank)");
}

void Engine::release_key_handle(RemoteKey* rk) {
  if (rk->handle == nullptr || rk->pinned) return;
  forget_inline(rk->id);  // before the mapping goes
  rk->handle.reset();  // unmaps a mapped segment, too
  rk->mapped = nullptr;
}

bool Engine::key_busy(const RemoteKey* rk) const {
  if (rk->pinned) return true;
  if (rk->users == 0) return false;
  for (const auto& kv : jobs_) {
    const Job* j = kv.second.get();
    bool busy = j->inflight_ops > 0 || j->lane_ops > 0;  // lanes copy through the mapping
    if (busy && std::find(j->keys.begin(), j->keys.end(), rk) != j->keys.end()) return true;
  }
  return false;
}

void Engine::destroy_idle_keys(Endpoint* ep) {
  // UCX: a key goes after the operations that use it are flushed, and before
  // the endpoint it was unpacked on is destroyed.
  for (RemoteKey* rk : ep->rkeys) {
    if (rk->handle != nullptr && !key_busy(rk)) release_key_handle(rk);
  }
}

void Engine::destroy_rkey(RemoteKey* rk) {
  release_key_handle(rk);
  if (!rk->released) return;  // Python still holds the id; the record stays
  auto eit = eps_.find(rk->ep_id);
  if (eit != eps_.end()) {
    auto& v = eit->second->rkeys;
    v.erase(std::remove(v.begin(), v.end(), rk), v.end());
  }
  rkeys_.erase(rk->id);
}

}  // namespace akv
