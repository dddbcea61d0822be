// What the engine's source files (engine, progress, registry, jobs,
// endpoints .cpp) share; nothing outside them includes it.
#pragma once

#include <algorithm>
#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <type_traits>

#include "engine.hpp"
#include "peer_input.hpp"

namespace akv {

constexpr unsigned kAmId = 7;
// Keep-alives (EngineConfig::keepalive): header = the link's key; one byte,
// 1 when the sender asks for one back at once (keepalive_now), else 0.
constexpr unsigned kKeepaliveAmId = 8;
// Empty progress polls, at least, before a thread with jobs in flight arms
// the worker and sleeps (besides EngineConfig::spin since its last work).
constexpr int kSpinPolls = 64;
// ucp_worker_progress calls per step of the progress thread, at most.
constexpr int kProgressBurst = 64;
// UCX wakeups have known gaps: never sleep longer than this with work pending.
constexpr int kSafetyWaitMs = 5;
constexpr int kIdleWaitMs = 100;
// Chunks queued per copy lane: enough that a lane never waits for the
// progress thread to refill it; a cancel skips the queued ones (stop_copies).
constexpr size_t kLaneDepth = 4;
// How long close() lets in-flight operations drain before forcing endpoints.
constexpr auto kShutdownGrace = std::chrono::seconds(3);
// How long a locally failed endpoint waits for its in-flight ops to drain.
constexpr auto kFailGrace = std::chrono::seconds(1);
// How long a cancelled job may wait for in-flight ops before its endpoint is
// declared dead: a frozen peer must not make cancellation hang.
constexpr auto kCancelGrace = std::chrono::seconds(2);
// A job with a deadline gets graces in proportion to it, so that its
// deadline bounds when it is reported and not 3 s past it: a quarter of its
// span to drain a cancel, a tenth after a forced close, each clamped (see
// docs/design.md, "Cancellation and quiescence"). The floors cover a
// scheduling hiccup of the progress thread; the ceilings are the graces of
// jobs without a deadline.
constexpr auto kCancelGraceMin = std::chrono::milliseconds(50);
constexpr auto kFailGraceMin = std::chrono::milliseconds(20);
// How often the progress thread looks for stuck cancels and for jobs to
// release after a forced close: part of the bound a deadline gives.
constexpr auto kStuckCheckEvery = std::chrono::milliseconds(10);

inline std::chrono::steady_clock::duration scaled_grace(std::chrono::milliseconds span, double share,
                                                        std::chrono::steady_clock::duration lo,
                                                        std::chrono::steady_clock::duration hi) {
  auto d = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double, std::milli>(static_cast<double>(span.count()) * share));
  return std::max(lo, std::min(hi, d));
}

inline Status status_from_ucs(ucs_status_t st) {
  switch (st) {
    case UCS_OK:
      return Status::kOK;
    case UCS_ERR_CANCELED:
      return Status::kCANCELLED;
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_REJECTED:
    case UCS_ERR_NOT_CONNECTED:
    case UCS_ERR_IO_ERROR:
      return Status::kLINK_FAILED;
    default:
      return Status::kERROR;
  }
}

template <typename T>
T Engine::call(std::function<T()> fn) {
  auto prom = std::make_shared<std::promise<T>>();
  auto fut = prom->get_future();
  commands_.post([prom, fn = std::move(fn)]() {
    try {
      if constexpr (std::is_void_v<T>) {
        fn();
        prom->set_value();
      } else {
        prom->set_value(fn());
      }
    } catch (...) {
      prom->set_exception(std::current_exception());
    }
  });
  return fut.get();
}

}  // namespace akv
