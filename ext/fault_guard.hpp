// Copies through a same-host peer's mapped memory, guarded against SIGBUS.
//
// A peer's shared-memory segment is a file we map (ucp_rkey_ptr). The peer
// owns the file: if it shrinks it after we mapped it, a touch past the new
// end raises SIGBUS in whichever of our threads copies. The size is checked
// when a key is unpacked (registry.cpp), but that proves nothing later, and
// we cannot seal another process's file. So every copy through a peer's
// mapping runs under this guard: a SIGBUS inside it jumps back out, the copy
// reports failure, and the engine fails that endpoint instead of the process
// dying. Faults outside a guarded copy go to the handler installed before
// ours (faulthandler, a debugger's), or kill the process as SIGBUS does.
#pragma once

#include <cstddef>
#include <cstdint>

namespace akv {

// Puts the process-wide SIGBUS handler on top again if something installed
// another after it (idempotent, thread-safe; one sigaction query when it is
// already there). Callers run it once per batch of guarded copies: a copy
// lane per chunk, the progress thread per step, an inline copy per call.
void install_fault_guard();

// memcpy(dst, src, n); false if a SIGBUS stopped it (the bytes before the
// fault were copied, the rest not).
bool guarded_copy(void* dst, const void* src, size_t n);

// An 8-byte load through a peer's mapping; false if it faulted.
bool guarded_load(const volatile uint64_t* p, uint64_t* out);

}  // namespace akv
