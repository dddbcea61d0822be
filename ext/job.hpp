// A transfer job: a list of segments moved with one-sided UCX operations on
// one endpoint. Jobs live on the progress thread only.
#pragma once

#include <ucp/api/ucp.h>

#include <chrono>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "completion_queue.hpp"
#include "ucx_handles.hpp"

namespace akv {

enum class Op : int { kPut = 0, kGet = 1 };

// One row of the segment table handed over from Python.
struct SegmentIn {
  uint64_t local;
  uint64_t remote;
  uint64_t len;
  uint64_t rkey_id;
};

// One job of a submit_many() group, as the caller describes it.
// A job's retirement guard: a word in the peer's memory (its control
// region) that holds `expect` while the cache the job names is live. The
// engine reads it after the job starts — directly when the key maps, else
// with a get posted beside the job's own operations — and a job that finds
// another value fails with RETIRED: a transfer that starts after the owner
// retired the cache is told so, whatever the invalidation's progress.
//
// A strict guard (the peer's registered user memory, which its owner takes
// back when unregister returns) is read before any of the job's bytes move:
// over a transport that cannot map the word that costs one round trip.
struct GuardIn {
  uint64_t rkey_id = 0;  // 0: no guard
  uint64_t addr = 0;
  uint64_t expect = 0;
  bool strict = false;
};

struct JobSpec {
  Op op;
  uint64_t ep_id;
  std::vector<SegmentIn> segs;
  std::string payload;
  uint64_t timeout_ms;
  GuardIn guard{};
};

struct RemoteKey {
  RemoteKey() = default;
  // A pinned key's handle outlives its record: a request UCX still holds
  // may name it.
  ~RemoteKey() {
    if (pinned) (void)handle.release();
  }
  RemoteKey(const RemoteKey&) = delete;
  RemoteKey& operator=(const RemoteKey&) = delete;

  uint64_t id = 0;
  uint64_t ep_id = 0;
  UcxRkey handle;
  // Where the remote region is mapped into this process (same-host shared
  // memory, from ucp_rkey_ptr), or null: then data moves with plain memcpy.
  uint8_t* mapped = nullptr;
  uint64_t base = 0;  // remote region covered by this key
  uint64_t len = 0;
  bool released = false;  // Python let go; destroyed once no job uses it
  int users = 0;
  // Named by a request UCX still holds for an abandoned job: destroying the
  // handle would free memory that request points at, so it lives as long as
  // the worker.
  bool pinned = false;
};

struct Segment {
  uint64_t local;
  uint64_t remote;
  uint64_t len;
  RemoteKey* rkey;
};

enum class Phase { kPosting, kFlushing, kNotifying, kDone };

using DeadlineMap = std::multimap<std::chrono::steady_clock::time_point, uint64_t>;

struct Endpoint;

struct Job {
  uint64_t id = 0;
  Op op = Op::kPut;
  uint64_t ep_id = 0;
  Endpoint* ep = nullptr;
  std::vector<Segment> segs;
  std::vector<SegmentIn> raw;  // as submitted; resolved on the progress thread
  GuardIn guard_in{};          // as submitted
  RemoteKey* guard_key = nullptr;  // resolved (counted in keys)
  uint64_t guard_word = 0;         // where a guard get lands
  bool guard_posted = false;
  bool guard_wait = false;  // strict guard in flight: out of the posting queue until it answers
  std::string payload;         // sent to the peer after a put has landed
  std::chrono::steady_clock::time_point deadline{};
  bool has_deadline = false;
  // How long a cancel may wait for in-flight operations before the endpoint
  // is declared dead, and how long after a forced close the job is released
  // anyway. kCancelGrace / kFailGrace, or scaled to the job's deadline span
  // (see grace_for_deadline in engine_internal.hpp).
  std::chrono::steady_clock::duration cancel_grace{};
  std::chrono::steady_clock::duration fail_grace{};
  DeadlineMap::iterator dl_it;
  std::vector<RemoteKey*> keys;  // distinct keys this job uses (counted in users)
  bool in_active = false;        // queued for posting
  bool parked = false;           // in its endpoint's `parked`: waits for the wireup
  bool touched = false;          // queued for a state-machine step
  bool abandoned = false;        // reported released while UCX still held requests

  size_t seg_idx = 0;
  uint64_t seg_off = 0;
  // UCX operations in flight (the stuck detector and forced closes look at
  // these) and chunks queued to copy lanes (local work that always ends;
  // the job is never released while one is queued or copying).
  uint64_t inflight_ops = 0;
  uint64_t lane_ops = 0;
  uint64_t inflight_bytes = 0;
  uint64_t bytes_done = 0;
  uint64_t posted_ns = 0;  // when the posting phase ended (monotonic_ns)
  bool posted_any = false;  // a UCX operation was posted (a put then needs a flush)
  bool copied_any = false;  // bytes were memcpy'd into mapped shared memory
  // Set with cancel: copy lanes skip this job's queued chunks (any thread).
  std::atomic<bool> stop_copies{false};
  bool cancel = false;
  std::chrono::steady_clock::time_point cancelled_at{};  // when cancel was set
  Phase phase = Phase::kPosting;
  Status status = Status::kOK;
  int32_t ucs_status = 0;

  void fail(Status s, int32_t ucs = 0) {
    if (status == Status::kOK) {
      status = s;
      ucs_status = ucs;
    }
  }
};

// What a UCX request carries in its reserved area (ucp_params.request_size).
struct RequestCtx {
  enum Kind : uint8_t { kData, kFlush, kWindow, kNotify, kClose, kWireup, kGuard, kKeepalive } kind;
  Job* job;
  Endpoint* ep;
  // kData: bytes; kFlush, kWindow: the put bytes it confirms; kWireup,
  // kKeepalive: the endpoint's id (the record may be gone when it
  // completes: ep is null).
  uint64_t len;
  std::vector<Job*>* batch;  // kFlush: the jobs this flush completes
};

}  // namespace akv
