// What the engine's source files (engine, progress, registry, jobs,
// endpoints .cpp) share; nothing outside them includes it.
#pragma once

#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <type_traits>

#include "engine.hpp"

namespace akv {

constexpr unsigned kAmId = 7;
// Empty progress polls before the thread arms the worker and sleeps. A short
// spin keeps latency low for back-to-back jobs without burning a core.
constexpr int kSpinPolls = 64;
// UCX wakeups have known gaps: never sleep longer than this with work pending.
constexpr int kSafetyWaitMs = 5;
constexpr int kIdleWaitMs = 100;
// How long close() lets in-flight operations drain before forcing endpoints.
constexpr auto kShutdownGrace = std::chrono::seconds(3);
// How long a locally failed endpoint waits for its in-flight ops to drain.
constexpr auto kFailGrace = std::chrono::seconds(1);
// How long a cancelled job may wait for in-flight ops before its endpoint is
// declared dead: a frozen peer must not make cancellation hang.
constexpr auto kCancelGrace = std::chrono::seconds(2);

template <typename T>
T Engine::call(std::function<T()> fn) {
  auto prom = std::make_shared<std::promise<T>>();
  auto fut = prom->get_future();
  post_command([prom, fn = std::move(fn)]() {
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
