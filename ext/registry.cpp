// Memory regions of this process and remote keys to peers' regions.
#include <algorithm>

#include "engine_internal.hpp"

namespace akv {

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

// ---------------------------------------------------------- progress thread

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

}  // namespace akv
