#include "fault_guard.hpp"

#include <csetjmp>
#include <csignal>
#include <cstring>
#include <mutex>

namespace akv {
namespace {

struct sigaction g_previous {};

// Per thread: where a guarded copy resumes after a SIGBUS. Touched before
// each copy, so the handler never makes the first access (dynamic TLS may
// allocate on first access, which a signal handler must not).
thread_local sigjmp_buf* tl_resume = nullptr;

void on_sigbus(int sig, siginfo_t* info, void* uctx) {
  sigjmp_buf* resume = tl_resume;
  if (resume != nullptr) {
    tl_resume = nullptr;
    siglongjmp(*resume, 1);
  }
  // Not ours: hand it on as if we were never installed.
  if ((g_previous.sa_flags & SA_SIGINFO) != 0 && g_previous.sa_sigaction != nullptr) {
    g_previous.sa_sigaction(sig, info, uctx);
    return;
  }
  if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN &&
      g_previous.sa_handler != nullptr) {
    g_previous.sa_handler(sig);
    return;
  }
  // Default action: restore it; returning re-runs the faulting access,
  // which now kills the process with SIGBUS as it would have.
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  sigaction(SIGBUS, &dfl, nullptr);
}

}  // namespace

void install_fault_guard() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa {};
    sa.sa_sigaction = &on_sigbus;
    sigemptyset(&sa.sa_mask);
    // NODEFER: siglongjmp leaves the handler without restoring the mask, so
    // SIGBUS must not be blocked while it runs.
    sa.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
    sigaction(SIGBUS, &sa, &g_previous);
  });
}

bool guarded_copy(void* dst, const void* src, size_t n) {
  sigjmp_buf resume;
  tl_resume = nullptr;  // first touch of the TLS slot happens here
  if (sigsetjmp(resume, 0) != 0) return false;
  tl_resume = &resume;
  std::memcpy(dst, src, n);
  tl_resume = nullptr;
  return true;
}

bool guarded_load(const volatile uint64_t* p, uint64_t* out) {
  sigjmp_buf resume;
  tl_resume = nullptr;
  if (sigsetjmp(resume, 0) != 0) return false;
  tl_resume = &resume;
  uint64_t v = __atomic_load_n(p, __ATOMIC_ACQUIRE);
  tl_resume = nullptr;
  *out = v;
  return true;
}

}  // namespace akv
