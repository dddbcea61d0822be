// The checks of peer input (ext/peer_input.hpp): what a peer or a corrupted
// frame may hand the engine must be refused, never crash the process.
#include <doctest/doctest.h>
#include <sys/mman.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "errors.hpp"
#include "peer_input.hpp"

namespace {

using akv::check_worker_address;
using akv::InvalidArgument;

// A real worker's address (this process's), the calibration the engine uses.
class Worker {
 public:
  Worker() {
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM;
    REQUIRE(ucp_init(&params, nullptr, &context_) == UCS_OK);
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;
    REQUIRE(ucp_worker_create(context_, &wp, &worker_) == UCS_OK);
    ucp_worker_attr_t attr{};
    attr.field_mask = UCP_WORKER_ATTR_FIELD_ADDRESS;
    REQUIRE(ucp_worker_query(worker_, &attr) == UCS_OK);
    address_.assign(reinterpret_cast<const char*>(attr.address), attr.address_length);
    ucp_worker_release_address(worker_, attr.address);
  }
  ~Worker() {
    ucp_worker_destroy(worker_);
    ucp_cleanup(context_);
  }
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;
  const std::string& address() const { return address_; }

 private:
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::string address_;
};

const std::string& our_address() {
  static Worker w;
  return w.address();
}

// Whether the check refuses `a` (any other exception fails the test).
bool refused(const std::string& a) {
  try {
    check_worker_address(a, our_address());
    return false;
  } catch (const InvalidArgument&) {
    return true;
  }
}

}  // namespace

TEST_CASE("worker address: our own passes") {
  REQUIRE_FALSE(our_address().empty());
  CHECK_FALSE(refused(our_address()));
}

TEST_CASE("worker address: empty, oversized, foreign version") {
  CHECK(refused(""));
  CHECK(refused(std::string(akv::kMaxWorkerAddress + 1, '\0')));
  std::string other = our_address();
  other[0] = static_cast<char>(static_cast<uint8_t>(other[0]) ^ 0x0f);  // another header version
  CHECK(refused(other));
  CHECK_THROWS_AS(check_worker_address(our_address(), ""), InvalidArgument);
}

TEST_CASE("worker address: every truncation is refused") {
  const std::string& ours = our_address();
  for (size_t n = 1; n < ours.size(); ++n) {
    CAPTURE(n);
    CHECK(refused(ours.substr(0, n)));
  }
}

TEST_CASE("worker address: trailing bytes are refused") {
  CHECK(refused(our_address() + std::string(1, '\0')));
  CHECK(refused(our_address() + std::string(64, '\x7f')));
}

TEST_CASE("worker address: unknown header flags are refused") {
  // v1 keeps its flags in byte 0's high nibble, all four of them known; v2
  // has a flags byte, whose high bits no UCX sets.
  std::string a = our_address();
  if ((static_cast<uint8_t>(a[0]) & 0x0f) == 0) {
    a[0] = static_cast<char>(0x01);  // v2's version under v1's
    CHECK(refused(a));
    return;
  }
  REQUIRE(a.size() > 1);
  a[1] = static_cast<char>(static_cast<uint8_t>(a[1]) | 0x80);
  CHECK(refused(a));
}

TEST_CASE("worker address: a part shortened with its length byte is refused where UCT would read past it") {
  // Such an address still walks to its last byte; a transport's device or
  // interface address shorter than ours is what UCT would read past.
  const std::string& ours = our_address();
  int tried = 0, caught = 0;
  for (size_t i = 0; i < ours.size(); ++i) {
    uint8_t b = static_cast<uint8_t>(ours[i]);
    for (uint8_t k = 1; k <= (b & 0x1f) && i + 1 + k <= ours.size(); ++k) {
      std::string a = ours.substr(0, i) + std::string(1, static_cast<char>(b - k)) + ours.substr(i + 1 + k);
      ++tried;
      CHECK_NOTHROW(caught += refused(a) ? 1 : 0);
    }
  }
  CHECK(tried > 100);
  CHECK(caught > tried / 2);  // most by the walk or the lengths; the rest are harmless (tests/test_peer_input.py)
}

