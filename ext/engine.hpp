// The native transfer engine: one UCX context and one worker, owned by one
// progress thread. Every UCX call happens on that thread; other threads talk
// to it through a command queue and learn results from the completion queue.
#pragma once

#include <ucp/api/ucp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "command_queue.hpp"
#include "completion_queue.hpp"
#include "copy_lanes.hpp"
#include "job.hpp"
#include "memory.hpp"
#include "progress_thread.hpp"
#include "ucx_handles.hpp"

namespace akv {

struct EngineConfig {
  std::string transport = "auto";  // auto | shm | tcp | rdma
  uint64_t max_inflight_bytes = 64ull << 20;
  uint64_t chunk_bytes = 1ull << 20;
  // Per endpoint: bytes posted through UCX (not direct copies) that the peer
  // has not confirmed yet — puts not covered by a completed flush, gets not
  // completed. The bound on what a frozen peer can still apply after a job
  // was released unproven (docs/design.md, "Late writes"). 0: no bound.
  uint64_t max_unconfirmed_bytes = 2ull << 20;
  bool direct_copy = true;  // memcpy into same-host peers' mapped memory
  // Select UCX's protocols at start, over an endpoint to a helper worker
  // (prewarm.cpp), instead of in the first link.
  bool prewarm = false;
  // Fault in every page of a same-host peer's region when its key is
  // unpacked (mapped), as allocate/register do for ours from Python.
  bool prefault = false;
  // How long the progress thread keeps polling after its last work before
  // it sleeps: a caller that awaits each small transfer then finds it
  // awake. Idle, it sleeps at once.
  std::chrono::microseconds spin{100};
  // Threads that run same-host direct copies, chunk by chunk: the progress
  // thread and copy_lanes - 1 lane threads (1: the progress thread alone);
  // 0: from the core count.
  unsigned copy_lanes = 0;
  // Liveness: the progress thread sends every linked endpoint (one with
  // notification keys) a keep-alive message this often, and records when
  // anything keyed arrived from each; 0: none. Both happen off the GIL, so a
  // peer whose Python threads are starved (a busy serving engine on the same
  // cores) is still heard; only a process that stopped running goes silent.
  std::chrono::milliseconds keepalive{0};
  std::vector<std::pair<std::string, std::string>> ucx_options;  // extra UCX config
};

class Engine;

// A link's notification keys: notifications we send on its endpoint carry
// send; those arriving with recv are reported as peer_id's. Empty: none.
struct NoteKeys {
  std::string send;
  std::string recv;
  uint64_t peer_id = 0;
  bool given() const { return !send.empty() || !recv.empty(); }
};

// Where an endpoint's transport close stands. Why it ends (Endpoint::closing,
// Endpoint::broken) is separate: a disconnected endpoint may fail too, and
// either reason may come before or after the close is posted.
enum class CloseState : uint8_t {
  kOpen,    // no close posted
  kPosted,  // ucp_ep_close_nbx posted; UCX has not finished it
  kDone,    // UCX finished (or refused) the close: the handle is gone
};

struct Endpoint {
  uint64_t id = 0;
  Engine* owner = nullptr;
  ucp_ep_h handle = nullptr;  // null once close_done()
  bool broken = false;   // failed (UCX-reported or local): closed with force
  bool closing = false;  // disconnect asked; closed once its jobs are done
  CloseState close_state = CloseState::kOpen;
  bool close_posted() const { return close_state != CloseState::kOpen; }
  bool close_done() const { return close_state == CloseState::kDone; }
  bool ending() const { return closing || broken; }
  // Its close is posted (force: a forced close, see `forced`); the record
  // retires once it completes, or at close_by if a frozen peer stalls it.
  void begin_close(std::chrono::steady_clock::time_point now, std::chrono::steady_clock::duration grace,
                   bool force) {
    close_state = CloseState::kPosted;
    close_by = now + grace;
    if (force) {
      forced = true;
      forced_at = now;
    }
  }
  // UCX finished the close, or refused to post it: nothing more goes out or
  // comes in on it.
  void close_finished() {
    handle = nullptr;
    close_state = CloseState::kDone;
  }
  bool flush_queued = false;       // in Engine::flush_eps_
  // Closed because it failed: with UCP_EP_CLOSE_FLAG_FORCE where UCX allows
  // it (err_handling), else with the flushing close that stands in for it.
  bool forced = false;
  std::chrono::steady_clock::time_point forced_at{};
  std::vector<Job*> flush_wait;    // puts waiting for the next shared flush
  // The wireup flush connect() posted is still outstanding: the peer has
  // not answered our wireup request, so it may not have its endpoint to us
  // yet. No operation goes on the wire until it has: jobs that reach a
  // UCX operation wait in `parked` (see Engine::connect).
  bool wiring = false;
  std::vector<Job*> parked;
  // The confirmation window (EngineConfig::max_unconfirmed_bytes): bytes
  // posted and not confirmed, put bytes posted since the last flush was
  // posted, and whether a window flush is in flight.
  uint64_t unconfirmed = 0;
  uint64_t unflushed = 0;
  bool window_flush = false;
  std::chrono::steady_clock::time_point force_after{};  // forced close once passed
  int32_t ucs_status = 0;
  int jobs = 0;
  std::vector<RemoteKey*> rkeys;
  // A job on it was reported released while UCX still held its requests
  // (abandon(): a frozen peer over a transport that cannot force-close).
  // Until the endpoint's close completes, that job's bytes may still move.
  bool unproven = false;
  // Notifications (active messages) this endpoint sends carry note_header,
  // the key the peer gave us for them; the peer attributes a notification
  // to the link whose key it carries, never to what its payload claims.
  std::string note_header;
  std::string note_key;  // the key we gave the peer (our note_keys_ entry)
  // Liveness (EngineConfig::keepalive): when a keyed message (keep-alive or
  // notification) last came from the peer, or when the keys were set; and
  // whether our own keep-alive is still on its way (one at a time: a frozen
  // peer never grows our send queue).
  std::chrono::steady_clock::time_point heard{};
  bool ping_inflight = false;
  bool ping_due = false;   // send one at the next step (timer, echo or keepalive_now)
  bool ask_echo = false;   // ... asking the peer to answer with one at once
  // Created with UCX peer-failure handling: only then does UCX accept a
  // forced close (without it ucp_ep_close_nbx refuses FORCE outright).
  bool err_handling = false;
  // A posted close still pending then (a frozen peer never completes its
  // flush) retires the record: see reap_endpoints().
  std::chrono::steady_clock::time_point close_by{};
};

// A snapshot of the counters (stats.def).
struct EngineStats {
#define AKV_STAT(name, doc) uint64_t name;
#include "stats.def"
#undef AKV_STAT
};

// The counters behind EngineStats, read from any thread.
struct StatCounters {
#define AKV_STAT(name, doc) std::atomic<uint64_t> name{0};
#include "stats.def"
#undef AKV_STAT

