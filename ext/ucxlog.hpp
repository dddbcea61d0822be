// Capture of UCX's log output (see ucxlog.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace akv {

struct UcxLogLine {
  int level;              // ucs_log_level_t: 0 fatal, 1 error, 2 warn, 3 diag, 4 info, ...
  std::string component;  // "UCX", "UCT", ...
  std::string where;      // source file:line inside UCX
  std::string text;
};

void ucx_log_install();
bool ucx_log_pending();
std::vector<UcxLogLine> ucx_log_take(uint64_t* dropped);
// One line through UCX's own dispatcher, as UCX would log it (for tests of
// the capture, and of which lines still reach stderr).
void ucx_log_emit(int level, const std::string& text);

}  // namespace akv