TEST_CASE("worker address: any single byte changed is refused or still walks to the end") {
  // The check promises only that what it lets through is a layout UCX walks
  // within bounds; a changed byte must never make it throw anything else.
  const std::string& ours = our_address();
  for (size_t i = 0; i < ours.size(); ++i) {
    for (int v : {0x00, 0x01, 0x1f, 0x3f, 0x7f, 0x80, 0xff}) {
      std::string a = ours;
      a[i] = static_cast<char>(v);
      CAPTURE(i);
      CAPTURE(v);
      CHECK_NOTHROW((void)refused(a));
    }
  }
}

namespace {

using akv::check_packed_rkey;

// Packed keys of this UCX for one region: as many as its contexts pack
// (every transport, shared memory only, tcp only).
std::vector<std::string> our_rkeys() {
  std::vector<std::string> keys;
  for (const char* tls : {"all", "posix,sysv,cma,self", "tcp,self"}) {
    ucp_config_t* cfg = nullptr;
    REQUIRE(ucp_config_read(nullptr, nullptr, &cfg) == UCS_OK);
    REQUIRE(ucp_config_modify(cfg, "TLS", tls) == UCS_OK);
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM;
    ucp_context_h ctx = nullptr;
    REQUIRE(ucp_init(&params, cfg, &ctx) == UCS_OK);
    ucp_config_release(cfg);
    ucp_mem_map_params_t mp{};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_LENGTH | UCP_MEM_MAP_PARAM_FIELD_FLAGS;
    mp.length = 1 << 16;
    mp.flags = UCP_MEM_MAP_ALLOCATE;
    ucp_mem_h memh = nullptr;
    REQUIRE(ucp_mem_map(ctx, &mp, &memh) == UCS_OK);
    void* buf = nullptr;
    size_t size = 0;
    REQUIRE(ucp_rkey_pack(ctx, memh, &buf, &size) == UCS_OK);
    keys.emplace_back(static_cast<const char*>(buf), size);
    ucp_rkey_buffer_release(buf);
    ucp_mem_unmap(ctx, memh);
    ucp_cleanup(ctx);
  }
  return keys;
}

bool rkey_refused(const std::string& k) {
  try {
    check_packed_rkey(k);
    return false;
  } catch (const akv::PeerInput&) {
    return true;
  }
}

}  // namespace

TEST_CASE("remote key: ours pass, every truncation and any trailing byte is refused") {
  for (const std::string& k : our_rkeys()) {
    CAPTURE(k.size());
    CHECK_FALSE(rkey_refused(k));
    for (size_t n = 0; n < k.size(); ++n) {
      CAPTURE(n);
      CHECK(rkey_refused(k.substr(0, n)));
    }
    CHECK(rkey_refused(k + std::string(1, '\0')));
    CHECK(rkey_refused(k + std::string(3, '\xff')));
  }
}

TEST_CASE("remote key: unknown memory type, md bits without parts, oversized") {
  std::string k = our_rkeys().front();
  std::string bad_type = k;
  bad_type[8] = static_cast<char>(0x7f);
  CHECK(rkey_refused(bad_type));
  bad_type[8] = static_cast<char>(UCS_MEMORY_TYPE_LAST);
  CHECK(rkey_refused(bad_type));
  std::string all_mds = k;
  for (int i = 0; i < 8; ++i) all_mds[i] = static_cast<char>(0xff);
  CHECK(rkey_refused(all_mds));
  CHECK(rkey_refused(std::string(akv::kMaxPackedRkey + 1, '\0')));
}

