// Owners of UCX handles and file descriptors: each is move-only and gives
// its handle back with the right call exactly once, so a constructor that
// throws half-way unwinds what it made, and a teardown is the order in which
// owners are reset.
#pragma once

#include <ucp/api/ucp.h>
#include <unistd.h>

#include <cstddef>
#include <utility>

namespace akv {

template <typename H, typename Destroy>
class UcxHandle {
 public:
  UcxHandle() = default;
  explicit UcxHandle(H h) : h_(h) {}
  ~UcxHandle() { reset(); }
  UcxHandle(UcxHandle&& o) noexcept : h_(o.release()) {}
  UcxHandle& operator=(UcxHandle&& o) noexcept {
    if (this != &o) {
      reset();
      h_ = o.release();
    }
    return *this;
  }
  UcxHandle(const UcxHandle&) = delete;
  UcxHandle& operator=(const UcxHandle&) = delete;

  H get() const { return h_; }
  // For UCX calls that create into a pointer: any handle held goes first.
  H* out() {
    reset();
    return &h_;
  }
  // Give the handle up without destroying it (UCX may still use it).
  H release() { return std::exchange(h_, nullptr); }
  void reset() {
    if (h_ != nullptr) Destroy{}(std::exchange(h_, nullptr));
  }
  friend bool operator==(const UcxHandle& a, std::nullptr_t) { return a.h_ == nullptr; }
  friend bool operator!=(const UcxHandle& a, std::nullptr_t) { return a.h_ != nullptr; }

 private:
  H h_ = nullptr;
};

struct ConfigRelease {
  void operator()(ucp_config_t* c) const { ucp_config_release(c); }
};
struct ContextCleanup {
  void operator()(ucp_context_h c) const { ucp_cleanup(c); }
};
struct WorkerDestroy {
  void operator()(ucp_worker_h w) const { ucp_worker_destroy(w); }
};
struct RkeyDestroy {
  void operator()(ucp_rkey_h k) const { ucp_rkey_destroy(k); }  // unmaps a mapped segment, too
};

using UcxConfig = UcxHandle<ucp_config_t*, ConfigRelease>;
using UcxContext = UcxHandle<ucp_context_h, ContextCleanup>;
using UcxWorker = UcxHandle<ucp_worker_h, WorkerDestroy>;
using UcxRkey = UcxHandle<ucp_rkey_h, RkeyDestroy>;

// A registration (ucp_mem_map): unmapped with the context it was made in.
class UcxMemHandle {
 public:
  UcxMemHandle() = default;
  UcxMemHandle(ucp_context_h ctx, ucp_mem_h memh) : ctx_(ctx), memh_(memh) {}
  ~UcxMemHandle() { reset(); }
  UcxMemHandle(UcxMemHandle&& o) noexcept
      : ctx_(std::exchange(o.ctx_, nullptr)), memh_(std::exchange(o.memh_, nullptr)) {}
  UcxMemHandle& operator=(UcxMemHandle&& o) noexcept {
    if (this != &o) {
      reset();
      ctx_ = std::exchange(o.ctx_, nullptr);
      memh_ = std::exchange(o.memh_, nullptr);
    }
    return *this;
  }
  UcxMemHandle(const UcxMemHandle&) = delete;
  UcxMemHandle& operator=(const UcxMemHandle&) = delete;

  ucp_mem_h get() const { return memh_; }
  void reset() {
    if (memh_ != nullptr) (void)ucp_mem_unmap(ctx_, std::exchange(memh_, nullptr));
  }

 private:
  ucp_context_h ctx_ = nullptr;
  ucp_mem_h memh_ = nullptr;
};

// A file descriptor of ours (not one UCX owns, such as the worker's).
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd() { reset(); }
  UniqueFd(UniqueFd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;

  int get() const { return fd_; }
  void reset() {
    if (fd_ >= 0) ::close(std::exchange(fd_, -1));
  }

 private:
  int fd_ = -1;
};

}  // namespace akv
