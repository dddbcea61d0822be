// Completion queue shared by the progress thread (producer) and the event
// loop (consumer). One eventfd tells the loop that the queue went from empty
// to non-empty; the loop reads the eventfd and then drains everything, so a
// single counter bump may stand for many entries.
#pragma once

#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "errors.hpp"

namespace akv {

enum class EntryKind : uint8_t {
  kJob = 0,       // a job finished (any status); its buffers are released
  kNotify = 1,    // a peer's notification payload arrived
  kEndpoint = 2,  // an endpoint failed or closed
};

// Statuses reported to Python, from the one table Python's side also reads
// (STATUSES): the values and what they mean cannot drift apart.
enum class Status : int32_t {
#define AKV_STATUS(NAME, value, words, llm) k##NAME = value,
#include "status.def"
#undef AKV_STATUS
};

struct Completion {
  EntryKind kind;
  uint64_t id;
  Status status;
  int32_t ucs_status;  // the UCX status behind a failure, 0 otherwise
  uint64_t bytes;
  std::string payload;
  // kJob: when the job's last operation was posted and when it was reported
  // (CLOCK_MONOTONIC ns, Python's time.monotonic_ns()); 0 when it never got
  // that far. What aiokvcache.metrics reads a transfer's phases from.
  // kNotify: posted_ns is the id of the endpoint the notification came on.
  uint64_t posted_ns = 0;
  uint64_t done_ns = 0;
};

// CLOCK_MONOTONIC in ns: the clock Python's time.monotonic_ns() reads.
inline uint64_t monotonic_ns() {
  timespec ts;
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

class CompletionQueue {
 public:
  CompletionQueue() {
    fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (fd_ < 0) throw Error("eventfd failed");
  }
  ~CompletionQueue() {
    if (fd_ >= 0) ::close(fd_);
  }
  CompletionQueue(const CompletionQueue&) = delete;
  CompletionQueue& operator=(const CompletionQueue&) = delete;

  int fd() const { return fd_; }

  void push(Completion&& c) {
    bool signal;
    {
      std::lock_guard<std::mutex> lk(mu_);
      signal = items_.empty();
      items_.push_back(std::move(c));
    }
    // Only the empty -> non-empty edge needs a wakeup: the consumer drains
    // everything after reading the eventfd.
    if (signal) bump();
  }

  std::vector<Completion> drain() {
    std::vector<Completion> out;
    std::lock_guard<std::mutex> lk(mu_);
    out.swap(items_);
    return out;
  }

  // The consumer's wakeup in one call: reset the eventfd, then drain. An
  // entry pushed after the swap finds the queue empty and bumps again, so
  // nothing waits for a wakeup that already happened.
  std::vector<Completion> take() {
    uint64_t v;
    ssize_t rc;
    do {
      rc = ::read(fd_, &v, sizeof(v));
    } while (rc < 0 && errno == EINTR);
    return drain();
  }

 private:
  void bump() {
    uint64_t one = 1;
    ssize_t rc;
    do {
      rc = ::write(fd_, &one, sizeof(one));
    } while (rc < 0 && errno == EINTR);
    // EAGAIN means the counter is saturated: the reader is already due.
  }

  int fd_ = -1;
  std::mutex mu_;
  std::vector<Completion> items_;
};

}  // namespace akv