TEST_CASE("remote key: the distance list") {
  // md_map 1, host memory, one empty md part, then the system device.
  const std::string head("\x01\0\0\0\0\0\0\0" "\0" "\0", 10);
  CHECK_FALSE(rkey_refused(head + "\xff"));  // unknown device: no list
  CHECK(rkey_refused(head));                  // no device byte
  // A known device (with or without the flush bit): entries up to 0xff.
  CHECK_FALSE(rkey_refused(head + "\x03" + std::string("\x03\x10\x20\xff", 4)));
  CHECK_FALSE(rkey_refused(head + "\x83" + std::string("\xff", 1)));
  CHECK(rkey_refused(head + "\x03" + std::string("\x03\x10\x20", 3)));  // no terminator
  CHECK(rkey_refused(head + "\x03" + std::string("\x03\x10", 2)));      // a short entry
  CHECK_FALSE(rkey_refused(head + "\x7e" + std::string("\xff", 1)));     // any device of its own
  CHECK(rkey_refused(head + "\x03" + std::string("\x40\x10\x20\xff", 4)));  // a listed one past the map
  CHECK(rkey_refused(head + "\x03" + std::string("\x50\x10\x20\xff", 4)));
  // An empty md map packs nothing after the memory type.
  CHECK_FALSE(rkey_refused(std::string(9, '\0')));
  CHECK(rkey_refused(std::string(9, '\0') + "\xff"));
}

TEST_CASE("remote key: any single byte changed is refused or still walks to the end") {
  for (const std::string& k : our_rkeys()) {
    for (size_t i = 0; i < k.size(); ++i) {
      for (int v : {0x00, 0x01, 0x0f, 0x7f, 0x80, 0xff}) {
        std::string m = k;
        m[i] = static_cast<char>(v);
        CAPTURE(i);
        CAPTURE(v);
        CHECK_NOTHROW((void)rkey_refused(m));
      }
    }
  }
}

TEST_CASE("segment bounds") {
  using akv::SegmentIn;
  using akv::segment_fits;
  const uint64_t base = 0x1000, len = 0x100;
  CHECK(segment_fits(SegmentIn{0x5000, base, len, 1}, base, len));
  CHECK(segment_fits(SegmentIn{0x5000, base + 0xf8, 8, 1}, base, len));
  CHECK(segment_fits(SegmentIn{0x5000, base + len, 0, 1}, base, len));
  CHECK_FALSE(segment_fits(SegmentIn{0x5000, base - 1, 8, 1}, base, len));
  CHECK_FALSE(segment_fits(SegmentIn{0x5000, base + 0xf9, 8, 1}, base, len));
  CHECK_FALSE(segment_fits(SegmentIn{0x5000, base, len + 1, 1}, base, len));
  // remote + len wrapping the address space, and a local range that wraps.
  CHECK_FALSE(segment_fits(SegmentIn{0x5000, base + 8, UINT64_MAX - 4, 1}, base, len));
  CHECK_FALSE(segment_fits(SegmentIn{UINT64_MAX - 3, base, 8, 1}, base, len));
  CHECK_FALSE(segment_fits(SegmentIn{0x5000, base, 8, 1}, base, 0));
}

TEST_CASE("maps line parsing") {
  akv::Vma v{};
  REQUIRE(akv::parse_maps_line("7f00a000-7f00c000 rw-s 00002000 00:05 123456 /dev/shm/x\n", &v));
  CHECK(v.start == 0x7f00a000);
  CHECK(v.end == 0x7f00c000);
  CHECK(v.offset == 0x2000);
  CHECK(v.inode == 123456);
  CHECK(v.readable);
  CHECK(v.writable);
  CHECK(v.shared);
  REQUIRE(akv::parse_maps_line("00400000-00452000 r-xp 00000000 08:02 173521 /usr/bin/x\n", &v));
  CHECK_FALSE(v.writable);
  CHECK_FALSE(v.shared);
  REQUIRE(akv::parse_maps_line("7ffd1000-7ffd2000 rw-p 00000000 00:00 0 [stack]\n", &v));
  CHECK(v.inode == 0);
  CHECK_FALSE(akv::parse_maps_line("", &v));
  CHECK_FALSE(akv::parse_maps_line("garbage\n", &v));
  CHECK_FALSE(akv::parse_maps_line("7f00a000-7f00c000 rw-s\n", &v));
}

