// Checks of what a peer chooses (see peer_input.hpp).
#include "peer_input.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <tuple>

#include <ucs/memory/memory_type.h>

#include "errors.hpp"

namespace akv {
namespace {

// A worker address crosses the control plane, so a peer (or a corrupted
// frame) chooses its bytes. ucp_ep_create takes no length: UCX parses the
// address without bounds, asserts (aborting the process) on a header version
// it does not know, and walks off the end of a truncated or re-lengthed one.
// So the address is walked here first, with bounds, in the layout this UCX
// produces (src/ucp/wireup/address.c, non-unified mode, v1 and v2), and the
// walk is calibrated on our own address: if it cannot walk that exactly, only
// the header is checked.
constexpr uint8_t kAddrVersionMask = 0x0f;  // low nibble of byte 0
constexpr uint8_t kAddrV1 = 0;              // v1: header flags in the high nibble
constexpr uint8_t kAddrKnownFlags = 0x0f;   // DEBUG_INFO | WORKER_UUID | CLIENT_ID | AM_ONLY
constexpr uint8_t kFlagDebugInfo = 0x01, kFlagUuid = 0x02, kFlagClientId = 0x04;
constexpr uint8_t kNullResource = 0xff;
constexpr uint8_t kLast = 0x80, kHasEpOrPaths = 0x40, kSysDevice = 0x20, kMdEmpty = 0x80;

struct Reader {
  const uint8_t* p;
  size_t n, at = 0;
  bool ok = true;
  uint8_t u8() {
    if (at >= n) {
      ok = false;
      return 0;
    }
    return p[at++];
  }
  void skip(size_t k) {
    if (k > n - std::min(at, n)) {
      ok = false;
      at = n;
    } else {
      at += k;
    }
  }
  uint8_t extended(uint8_t b, uint8_t mask, bool v2) {
    uint8_t v = b & mask;
    return (v2 && v == mask) ? u8() : v;
  }
};

// One transport interface of an address: its name's checksum, and the
// lengths of its device's address and of its own.
struct TlEntry {
  uint16_t csum;
  uint8_t dev_len;
  uint8_t iface_len;
};

// Bytes after the device list, or npos when the walk fails. attr_extra: the
// resource-index byte some pack flags add after each interface's attributes.
// `out`, when given, collects each interface the walk passed.
size_t walk_devices(Reader r, bool v2, size_t attr_extra, std::vector<TlEntry>* out = nullptr) {
  const size_t attr_len = (v2 ? 8 : 16) + attr_extra;
  if (r.at < r.n && r.p[r.at] == kNullResource) return r.n - r.at - 1;
  for (int dev = 0; dev < 256 && r.ok; ++dev) {
    uint8_t md = r.u8();
    bool empty = (md & kMdEmpty) != 0;
    uint8_t md_index = r.extended(md, 0x7f, v2);
    uint8_t lenb = r.u8();
    bool last_dev = (lenb & kLast) != 0;
    uint8_t dev_len = r.extended(lenb, 0x1f, v2);
    if ((lenb & kHasEpOrPaths) != 0) r.u8();  // number of paths
    if ((lenb & kSysDevice) != 0) r.u8();     // system device
    r.skip(dev_len);
    // md indices name bits of 64-bit maps.
    if (!empty && md_index >= 64) return std::string::npos;
    bool last_tl = empty;
    for (int tl = 0; !last_tl && tl < 256 && r.ok; ++tl) {
      uint16_t csum = r.u8();  // transport name checksum
      csum = static_cast<uint16_t>(csum | (r.u8() << 8));
      if (!v2 && r.ok && r.n - r.at >= 12) {
        float f[3];
        std::memcpy(f, r.p + r.at, sizeof(f));  // overhead, bandwidth, latency
        for (float x : f) {
          if (!std::isfinite(x)) return std::string::npos;
        }
      }
      r.skip(attr_len);
      uint8_t tlb = r.u8();
      last_tl = (tlb & kLast) != 0;
      bool has_ep = (tlb & kHasEpOrPaths) != 0;
      uint8_t iface_len = r.extended(tlb, 0x3f, v2);
      r.skip(iface_len);
      if (out != nullptr && r.ok) out->push_back(TlEntry{csum, dev_len, iface_len});
      for (int e = 0; has_ep && e < 64 && r.ok; ++e) {
        r.skip(r.u8());
        has_ep = (r.u8() & kLast) == 0;
      }
      if (has_ep) return std::string::npos;
    }
    if (!last_tl) return std::string::npos;
    if (last_dev) return r.ok ? r.n - r.at : std::string::npos;
  }
  return std::string::npos;
}

// UCT reads a transport's device and interface addresses by its own
// structure (a TCP device address as its address family, flags and IP): one
// shorter than that structure reads past its part, and a zero length makes it
// a null pointer (SIGSEGV in uct_tcp_iface_is_reachable_v2). Lengths changed
// together with the bytes they count still walk to the end, so the walk
// alone does not catch them: an interface of a transport this UCX has
// (known by its name's checksum) must have addresses at least as long as
// ours. (An IPv6 TCP device address is longer than an IPv4 one; a transport
// we lack is never matched with a resource of ours, so UCX does not read it.)
void check_address_lengths(const std::vector<TlEntry>& theirs, const std::vector<TlEntry>& mine) {
  for (const TlEntry& t : theirs) {
    // The shortest of ours for that transport (a loopback TCP device's
    // address is shorter than another's).
    int min_dev = -1, min_iface = -1;
    for (const TlEntry& m : mine) {
      if (m.csum != t.csum) continue;
      if (min_dev < 0 || m.dev_len < min_dev) min_dev = m.dev_len;
      if (min_iface < 0 || m.iface_len < min_iface) min_iface = m.iface_len;
    }
    if (min_dev >= 0 && (t.dev_len < min_dev || t.iface_len < min_iface)) {
      throw PeerInput("worker address gives a transport of ours a device or interface "
                      "address shorter than its own");
    }
  }
}

// Where the device list starts, or npos.
size_t header_end(const std::string& a) {
  Reader r{reinterpret_cast<const uint8_t*>(a.data()), a.size()};
  uint8_t h = r.u8();
  bool v2 = (h & kAddrVersionMask) != kAddrV1;
  uint8_t flags = v2 ? r.u8() : static_cast<uint8_t>(h >> 4);
  if ((flags & ~kAddrKnownFlags) != 0) return std::string::npos;
  if (!v2 || (flags & kFlagUuid) != 0) r.skip(8);
  if ((flags & kFlagClientId) != 0) r.skip(8);
  if ((flags & kFlagDebugInfo) != 0) r.skip(r.u8());
  return r.ok && r.at < r.n ? r.at : std::string::npos;
}

}  // namespace

void check_worker_address(const std::string& a, const std::string& ours) {
  if (a.empty()) throw PeerInput("worker address is empty");
  if (a.size() > kMaxWorkerAddress) throw PeerInput("worker address is too long");
  uint8_t version = static_cast<uint8_t>(a[0]) & kAddrVersionMask;
  if (ours.empty() || version != (static_cast<uint8_t>(ours[0]) & kAddrVersionMask)) {
    throw PeerInput("worker address has a header version this UCX does not produce");
  }
  size_t at = header_end(a);
  if (at == std::string::npos) throw PeerInput("worker address is truncated or has unknown header flags");
  bool v2 = version != kAddrV1;
  // Calibrate on our own address: the layout that walks it to its last byte.
  size_t ours_at = header_end(ours);
  for (size_t extra : {0, 1}) {
    if (ours_at == std::string::npos) break;
    std::vector<TlEntry> mine, theirs;
    Reader self{reinterpret_cast<const uint8_t*>(ours.data()), ours.size(), ours_at};
    if (walk_devices(self, v2, extra, &mine) != 0) continue;
    Reader peer{reinterpret_cast<const uint8_t*>(a.data()), a.size(), at};
    // Exactly to the end, as UCX packs it: a length byte changed alone
    // leaves the walk short of the end or past it.
    if (walk_devices(peer, v2, extra, &theirs) != 0) {
      throw PeerInput("worker address is malformed (its device list does not parse)");
    }
    check_address_lengths(theirs, mine);
    return;
  }
}

// A packed remote key crosses the control plane too (cache metadata, a probe
// slot), and ucp_ep_rkey_unpack takes no length either: it reads the md map
// and walks one (size, bytes) entry per bit of it, indexes tables by the
// memory type, and, for a key whose memory has a known system device, reads
// distance entries up to a terminator byte wherever that is. So the key is
// walked here first, in the layout this UCX packs (ucp_rkey_pack_memh in
// src/ucp/core/ucp_rkey.c, UCX 1.20 and later):
//   u64 md_map | u8 mem_type | per md bit: u8 size, size bytes
//   | u8 sys_dev (when md_map != 0; bit 7: flush needed)
//   | when sys_dev is known: 3-byte distance entries, then the 0xff terminator
// and it must end exactly at its last byte.
constexpr uint8_t kSysDevUnknown = 0xff;      // UCS_SYS_DEVICE_ID_UNKNOWN
constexpr uint8_t kSysDevFlushBit = 0x80;     // UCP_SYS_DEVICE_FLUSH_BIT
constexpr size_t kDistanceEntry = 3;          // ucp_rkey_packed_distance_t
constexpr uint8_t kMaxSysDevInMap = 64;       // bits of ucp_sys_dev_map_t

void check_packed_rkey(const std::string& k) {
  if (k.size() > kMaxPackedRkey) throw PeerInput("remote key is too long");
  Reader r{reinterpret_cast<const uint8_t*>(k.data()), k.size()};
  uint64_t md_map = 0;
  for (int i = 0; i < 8; ++i) md_map |= static_cast<uint64_t>(r.u8()) << (8 * i);
  uint8_t mem_type = r.u8();
  if (!r.ok) throw PeerInput("remote key is truncated (no md map and memory type)");
  if (mem_type >= UCS_MEMORY_TYPE_LAST) throw PeerInput("remote key names an unknown memory type");
  for (uint64_t bits = md_map; bits != 0 && r.ok; bits &= bits - 1) r.skip(r.u8());
  if (!r.ok) throw PeerInput("remote key is truncated (a memory domain's part)");
  if (md_map != 0) {
    uint8_t sys_dev = r.u8();
    if (!r.ok) throw PeerInput("remote key is truncated (no system device)");
    if (sys_dev != kSysDevUnknown) {
      // The key's own device is a value UCX keeps (up to 127); those in the
      // distance list index its 64-bit device maps.
      int entries = 0;
      for (;;) {
        uint8_t dev = r.u8();
        if (!r.ok) throw PeerInput("remote key's distance list has no terminator");
        if (dev == kSysDevUnknown) break;
        if (dev >= kMaxSysDevInMap || ++entries > kMaxSysDevInMap) {
          throw PeerInput("remote key's distance list names an unknown system device");
        }
        r.skip(kDistanceEntry - 1);
      }
    }
  }
  if (r.at != r.n) throw PeerInput("remote key has bytes past its end");
}

std::string padded_rkey(const std::string& k) {
  std::string copy = k;
  copy.append(kRkeyPad, '\0');
  return copy;
}

bool Vma::operator<(const Vma& o) const {
  return std::tie(start, end, offset, inode) < std::tie(o.start, o.end, o.offset, o.inode);
}

bool Vma::operator==(const Vma& o) const {
  return start == o.start && end == o.end && offset == o.offset && inode == o.inode;
}

bool parse_maps_line(const char* line, Vma* out) {
  Vma v{};
  char perms[8] = {};
  unsigned dev_major, dev_minor;
  if (std::sscanf(line, "%" SCNx64 "-%" SCNx64 " %7s %" SCNx64 " %x:%x %" SCNu64, &v.start, &v.end, perms,
                  &v.offset, &dev_major, &dev_minor, &v.inode) != 7) {
    return false;
  }
  v.readable = perms[0] == 'r';
  v.writable = perms[1] == 'w';
  v.shared = perms[3] == 's';
  *out = v;
  return true;
}

std::vector<Vma> read_maps() {
  std::vector<Vma> out;
  FILE* f = std::fopen("/proc/self/maps", "re");
  if (f == nullptr) return out;
  char line[4096];
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    Vma v{};
    if (parse_maps_line(line, &v)) out.push_back(v);
  }
  std::fclose(f);
  std::sort(out.begin(), out.end());
  return out;
}