  EngineStats snapshot() const {
    EngineStats s{};
#define AKV_STAT(name, doc) s.name = name.load();
#include "stats.def"
#undef AKV_STAT
    return s;
  }
};

// Its definition is split by responsibility: engine.cpp (setup, stats,
// close), progress.cpp (the loop), registry.cpp (regions and remote keys),
// endpoints.cpp, jobs.cpp, flushes.cpp, job_cancel.cpp, notifications.cpp.
// The command queue (command_queue.hpp), the copy lanes (copy_lanes.hpp)
// and the progress thread (progress_thread.hpp) are classes of their own.
class Engine {
 public:
  explicit Engine(EngineConfig cfg);
  virtual ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  int event_fd() const { return cq_.fd(); }
  // The release signal: an eventfd written once, after arm_release_signal(),
  // when a job is next released (and at close), so that a loop other than
  // the owner's (the peer service's) waits on a few jobs without polling.
  // close() writes it a last time and closes it (-1 after): a watcher reads
  // a dup of its own, which it closes when it stops watching.
  int release_fd() {
    std::lock_guard<std::mutex> lk(release_mu_);
    return release_efd_.get();
  }
  void arm_release_signal() { release_armed_.store(true); }
  unsigned copy_lanes() const { return cfg_.copy_lanes; }  // as chosen (never 0)
  uint64_t progress_spin_us() const { return static_cast<uint64_t>(cfg_.spin.count()); }
  std::string worker_address() const { return worker_address_; }
  std::string info();
  // The UCX configuration the context was created from, as ucp_config_print
  // writes it (defaults, ours, the caller's ucx_options); transport options
  // UCP hands on to UCT come last as NAME=value lines.
  std::string ucx_config() const { return config_text_; }

