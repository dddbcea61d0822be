#include "copy_lanes.hpp"

#include <pthread.h>

#include <utility>

#include "fault_guard.hpp"

namespace akv {

void CopyLanes::start(unsigned n, std::function<void()> done) {
  on_done_ = std::move(done);
  for (unsigned i = 0; i < n; ++i) threads_.emplace_back(&CopyLanes::lane_main, this);
}

void CopyLanes::push(const CopyTask& t) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    queue_.push_back(t);
  }
  cv_.notify_one();
}

std::vector<CopyTask> CopyLanes::take_done() {
  std::vector<CopyTask> done;
  if (!done_pending_.load()) return done;
  std::lock_guard<std::mutex> lk(done_mu_);
  done.swap(done_);
  done_pending_.store(false);
  return done;
}

void CopyLanes::stop() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stop_) return;
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) {
    if (t.joinable()) t.join();
  }
}

void CopyLanes::lane_main() {
  pthread_setname_np(pthread_self(), "akv-copy");
  while (true) {
    CopyTask t{};
    bool stopping;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, nothing left
      t = queue_.front();
      queue_.pop_front();
      stopping = stop_;
    }
    // After a stop only skip: stop() runs before any mapping goes.
    if (!stopping && !t.job->stop_copies.load(std::memory_order_relaxed)) {
      install_fault_guard();
      t.copied = guarded_copy(t.dst, t.src, t.n);
      t.faulted = !t.copied;
      // Non-temporal stores included: visible before the completion (and
      // any notification the progress thread sends after it).
      std::atomic_thread_fence(std::memory_order_seq_cst);
    }
    {
      std::lock_guard<std::mutex> lk(done_mu_);
      done_.push_back(t);
      done_pending_.store(true);
    }
    on_done_();
  }
}

}  // namespace akv