// ucp_rkey_ptr only adds an offset: it never checks that the address is in
// the peer's segment, and UCX's shared-memory lanes write through the same
// unchecked mapping. So a claimed [base, base + len) is accepted only when
// its image [p, p + len) lies inside one shared, read-write mapping that
// appeared while this key was unpacked (UCX maps the peer's segment afresh
// for every key, so nothing of ours, nor another peer's segment, qualifies),
// and, where the backing file can be seen, inside that file: past its end a
// touch is SIGBUS. `before` is the sorted map from just before the unpack.
bool mapping_covers(const std::vector<Vma>& before, const uint8_t* p, uint64_t len) {
  uint64_t lo = reinterpret_cast<uint64_t>(p);
  if (len == 0 || lo + len < lo) return false;
  for (const Vma& v : read_maps()) {
    if (lo < v.start || lo >= v.end) continue;
    if (!v.shared || !v.readable || !v.writable || v.inode == 0) return false;
    if (len > v.end - lo) return false;
    if (std::binary_search(before.begin(), before.end(), v)) return false;
    // We run as root, which /proc/self/map_files needs; without it the file
    // size cannot be checked, and the mapping's extent is all we prove.
    char path[96];
    std::snprintf(path, sizeof(path), "/proc/self/map_files/%" PRIx64 "-%" PRIx64, v.start, v.end);
    int fd = ::open(path, O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
      struct stat sb {};
      bool ok = ::fstat(fd, &sb) == 0;
      ::close(fd);
      if (!ok) return false;
      uint64_t file_end = v.offset + (lo + len - v.start);
      if (S_ISREG(sb.st_mode) && file_end > static_cast<uint64_t>(sb.st_size)) return false;
    }
    return true;
  }
  return false;
}

}  // namespace akv