  // Memory regions and remote keys (registry.cpp).
  std::pair<uint64_t, uint64_t> mem_alloc(uint64_t len);  // -> (region id, address)
  uint64_t mem_register(uint64_t addr, uint64_t len);
  void mem_release(uint64_t region_id);
  // A retired allocated region a peer may still write (its link was cut off
  // unconfirmed): its pages go back now, its addresses stay an inert mapping
  // until close() (see quarantine_region). mem_release refuses it after.
  void mem_quarantine(uint64_t region_id);
  std::string rkey_pack(uint64_t region_id);
  uint64_t rkey_unpack(uint64_t ep_id, const std::string& packed, uint64_t base, uint64_t len);
  void rkey_release(uint64_t rkey_id);

  // Endpoints (endpoints.cpp).
  // peer_errors: UCX peer failure handling. Shared-memory transports do not
  // support it (UCX then refuses the endpoint), so same-host peers connect
  // without it and rely on the control plane to notice a dead peer.
  // keys, when given: the link's notification keys, installed in the same
  // command (see set_note_keys).
  uint64_t connect(const std::string& worker_address, bool peer_errors,
                   const NoteKeys& keys = NoteKeys{});
  // Returns the ids of the jobs still live on it (cancelled now): the
  // caller waits for their release before it calls the peer quiescent.
  std::vector<uint64_t> disconnect(uint64_t ep_id);
  void fail_endpoint(uint64_t ep_id);
  // True once the endpoint is closed at the transport (or unknown, or the
  // engine fully closed); false while close() is still draining.
  bool endpoint_closed(uint64_t ep_id);
  // True while a job on the endpoint was reported released unproven (see
  // Endpoint::unproven) and the endpoint's close has not completed: memory
  // that job used must wait. False for an unknown endpoint, or once the
  // engine fully closed.
  bool endpoint_unproven(uint64_t ep_id);
  // Notification keys of a link: notifications we send on ep_id carry
  // send_key; those that arrive with recv_key are reported as peer_id's.
  void set_note_keys(uint64_t ep_id, const std::string& send_key, const std::string& recv_key,
                     uint64_t peer_id);
  // Seconds since the peer of ep_id was last heard (a keep-alive or a
  // notification carrying its key; counted from set_note_keys before the
  // first); negative for an unknown endpoint or one without keys.
  double silent_s(uint64_t ep_id);
  // Send ep_id's peer a keep-alive now that asks it to answer with one: a
  // live peer's progress thread (not its Python threads) then lowers
  // silent_s within a round trip.
  void keepalive_now(uint64_t ep_id);

