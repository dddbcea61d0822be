#include "memory.hpp"

namespace akv {

Region map_region(ucp_context_h ctx, void* addr, uint64_t len, bool allocate) {
  if (len == 0) throw InvalidArgument("region length must be > 0");
  ucp_mem_map_params_t p{};
  p.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                 UCP_MEM_MAP_PARAM_FIELD_FLAGS;
  p.address = allocate ? nullptr : addr;
  p.length = len;
  p.flags = allocate ? UCP_MEM_MAP_ALLOCATE : 0;
  ucp_mem_h memh = nullptr;
  ucs_status_t st = ucp_mem_map(ctx, &p, &memh);
  if (st != UCS_OK) {
    throw UcxFailure("ucp_mem_map failed", st);
  }
  ucp_mem_attr_t attr{};
  attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
  st = ucp_mem_query(memh, &attr);
  if (st != UCS_OK) {
    ucp_mem_unmap(ctx, memh);
    throw UcxFailure("ucp_mem_query failed", st);
  }
  Region r;
  r.memh = memh;
  r.addr = allocate ? attr.address : addr;
  r.len = len;
  r.allocated = allocate;
  return r;
}

void unmap_region(ucp_context_h ctx, Region& r) {
  if (r.memh != nullptr) {
    ucp_mem_unmap(ctx, r.memh);
    r.memh = nullptr;
  }
}

std::string pack_rkey(ucp_context_h ctx, const Region& r) {
  void* buf = nullptr;
  size_t size = 0;
  ucs_status_t st = ucp_rkey_pack(ctx, r.memh, &buf, &size);
  if (st != UCS_OK) {
    throw UcxFailure("ucp_rkey_pack failed", st);
  }
  std::string out(static_cast<const char*>(buf), size);
  ucp_rkey_buffer_release(buf);
  return out;
}

}  // namespace akv
