#include "fault_guard.hpp"

#include <csetjmp>
#include <csignal>
#include <cstring>
#include <atomic>
#include <mutex>

namespace akv {
namespace {

struct sigaction g_previous {};

// Per thread: where a guarded copy resumes after a SIGBUS. initial-exec: in
// the static TLS block, so the handler's access never allocates (dynamic TLS
// may, on a thread's first access, which a signal handler must not).
// volatile: the compiler knows memcpy touches nothing else, and would drop
// the store before it as dead (the one after it overwrites it) otherwise.
__attribute__((tls_model("initial-exec"))) thread_local sigjmp_buf* volatile tl_resume = nullptr;

void on_sigbus(int sig, siginfo_t* info, void* uctx) {
  sigjmp_buf* resume = tl_resume;
  if (resume != nullptr) {
    tl_resume = nullptr;
    siglongjmp(*resume, 1);
  }
  // Not ours: let the handler installed before us see it (faulthandler
  // dumps Python's stacks), then restore the default action: returning
  // re-runs the faulting access, which now kills the process with SIGBUS as
  // it would have. (A handler that chains back to us, as faulthandler does
  // after a re-install, finds the default action then and ends there.)
  struct sigaction previous = g_previous;
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  sigaction(SIGBUS, &dfl, nullptr);
  if ((previous.sa_flags & SA_SIGINFO) != 0 && previous.sa_sigaction != nullptr &&
      previous.sa_sigaction != &on_sigbus) {
    previous.sa_sigaction(sig, info, uctx);
  } else if ((previous.sa_flags & SA_SIGINFO) == 0 && previous.sa_handler != SIG_DFL &&
             previous.sa_handler != SIG_IGN && previous.sa_handler != nullptr) {
    previous.sa_handler(sig);
  }
  sigaction(SIGBUS, &dfl, nullptr);
}

std::mutex g_install_mu;

// Ours, unless something installed a handler after us (faulthandler.enable()
// in the application, a debugger): then ours goes back on top, chaining to it.
void ensure_installed() {
  struct sigaction cur {};
  if (sigaction(SIGBUS, nullptr, &cur) != 0) return;
  if ((cur.sa_flags & SA_SIGINFO) != 0 && cur.sa_sigaction == &on_sigbus) return;
  std::lock_guard<std::mutex> lk(g_install_mu);
  if (sigaction(SIGBUS, nullptr, &cur) != 0) return;
  if ((cur.sa_flags & SA_SIGINFO) != 0 && cur.sa_sigaction == &on_sigbus) return;
  struct sigaction sa {};
  sa.sa_sigaction = &on_sigbus;
  sigemptyset(&sa.sa_mask);
  // NODEFER: siglongjmp leaves the handler without restoring the mask, so
  // SIGBUS must not be blocked while it runs.
  sa.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
  sigaction(SIGBUS, &sa, &g_previous);
}

}  // namespace

void install_fault_guard() { ensure_installed(); }

bool guarded_copy(void* dst, const void* src, size_t n) {
  sigjmp_buf resume;
  tl_resume = nullptr;  // first touch of the TLS slot happens here
  if (sigsetjmp(resume, 0) != 0) return false;
  tl_resume = &resume;
  std::atomic_signal_fence(std::memory_order_seq_cst);
  std::memcpy(dst, src, n);
  std::atomic_signal_fence(std::memory_order_seq_cst);
  tl_resume = nullptr;
  return true;
}

bool guarded_load(const volatile uint64_t* p, uint64_t* out) {
  sigjmp_buf resume;
  tl_resume = nullptr;
  if (sigsetjmp(resume, 0) != 0) return false;
  tl_resume = &resume;
  std::atomic_signal_fence(std::memory_order_seq_cst);
  uint64_t v = __atomic_load_n(p, __ATOMIC_ACQUIRE);
  std::atomic_signal_fence(std::memory_order_seq_cst);
  tl_resume = nullptr;
  *out = v;
  return true;
}

}  // namespace akv
