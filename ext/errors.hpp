// What the engine throws. Each type becomes its own Python exception
// (bindings.cpp), so callers can tell a caller's mistake from a closed engine
// from a transport failure without reading messages.
#pragma once

#include <ucs/type/status.h>

#include <stdexcept>
#include <string>

namespace akv {

// Python: NativeError (a RuntimeError, so that code catching RuntimeError
// catches every engine failure); thrown as itself for failures that fit none
// of the types below.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Raised by calls on a closed engine; Python sees EngineClosedError.
class ClosedError : public Error {
 public:
  ClosedError() : Error("engine is closed") {}
};

// The caller's mistake (unknown id, bad argument); retrying cannot help.
// Python: InvalidArgumentError, also a ValueError (a caller's bad value).
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// What a peer sent (a worker address, a packed remote key) is malformed:
// refused before UCX reads it. Python: PeerInputError, an
// InvalidArgumentError, so the caller can tell a peer's bad bytes from its
// own mistake.
class PeerInput : public InvalidArgument {
 public:
  using InvalidArgument::InvalidArgument;
};

// A UCX call failed. Python: UcxError, with the status as ucs_status.
class UcxFailure : public Error {
 public:
  UcxFailure(const std::string& what, ucs_status_t st)
      : Error(what + ": " + ucs_status_string(st)), status_(st) {}
  ucs_status_t status() const { return status_; }

 private:
  ucs_status_t status_;
};

}  // namespace akv
