// UCX's own log lines (warnings such as "transport 'ib' is not available")
// go to a bounded in-memory queue instead of stderr; Python drains it into
// the "aiokvcache.ucx" logger (aiokvcache/_ucxlog.py). Installed once, when
// the module loads. UCX_LOG_LEVEL still chooses which levels UCX emits.
#include "ucxlog.hpp"

#include <ucs/config/global_opts.h>
#include <ucs/debug/log_def.h>

#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <deque>
#include <mutex>

namespace akv {
namespace {

constexpr size_t kMaxLines = 256;  // older lines are dropped (and counted)

std::mutex g_mu;
std::deque<UcxLogLine> g_lines;
std::atomic<bool> g_pending{false};
uint64_t g_dropped = 0;

ucs_log_func_rc_t capture(const char* file, unsigned line, const char* /*function*/, ucs_log_level_t level,
                          const ucs_log_component_config_t* comp, const char* format, va_list ap) {
  char text[512];
  va_list copy;
  va_copy(copy, ap);
  std::vsnprintf(text, sizeof(text), format, copy);
  va_end(copy);
  UcxLogLine entry;
  entry.level = static_cast<int>(level);
  entry.component = comp != nullptr ? comp->name : "";
  entry.where = std::string(file != nullptr ? file : "") + ":" + std::to_string(line);
  entry.text = text;
  {
    std::lock_guard<std::mutex> lk(g_mu);
    if (g_lines.size() >= kMaxLines) {
      g_lines.pop_front();
      g_dropped++;
    }
    g_lines.push_back(std::move(entry));
  }
  g_pending.store(true, std::memory_order_release);
  // A fatal line precedes UCX aborting the process, before anyone could
  // drain the queue: UCX's default handler prints it to stderr as well.
  // Every other line reaches only the aiokvcache.ucx logger.
  return level == UCS_LOG_LEVEL_FATAL ? UCS_LOG_FUNC_RC_CONTINUE : UCS_LOG_FUNC_RC_STOP;
}

}  // namespace

void ucx_log_install() {
  static std::once_flag once;
  std::call_once(once, [] { ucs_log_push_handler(&capture); });
}

void ucx_log_emit(int level, const std::string& text) {
  ucs_log_dispatch("aiokvcache", 0, "ucx_log_emit", static_cast<ucs_log_level_t>(level),
                   &ucs_global_opts.log_component, "%s", text.c_str());
}

bool ucx_log_pending() { return g_pending.load(std::memory_order_acquire); }

std::vector<UcxLogLine> ucx_log_take(uint64_t* dropped) {
  std::vector<UcxLogLine> out;
  std::lock_guard<std::mutex> lk(g_mu);
  g_pending.store(false, std::memory_order_relaxed);
  out.assign(std::make_move_iterator(g_lines.begin()), std::make_move_iterator(g_lines.end()));
  g_lines.clear();
  if (dropped != nullptr) *dropped = g_dropped;
  g_dropped = 0;
  return out;
}

}  // namespace akv
