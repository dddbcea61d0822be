#include "command_queue.hpp"

#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <utility>

#include "errors.hpp"

namespace akv {

CommandQueue::CommandQueue() : efd_(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {
  if (efd_.get() < 0) throw Error("eventfd/epoll_create1 failed");
}

void CommandQueue::post(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_.load()) throw ClosedError();
    commands_.push_back(std::move(fn));
    pending_.store(true);
  }
  // A spinning thread sees pending() on its next step; only a thread that
  // is (about to be) asleep needs the eventfd.
  wake_if_sleeping();
}

bool CommandQueue::close() {
  std::lock_guard<std::mutex> lk(mu_);
  if (closed_.load()) return false;
  closed_.store(true);
  return true;
}

void CommandQueue::run() {
  if (!pending_.load()) return;  // the common case, without the lock
  std::vector<std::function<void()>> cmds;
  {
    std::lock_guard<std::mutex> lk(mu_);
    cmds.swap(commands_);
    pending_.store(false);
  }
  for (auto& c : cmds) c();
}

void CommandQueue::wake() {
  uint64_t one = 1;
  ssize_t rc;
  do {
    rc = ::write(efd_.get(), &one, sizeof(one));
  } while (rc < 0 && errno == EINTR);
}

void CommandQueue::clear_wakeups() {
  uint64_t v;
  while (::read(efd_.get(), &v, sizeof(v)) > 0) {
  }
}

}  // namespace akv