  // Jobs (jobs.cpp). Segments are (local, remote, len, rkey id) rows.
  uint64_t submit(Op op, uint64_t ep_id, std::vector<SegmentIn>&& segs, std::string&& payload,
                  uint64_t timeout_ms);
  // A group of jobs in one command (one crossing, at most one wake-up):
  // all are checked first, and either all are submitted or none.
  std::vector<uint64_t> submit_many(std::vector<JobSpec>&& specs);
  // Small same-host transfers on the caller's thread: when every segment's
  // key maps the peer's memory (direct copy) and the total is at most
  // max_bytes, copy now. The guard (rkey 0: none) is read first, through its
  // mapping. Returns kInlineCopied, kInlineNo (nothing copied: use jobs) or
  // kInlineRetired (the guard says the peer retired the cache; nothing
  // copied). The copy happens under the lock that unmapping takes.
  static constexpr int kInlineCopied = 0, kInlineNo = 1, kInlineRetired = 2;
  int copy_inline(Op op, uint64_t ep_id, const std::vector<std::vector<SegmentIn>>& jobs, uint64_t max_bytes,
                  const GuardIn& guard);
  void cancel(uint64_t job_id);
  void cancel_many(std::vector<uint64_t> job_ids);  // one command for all
  // Blocks until none of job_ids is live (submitted, completion not yet
  // queued) or timeout_s passes; true when all are released. Any thread.
  bool wait_released(const std::vector<uint64_t>& job_ids, double timeout_s);
  // Payloads of notifications go out as eager active messages: keep them small.
  static constexpr size_t kMaxPayload = 4096;
  // Notification keys (set_note_keys) are this long.
  static constexpr size_t kNoteKeyLen = 16;
  // Notifications queued for Python at most; more are dropped (and counted)
  // while the owner's loop does not drain: a peer cannot grow our memory.
  static constexpr size_t kMaxQueuedNotes = 65536;

  std::vector<Completion> drain() { return counted(cq_.drain()); }
  std::vector<Completion> take() { return counted(cq_.take()); }  // reset the eventfd, then drain
  EngineStats stats() const;
  void close();
  // True once close() has finished: the progress thread and the lanes are
  // joined and the worker is destroyed, so nothing moves a byte any more.
  // (closing() is true first, when close() begins: no command is taken then.)
  bool closed() const { return closed_.load(); }
  // The warm-up at start: how long it took, and whether it ran to the end.
  uint64_t prewarm_ns() const { return prewarm_ns_; }
  bool prewarmed() const { return prewarmed_; }
  bool closing() const { return commands_.closed(); }

 private:
  // Progress-thread side, except call() and check_open(): callers' threads
  // reach the progress thread through call() and commands_.

  // The loop (progress.cpp).
  void run();
  bool step();
  int wait_timeout_ms();
  // Runs fn on the progress thread and waits for its result.
  template <typename T>
  T call(std::function<T()> fn);

  // Lifecycle (engine.cpp): the constructor's steps, in order, then close().
  UcxConfig read_config();
  void init_context(UcxConfig config);
  void init_worker();
  void init_wakeup();
  void prewarm() noexcept;
  void start_threads();
  void shutdown_all();
  void release_leftovers();
  // What drain() / take() hand out: notifications leave the queue's count.
  std::vector<Completion> counted(std::vector<Completion>&& items);
  void check_open() const;

  // Regions and remote keys (registry.cpp).
  void destroy_rkey(RemoteKey* rk);
  void release_key_handle(RemoteKey* rk);
  bool key_busy(const RemoteKey* rk) const;
  void destroy_idle_keys(Endpoint* ep);

  // Endpoints (endpoints.cpp).
  static void check_note_keys(const std::string& send_key, const std::string& recv_key);
  void install_note_keys(Endpoint* ep, const NoteKeys& keys);
  void close_endpoint(Endpoint* ep, bool force);
  bool endpoint_closed_now(uint64_t ep_id);
  void reap_endpoints();
  void endpoint_failed(Endpoint* ep, ucs_status_t st);
  static void on_ep_error(void* arg, ucp_ep_h ep, ucs_status_t status);
  void wired(uint64_t ep_id);

