// Checks of what a peer chooses: a worker address that crossed the control
// plane, the region a remote key claims to map, a segment's range inside its
// key. None needs a UCX worker, so the unit tests (ext/tests) call them as
// the engine does.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "job.hpp"

namespace akv {

// Whether segment ``s`` lies inside the remote region [base, base + len) of
// its key, and its local range does not wrap: the check every path that
// moves bytes through a key makes (admission, inline copies).
inline bool segment_fits(const SegmentIn& s, uint64_t base, uint64_t len) {
  return s.remote >= base && s.len <= len && s.remote - base <= len - s.len && s.local + s.len >= s.local;
}

// A worker address longer than this is refused unread.
constexpr size_t kMaxWorkerAddress = 64 * 1024;
// UCT reads device and interface addresses by their own structure, not by
// the length the address gives: a copy padded with zeros keeps a short one
// from reading past the buffer.
constexpr size_t kAddressPad = 256;

// Throws InvalidArgument unless `a` is a worker address UCX can parse
// without reading past its end. `ours` (this worker's own address) sets the
// header version expected and calibrates the walk of the device list: when
// the walk cannot follow `ours` exactly, only the header is checked.
void check_worker_address(const std::string& a, const std::string& ours);

// A packed remote key longer than this is refused unread (the layout's
// largest: 64 md parts of 255 bytes and 64 distance entries).
constexpr size_t kMaxPackedRkey = 32 * 1024;
// Each UCT component reads its part of a key by its own structure, not by
// the size byte before it: the copy UCX reads is padded with zeros, so a
// part shorter than its structure reads the key's next bytes and then zeros,
// never memory past the copy (no component's structure is longer than this).
constexpr size_t kRkeyPad = 256;

// Throws PeerInput unless `k` is a packed remote key laid out as this UCX
// packs one (ucp_rkey_pack): md map, a known memory type, one sized part per
// md bit, the system device and its distance list (devices below 64) with
// its terminator, ending at the last byte. Not covered: the contents of each part, which the
// transport's component interprets (as for worker addresses).
void check_packed_rkey(const std::string& k);
// `k` with kRkeyPad zero bytes after it: what the engine hands UCX.
std::string padded_rkey(const std::string& k);

// One line of /proc/self/maps.
struct Vma {
  uint64_t start, end, offset, inode;
  bool readable, writable, shared;
  bool operator<(const Vma& o) const;
  bool operator==(const Vma& o) const;
};

// One /proc/self/maps line parsed into *out; false for a line that does not
// have the address, permission, offset, device and inode fields.
bool parse_maps_line(const char* line, Vma* out);
// This process's mappings, sorted.
std::vector<Vma> read_maps();

// Whether [p, p + len), the image of a remote key's claimed region, lies
// inside one shared, read-write, file-backed mapping that is not in
// `before` (the sorted maps from just before the key was unpacked), and,
// where the backing file can be seen, inside that file.
bool mapping_covers(const std::vector<Vma>& before, const uint8_t* p, uint64_t len);

}  // namespace akv
