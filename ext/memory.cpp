#include "memory.hpp"

#include <sys/mman.h>

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>
#include <vector>

namespace akv {

Region map_region(ucp_context_h ctx, void* addr, uint64_t len, bool allocate) {
  if (len == 0) throw InvalidArgument("region length must be > 0");
  ucp_mem_map_params_t p{};
  p.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                 UCP_MEM_MAP_PARAM_FIELD_FLAGS;
  p.address = allocate ? nullptr : addr;
  p.length = len;
  p.flags = allocate ? UCP_MEM_MAP_ALLOCATE : 0;
  ucp_mem_h raw = nullptr;
  ucs_status_t st = ucp_mem_map(ctx, &p, &raw);
  if (st != UCS_OK) {
    throw UcxFailure("ucp_mem_map failed", st);
  }
  UcxMemHandle memh(ctx, raw);
  ucp_mem_attr_t attr{};
  attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
  st = ucp_mem_query(raw, &attr);
  if (st != UCS_OK) {
    throw UcxFailure("ucp_mem_query failed", st);
  }
  Region r;
  r.memh = std::move(memh);
  r.addr = allocate ? attr.address : addr;
  r.len = len;
  r.span = allocate ? std::max<uint64_t>(len, attr.length) : len;
  r.allocated = allocate;
  return r;
}

void quarantine_region(Region& r) {
  if (!r.allocated) throw InvalidArgument("only engine-allocated regions can be quarantined");
  // The mapping stays UCX's (its free at close must find what it made: a
  // SysV attachment, posix shared memory, huge pages); only the pages go.
  // Whole pages inside the allocation only: with UCX's heap fallback the
  // bytes around it are malloc's.
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  uint64_t begin = (reinterpret_cast<uint64_t>(r.addr) + page - 1) / page * page;
  uint64_t end = (reinterpret_cast<uint64_t>(r.addr) + r.span) / page * page;
  if (end > begin) {
    void* p = reinterpret_cast<void*>(begin);
    // Shared memory: free the pages themselves (the object's, not only our
    // view of them). Private memory refuses that; dropping its pages there
    // leaves zero pages that a late write fills again, at most what the
    // peer still had posted.
    if (::madvise(p, end - begin, MADV_REMOVE) != 0 && ::madvise(p, end - begin, MADV_DONTNEED) != 0) {
      throw Error(std::string("madvise over a retired region failed: ") + std::strerror(errno));
    }
  }
  r.quarantined = true;
}

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace {

// A peer's mapping: only the pages the peer made already (resident in its
// segment, which mincore tells without touching them). Populating a hole
// would allocate the peer's memory here, charged to us (a peer that does not
// prefault, or lies); and at most kMaxMappedPrefault bytes, so that a huge
// cache does not hold the caller (the service loop) for seconds: the rest
// faults in on first use, as before.
constexpr uint64_t kMaxMappedPrefault = uint64_t{2} << 30;

bool prefault_mapped(uint64_t begin, uint64_t end, uint64_t page) {
  end = std::min(end, begin + kMaxMappedPrefault);
  const uint64_t pages = (end - begin) / page;
  std::vector<unsigned char> resident(pages);
  if (::mincore(reinterpret_cast<void*>(begin), end - begin, resident.data()) != 0) return false;
  bool ok = true;
  for (uint64_t i = 0; i < pages;) {
    if ((resident[i] & 1) == 0) {
      ++i;
      continue;
    }
    uint64_t j = i;
    while (j < pages && (resident[j] & 1) != 0) ++j;
    void* run = reinterpret_cast<void*>(begin + i * page);
    ok = ::madvise(run, (j - i) * page, MADV_POPULATE_READ) == 0 && ok;
    i = j;
  }
  return ok;
}

}  // namespace

bool prefault(void* addr, uint64_t len, Prefault what) {
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  uint64_t begin = reinterpret_cast<uint64_t>(addr) / page * page;
  uint64_t end = (reinterpret_cast<uint64_t>(addr) + len + page - 1) / page * page;
  if (len == 0 || end <= begin) return false;
  void* p = reinterpret_cast<void*>(begin);
  if (what == Prefault::kMapped) return prefault_mapped(begin, end, page);
  if (what == Prefault::kAllocated) {
    // Huge pages where the system allows them for this memory (shmem's
    // transparent huge pages set to "advise"): 512 times fewer pages to
    // make here, and for every peer that maps them.
    (void)::madvise(p, end - begin, MADV_HUGEPAGE);
  }
  if (::madvise(p, end - begin, MADV_POPULATE_WRITE) == 0) return true;
  if (errno == EINVAL && what == Prefault::kAllocated) {
    // A kernel before 5.14: write the zeros the pages hold already.
    auto* bytes = static_cast<volatile uint8_t*>(addr);
    for (uint64_t off = 0; off < len; off += page) bytes[off] = 0;
    return true;
  }
  return ::madvise(p, end - begin, MADV_POPULATE_READ) == 0;  // read-only user memory
}

std::string pack_rkey(ucp_context_h ctx, const Region& r) {
  void* buf = nullptr;
  size_t size = 0;
  ucs_status_t st = ucp_rkey_pack(ctx, r.memh.get(), &buf, &size);
  if (st != UCS_OK) {
    throw UcxFailure("ucp_rkey_pack failed", st);
  }
  std::string out(static_cast<const char*>(buf), size);
  ucp_rkey_buffer_release(buf);
  return out;
}

}  // namespace akv