  // Jobs (jobs.cpp).
  void admit(std::unique_ptr<Job> j);
  void resolve_segments(Job* job);
  void resolve_guard(Job* job);
  bool post_all();
  // Posts a job's chunks while the windows let it: each goes to a copy lane
  // (queue_lane_copy), is copied here (copy_chunk) or is posted to UCX
  // (post_chunk); each of these returns false when the job must stop
  // posting for now (window full, parked, failed).
  void post_job(Job* j);
  struct Chunk {
    uint8_t* local;
    uint64_t remote;
    uint64_t n;
  };
  bool queue_lane_copy(Job* j, const Segment& s, const Chunk& c);
  bool copy_chunk(Job* j, const Segment& s, const Chunk& c);
  bool post_chunk(Job* j, const Segment& s, const Chunk& c);
  void touch(Job* j);
  void process_touched();
  void advance(Job* j);
  void detach(Job* j);
  void finish(Job* j);
  // The one way a job's completion reaches the queue: it also wakes
  // wait_released(), which must not return before the entry is drainable.
  void push_job_completion(Completion&& c);
  // Writes the release signal if it is armed (or ``always``); any thread.
  void signal_release(bool always = false);
  std::unique_ptr<Job> make_job(JobSpec&& spec);
  // Flushes (flushes.cpp).
  bool post_flushes();
  void complete_flush(std::vector<Job*>* batch, ucs_status_t st);
  // The confirmation window (flushes.cpp): a flush that confirms an endpoint's
  // put bytes, and the per-endpoint and total counts.
  void post_window_flush(Endpoint* ep);
  void add_unconfirmed(Endpoint* ep, uint64_t n);
  void confirm(Endpoint* ep, uint64_t n);
  // Early ends (job_cancel.cpp).
  void check_deadlines();
  void cancel_job(Job* j, Status why);
  void check_stuck();
  void abandon(Job* j);
  static void on_data_done(void* request, ucs_status_t status, void* user_data);
  // Active messages that arrive (notifications.cpp).
  static ucs_status_t on_am(void* arg, const void* header, size_t header_length, void* data,
                            size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t on_keepalive(void* arg, const void* header, size_t header_length, void* data,
                                   size_t length, const ucp_am_recv_param_t* param);
  // Keep-alives (endpoints.cpp): sent when due, from step().
  void send_keepalives();
  std::chrono::steady_clock::time_point next_keepalive_{};
  bool keepalive_due_ = false;  // some endpoint's ping_due is set
  // A keyed message arrived: its endpoint's peer is alive.
  void heard_from(uint64_t ep_id);
  void op_done(RequestCtx* ctx, ucs_status_t status);
  // The retirement guard of a job (Job::guard): read or fetch the word.
  bool post_guard(Job* j);
  void guard_done(Job* g, ucs_status_t st);
  // A direct copy through a peer's mapping hit SIGBUS (the peer shrank its
  // segment): the endpoint is failed, its keys no longer map.
  void copy_fault(Endpoint* ep);
  // Notifications: key -> (peer id, endpoint id) (progress thread only), and
  // the count of notification entries now in the completion queue.
  struct NoteKey {
    uint64_t peer_id;
    uint64_t ep_id;
  };
  std::unordered_map<std::string, NoteKey> note_keys_;
  // The link a message's header (its key) names, or null; stamps its
  // endpoint heard. Progress thread only.
  const NoteKey* keyed(const void* header, size_t header_length);
  std::atomic<uint64_t> notes_queued_{0};

  // UCX and the loop's file descriptors (engine.cpp, progress.cpp).
  EngineConfig cfg_;
  // Declared in the order they are made: a constructor that throws unwinds
  // them in reverse (the worker before its context); close() resets them
  // in its own order.
  UcxContext context_;
  UcxWorker worker_;
  uint64_t prewarm_ns_ = 0;
  bool prewarmed_ = false;
  std::string worker_address_;
  std::string config_text_;
  int worker_efd_ = -1;  // the worker's own
  UniqueFd epfd_;
  CompletionQueue cq_;

  // Command queue and lifecycle (engine.cpp).
  CommandQueue commands_;
  std::chrono::steady_clock::time_point spin_until_{};  // progress thread: poll until then
  std::mutex close_mu_;
  std::atomic<bool> closed_{false};   // close() finished
  ProgressThread progress_;  // runs run()

  // Owned by the progress thread after construction.
  // Jobs (jobs.cpp).
  std::unordered_map<uint64_t, std::unique_ptr<Job>> jobs_;
  std::vector<std::unique_ptr<Job>> graveyard_;  // abandoned, freed after the worker
  std::deque<Job*> active_;  // jobs with something left to post, FIFO
  std::vector<Job*> touched_;          // jobs whose state machine may move
  std::vector<Endpoint*> flush_eps_;   // endpoints with jobs waiting for a flush
  DeadlineMap deadlines_;
  bool window_full_ = false;
  uint64_t copy_budget_ = 0;  // bytes of direct copies left in this step
  bool guard_checked_ = false;  // the SIGBUS guard was put on top in this step
  uint64_t cancelling_ = 0;  // cancelled jobs not yet finished
  uint64_t posted_ = 0;      // data operations posted (UCX or direct copy)
  std::chrono::steady_clock::time_point next_stuck_check_{};
  uint64_t inflight_bytes_ = 0;
  // Endpoints (endpoints.cpp).
  std::unordered_map<uint64_t, std::unique_ptr<Endpoint>> eps_;
  // Retired while UCX still held their close request (its callback names
  // them): freed after the worker.
  std::vector<std::unique_ptr<Endpoint>> ep_graveyard_;
  std::vector<Endpoint*> failed_eps_;  // reported by the error callback
  bool any_forced_ = false;  // some endpoint was force-closed: look for stuck jobs
  // Regions and remote keys (registry.cpp).
  std::unordered_map<uint64_t, std::unique_ptr<RemoteKey>> rkeys_;
  // The mapped keys copy_inline may use (any thread, under inline_mu_): an
  // entry goes before its mapping does, or when its endpoint fails.
  struct InlineKey {
    uint64_t ep_id;
    uint8_t* mapped;
    uint64_t base;
    uint64_t len;
  };
  std::mutex inline_mu_;
  std::unordered_map<uint64_t, InlineKey> inline_keys_;
  void forget_inline(uint64_t rkey_id);
  void forget_inline_ep(uint64_t ep_id);
  // A copy_inline hit SIGBUS (under inline_mu_): forget the endpoint's
  // mapped keys, fail it on the progress thread, throw Error.
  [[noreturn]] void inline_fault(uint64_t ep_id);
  // Copy lanes: the lane threads, and the chunks queued to them
  // (progress thread only). drain_lanes() (jobs.cpp) applies what they did.
  CopyLanes lanes_;
  uint64_t lane_inflight_ = 0;
  bool drain_lanes();
  std::unordered_map<uint64_t, std::unique_ptr<Region>> regions_;
  uint64_t n_quarantined_ = 0;  // of regions_ (they stay there until close)
  void count_regions();  // stats_.regions: regions_ not quarantined
  // Lifecycle (engine.cpp).
  bool destroying_ = false;  // after shutdown: callbacks only free requests
  uint64_t next_region_ = 1, next_ep_ = 1, next_rkey_ = 1;

  // Ids of live jobs: filled by submit() before its command is queued, so a
  // wait right after submit() sees the job.
  std::mutex live_mu_;
  std::condition_variable live_cv_;
  std::unordered_set<uint64_t> live_ids_;
  std::mutex release_mu_;  // guards release_efd_ (closed at close())
  UniqueFd release_efd_;   // see release_fd()
  std::atomic<bool> release_armed_{false};

  std::atomic<uint64_t> next_job_{1};
  // inflight_bytes and unconfirmed_bytes copy inflight_bytes_ and
  // unconfirmed_ (progress thread only); regions excludes n_quarantined_.
  StatCounters stats_;
  uint64_t unconfirmed_ = 0;  // progress thread only
};

}  // namespace akv
