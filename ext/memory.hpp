// Memory regions known to UCX: allocated by UCX (shareable with same-host
// peers through posix shared memory) or registered user memory.
#pragma once

#include <ucp/api/ucp.h>

#include <cstdint>
#include <string>

#include "errors.hpp"
#include "ucx_handles.hpp"

namespace akv {

struct Region {
  uint64_t id = 0;
  UcxMemHandle memh;  // unmapped when the region goes
  void* addr = nullptr;
  uint64_t len = 0;
  // What UCX reports it mapped for an allocated region (it may round the
  // length up, e.g. to whole huge pages); len for registered memory.
  uint64_t span = 0;
  bool allocated = false;
  // Retired with a peer that may still write it: its pages went back to the
  // system; its mapping stays (zero pages that take late writes) until the
  // worker (every connection that could carry one) is gone.
  bool quarantined = false;
};

// Throw UcxFailure when UCX refuses, InvalidArgument for a zero length.
Region map_region(ucp_context_h ctx, void* addr, uint64_t len, bool allocate);
// Give an allocated region's pages back, keeping its mapping (and UCX's
// registration) in place: its addresses read zeros and take late writes
// until close() unmaps them (see Region::quarantined).
void quarantine_region(Region& r);
std::string pack_rkey(ucp_context_h ctx, const Region& r);
// What prefault() faults in.
enum class Prefault : uint8_t {
  kAllocated,  // memory just allocated (zeros): its pages are made
  kUser,       // memory of the user's: its pages made writable, nothing written
  kMapped,     // our mapping of a peer's shared memory: the pages the peer made
               // (resident; never a hole: that would allocate it), first 2 GiB
};

// Fault in every page of [addr, addr + len): a region's first transfer
// otherwise faults each page in on both sides, 15-40x slower than the next.
// MADV_POPULATE_WRITE makes pages (kAllocated, kUser; a kernel before 5.14
// has a kAllocated region's zeros written instead); MADV_POPULATE_READ maps
// a peer's shared pages, writable (2.4x faster than _WRITE here, 52 against
// 125 ms for 512 MiB). False when nothing could be done.
bool prefault(void* addr, uint64_t len, Prefault what);

}  // namespace akv