TEST_CASE("read_maps is sorted") {
  std::vector<akv::Vma> before = akv::read_maps();
  REQUIRE_FALSE(before.empty());
  for (size_t i = 1; i < before.size(); ++i) CHECK_FALSE(before[i] < before[i - 1]);
}

namespace {

// A shared, file-backed mapping of `map_len` bytes over a file of
// `file_len`: what a same-host peer's segment looks like to us.
struct SharedFile {
  uint8_t* p = nullptr;
  size_t map_len = 0;
  SharedFile(size_t file_len, size_t len, int prot, int flags) : map_len(len) {
    char path[] = "/tmp/akv-unit-XXXXXX";
    int fd = ::mkstemp(path);
    REQUIRE(fd >= 0);
    ::unlink(path);
    REQUIRE(::ftruncate(fd, static_cast<off_t>(file_len)) == 0);
    void* m = ::mmap(nullptr, map_len, prot, flags, fd, 0);
    ::close(fd);
    REQUIRE(m != MAP_FAILED);
    p = static_cast<uint8_t*>(m);
  }
  ~SharedFile() { ::munmap(p, map_len); }
  SharedFile(const SharedFile&) = delete;
  SharedFile& operator=(const SharedFile&) = delete;
};

const size_t kPage = static_cast<size_t>(::sysconf(_SC_PAGESIZE));

}  // namespace

TEST_CASE("mapping_covers: a fresh shared read-write file mapping") {
  std::vector<akv::Vma> before = akv::read_maps();
  SharedFile f(4 * kPage, 4 * kPage, PROT_READ | PROT_WRITE, MAP_SHARED);
  CHECK(akv::mapping_covers(before, f.p, 4 * kPage));
  CHECK(akv::mapping_covers(before, f.p + kPage, kPage));
  CHECK_FALSE(akv::mapping_covers(before, f.p, 4 * kPage + 1));  // past the mapping
  CHECK_FALSE(akv::mapping_covers(before, f.p, 0));
  CHECK_FALSE(akv::mapping_covers(before, f.p, UINT64_MAX));  // wraps
  // Already there before the key was unpacked: ours, or another peer's.
  CHECK_FALSE(akv::mapping_covers(akv::read_maps(), f.p, kPage));
}

TEST_CASE("mapping_covers: private, read-only, unmapped") {
  std::vector<akv::Vma> before = akv::read_maps();
  SharedFile priv(kPage, kPage, PROT_READ | PROT_WRITE, MAP_PRIVATE);
  SharedFile ro(kPage, kPage, PROT_READ, MAP_SHARED);
  CHECK_FALSE(akv::mapping_covers(before, priv.p, kPage));
  CHECK_FALSE(akv::mapping_covers(before, ro.p, kPage));
  CHECK_FALSE(akv::mapping_covers(before, reinterpret_cast<const uint8_t*>(kPage), kPage));
}

TEST_CASE("mapping_covers: past the backing file's end") {
  // Where /proc/self/map_files can be opened (root) the file's size bounds
  // the claim: a touch past it would be SIGBUS.
  std::vector<akv::Vma> before = akv::read_maps();
  SharedFile f(kPage, 4 * kPage, PROT_READ | PROT_WRITE, MAP_SHARED);
  CHECK(akv::mapping_covers(before, f.p, kPage));
  char path[96];
  std::snprintf(path, sizeof(path), "/proc/self/map_files/%lx-%lx", reinterpret_cast<unsigned long>(f.p),
                reinterpret_cast<unsigned long>(f.p + 4 * kPage));
  bool file_visible = ::access(path, F_OK) == 0;
  CHECK(akv::mapping_covers(before, f.p, 2 * kPage) == !file_visible);
}
