// Memory regions known to UCX: allocated by UCX (shareable with same-host
// peers through posix shared memory) or registered user memory.
#pragma once

#include <ucp/api/ucp.h>

#include <cstdint>
#include <string>

#include "errors.hpp"

namespace akv {

struct Region {
  uint64_t id = 0;
  ucp_mem_h memh = nullptr;
  void* addr = nullptr;
  uint64_t len = 0;
  bool allocated = false;
};

// Throw UcxFailure when UCX refuses, InvalidArgument for a zero length.
Region map_region(ucp_context_h ctx, void* addr, uint64_t len, bool allocate);
void unmap_region(ucp_context_h ctx, Region& r);
std::string pack_rkey(ucp_context_h ctx, const Region& r);

}  // namespace akv
