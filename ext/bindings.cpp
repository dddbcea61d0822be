// The only file that knows Python. Only ids, ints, bytes and buffers cross
// this boundary; every call that can wait releases the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstring>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine.hpp"
#include "ucxlog.hpp"

namespace py = pybind11;
using akv::Engine;

namespace {

std::vector<akv::SegmentIn> segments_from(const py::buffer& segs) {
  py::buffer_info info = segs.request();
  const std::string& fmt = info.format;
  bool u64 = info.itemsize == 8 && !fmt.empty() && (fmt.back() == 'Q' || fmt.back() == 'L');
  if (!u64) throw py::type_error("segments must be a uint64 array");
  if (info.ndim != 2 || info.shape[1] != 4) {
    throw akv::InvalidArgument("segments must have shape (n, 4): local, remote, length, rkey id");
  }
  if (info.shape[0] > 0 && (info.strides[1] != 8 || info.strides[0] != 32)) {
    throw akv::InvalidArgument("segments must be C-contiguous");
  }
  std::vector<akv::SegmentIn> out(static_cast<size_t>(info.shape[0]));
  if (!out.empty()) std::memcpy(out.data(), info.ptr, out.size() * sizeof(akv::SegmentIn));
  return out;
}

// Job ids as a uint64 array (copied whole, the fast path for big groups) or
// any sequence of ints.
std::vector<uint64_t> job_ids_from(const py::handle& ids) {
  if (PyObject_CheckBuffer(ids.ptr()) != 0) {
    py::buffer_info info = py::reinterpret_borrow<py::buffer>(ids).request();
    const std::string& fmt = info.format;
    bool u64 = info.itemsize == 8 && !fmt.empty() && (fmt.back() == 'Q' || fmt.back() == 'L');
    // A byte-swapped array takes the element-wise path, which converts it.
    bool swapped = fmt.front() == '>' || fmt.front() == '!';
    if (u64 && !swapped && info.ndim == 1) {
      std::vector<uint64_t> out(static_cast<size_t>(info.shape[0]));
      const auto* base = static_cast<const uint8_t*>(info.ptr);
      for (size_t i = 0; i < out.size(); ++i) {
        std::memcpy(&out[i], base + static_cast<ssize_t>(i) * info.strides[0], sizeof(uint64_t));
      }
      return out;
    }
  }
  try {
    return py::cast<std::vector<uint64_t>>(ids);
  } catch (const py::cast_error&) {
    throw py::type_error("job_ids must be a sequence of job ids (ints >= 0) or a uint64 array");
  }
}

// (kind, id, status, ucs_status, bytes, payload, posted_ns, done_ns) rows for
// the bridge.
py::list completions_list(const std::vector<akv::Completion>& items) {
  py::list out(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    const akv::Completion& c = items[i];
    out[i] = py::make_tuple(static_cast<int>(c.kind), c.id, static_cast<int>(c.status), c.ucs_status, c.bytes,
                            py::bytes(c.payload), c.posted_ns, c.done_ns);
  }
  return out;
}

}  // namespace

// The Python-facing engine also keeps registered buffer objects alive until
// their region is released.
struct PyEngine : Engine {
  using Engine::Engine;
  // Stop the engine before ``keep`` goes: in-flight jobs may still use
  // the buffers it holds (C++ would destroy members before ~Engine()).
  ~PyEngine() override {
    py::gil_scoped_release nogil;
    close();
  }
  // Memoryviews of registered buffers: each holds a buffer export, so the
  // object cannot be resized or unmapped while registered.
  std::unordered_map<uint64_t, py::object> keep;
};

namespace {

// A job's op, for every call that takes one: OP_PUT or OP_GET.
akv::Op op_from(int op) {
  if (op != static_cast<int>(akv::Op::kPut) && op != static_cast<int>(akv::Op::kGet)) {
    throw akv::InvalidArgument("op must be OP_PUT or OP_GET");
  }
  return static_cast<akv::Op>(op);
}

// A job's guard, for every call that takes one: None (no guard) or
// (rkey id, address, expected word[, strict]).
akv::GuardIn guard_from(const py::handle& obj) {
  if (obj.is_none()) return akv::GuardIn{};
  auto g = obj.cast<py::tuple>();
  if (g.size() != 3 && g.size() != 4) {
    throw akv::InvalidArgument("a guard is (rkey id, address, expected word[, strict])");
  }
  akv::GuardIn guard{g[0].cast<uint64_t>(), g[1].cast<uint64_t>(), g[2].cast<uint64_t>(),
                     g.size() == 4 && g[3].cast<bool>()};
  if (guard.rkey_id == 0) throw akv::InvalidArgument("a guard's rkey id must not be 0");
  return guard;
}

// (op, ep_id, segments, payload, timeout_ms[, guard]) rows: one crossing.
std::vector<akv::JobSpec> specs_from(const py::list& jobs) {
  std::vector<akv::JobSpec> specs;
  specs.reserve(jobs.size());
  for (size_t i = 0; i < jobs.size(); ++i) {
    auto row = jobs[i].cast<py::tuple>();
    if (row.size() != 5 && row.size() != 6) {
      throw akv::InvalidArgument("a job is (op, ep_id, segments, payload, timeout_ms[, guard])");
    }
    akv::Op op = op_from(row[0].cast<int>());
    akv::GuardIn guard = row.size() == 6 ? guard_from(row[5]) : akv::GuardIn{};
    specs.push_back(akv::JobSpec{op, row[1].cast<uint64_t>(),
                                 segments_from(row[2].cast<py::buffer>()),
                                 row[3].cast<std::string>(), row[4].cast<uint64_t>(), guard});
  }
  return specs;
}

// The exception types, each a Python class of its own (errors.hpp).
void bind_errors(py::module_& m) {
  // NativeError is a RuntimeError and InvalidArgumentError a ValueError:
  // code that catches RuntimeError or ValueError catches them too.
  static py::exception<akv::Error> native_exc(m, "NativeError", PyExc_RuntimeError);
  static py::exception<akv::ClosedError> closed_exc(m, "EngineClosedError", native_exc);
  static py::exception<akv::InvalidArgument> invalid_exc(
      m, "InvalidArgumentError", py::make_tuple(native_exc, py::handle(PyExc_ValueError)));
  static py::exception<akv::PeerInput> peer_exc(m, "PeerInputError", invalid_exc);
  static py::exception<akv::UcxFailure> ucx_exc(m, "UcxError", native_exc);
  native_exc.attr("__doc__") = "A failure of the native engine.";
  closed_exc.attr("__doc__") = "The engine is closed: calls that need its progress thread fail.";
  invalid_exc.attr("__doc__") =
      "A bad argument (unknown region, endpoint or key id, a bad segment table, a payload too large).";
  peer_exc.attr("__doc__") =
      "A peer's bytes (a worker address, a packed remote key) are malformed: refused before UCX read them.";
  ucx_exc.attr("__doc__") = "A UCX call failed; ucs_status is its status (see ucs_status_string).";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const akv::ClosedError& e) {
      py::set_error(closed_exc, e.what());
    } catch (const akv::PeerInput& e) {
      py::set_error(peer_exc, e.what());
    } catch (const akv::InvalidArgument& e) {
      py::set_error(invalid_exc, e.what());
    } catch (const akv::UcxFailure& e) {
      py::object exc = py::handle(ucx_exc)(e.what());
      exc.attr("ucs_status") = static_cast<int>(e.status());
      py::set_error(ucx_exc, exc);
    } catch (const akv::Error& e) {
      py::set_error(native_exc, e.what());
    }
  });
}

// Constants Python reads: ops, entry kinds, statuses (status.def), transports
// (transports.def), limits.
void bind_constants(py::module_& m) {
  m.attr("OP_PUT") = static_cast<int>(akv::Op::kPut);
  m.attr("OP_GET") = static_cast<int>(akv::Op::kGet);
  m.attr("KIND_JOB") = static_cast<int>(akv::EntryKind::kJob);
  m.attr("KIND_NOTIFY") = static_cast<int>(akv::EntryKind::kNotify);
  m.attr("KIND_ENDPOINT") = static_cast<int>(akv::EntryKind::kEndpoint);
  // (value, "NAME", "words", "LLM_NAME") rows: Python builds its status
  // maps from these instead of repeating the table.
  py::list statuses;
#define AKV_STATUS(NAME, value, words, llm)                     \
  m.attr("ST_" #NAME) = static_cast<int>(akv::Status::k##NAME); \
  statuses.append(py::make_tuple(static_cast<int>(akv::Status::k##NAME), #NAME, words, #llm));
#include "status.def"
#undef AKV_STATUS
  m.attr("STATUSES") = py::tuple(statuses);
  // (name, "UCX TLS", "means", "use when") rows (transports.def): the option
  // table and the docs read these instead of repeating the table.
  py::list transports;
#define AKV_TRANSPORT(name, tls, means, use_when) transports.append(py::make_tuple(#name, tls, means, use_when));
#include "transports.def"
#undef AKV_TRANSPORT
  m.attr("TRANSPORTS") = py::tuple(transports);
  m.attr("MAX_PAYLOAD") = akv::Engine::kMaxPayload;
  m.attr("NOTE_KEY_LEN") = akv::Engine::kNoteKeyLen;
  m.attr("INLINE_COPIED") = akv::Engine::kInlineCopied;
  m.attr("INLINE_NO") = akv::Engine::kInlineNo;
  m.attr("INLINE_RETIRED") = akv::Engine::kInlineRetired;
  m.attr("MAX_QUEUED_NOTES") = akv::Engine::kMaxQueuedNotes;
}

// Module functions: UCX's log and version, buffers over raw memory.
void bind_functions(py::module_& m) {
  akv::ucx_log_install();
  m.def("ucx_log_pending", &akv::ucx_log_pending);
  m.def("ucx_log_take", []() {
    uint64_t dropped = 0;
    std::vector<akv::UcxLogLine> lines = akv::ucx_log_take(&dropped);
    py::list out;
    for (const auto& l : lines) out.append(py::make_tuple(l.level, l.component, l.where, l.text));
    return py::make_tuple(out, dropped);
  });
  m.def(
      "ucx_log_emit",
      [](int level, const std::string& text) { akv::ucx_log_emit(level, text); },
      py::arg("level"), py::arg("text"),
      "Emit one line through UCX's own log dispatcher (as UCX itself would), at ucs_log_level_t level.");
  m.def("ucx_version", []() {
    unsigned major, minor, release;
    ucp_get_version(&major, &minor, &release);
    return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(release);
  });
  m.def(
      "ucs_status_string", [](int st) { return std::string(ucs_status_string(static_cast<ucs_status_t>(st))); },
      py::arg("status"));
  m.def(
      "prefault",
      [](uint64_t addr, uint64_t len, bool allocated) {
        if (addr == 0) throw akv::InvalidArgument("address must not be 0");
        py::gil_scoped_release nogil;
        auto what = allocated ? akv::Prefault::kAllocated : akv::Prefault::kUser;
        return akv::prefault(reinterpret_cast<void*>(addr), len, what);
      },
      py::arg("address"), py::arg("length"), py::arg("allocated") = false,
      "Fault in every page of [address, address + length) (see memory.hpp).");
  m.def(
      "buffer_from_address",
      [](uint64_t addr, uint64_t len, bool readonly) {
        if (addr == 0) throw akv::InvalidArgument("address must not be 0");
        return py::memoryview::from_memory(reinterpret_cast<void*>(addr), static_cast<ssize_t>(len), readonly);
      },
      py::arg("address"), py::arg("length"), py::arg("readonly") = false);
}

// Engine: construction and what it reports about itself.
void bind_engine_setup(py::class_<PyEngine>& cls) {
  cls
      .def(py::init([](const std::string& transport, uint64_t max_inflight_bytes, uint64_t chunk_bytes,
                       const std::map<std::string, std::string>& ucx_options, bool direct_copy,
                       uint64_t max_unconfirmed_bytes, unsigned copy_lanes, uint64_t progress_spin_us,
                       uint64_t keepalive_ms, bool prewarm, bool prefault) {
             akv::EngineConfig cfg;
             cfg.transport = transport;
             cfg.max_inflight_bytes = max_inflight_bytes;
             cfg.chunk_bytes = chunk_bytes;
             cfg.direct_copy = direct_copy;
             cfg.prewarm = prewarm;
             cfg.prefault = prefault;
             cfg.max_unconfirmed_bytes = max_unconfirmed_bytes;
             cfg.copy_lanes = copy_lanes;
             if (progress_spin_us > 100000) throw akv::InvalidArgument("progress_spin_us must be <= 100000");
             cfg.spin = std::chrono::microseconds(progress_spin_us);
             if (keepalive_ms > 3600000) throw akv::InvalidArgument("keepalive_ms must be <= 3600000");
             cfg.keepalive = std::chrono::milliseconds(keepalive_ms);
             for (const auto& kv : ucx_options) cfg.ucx_options.emplace_back(kv.first, kv.second);
             py::gil_scoped_release nogil;
             return new PyEngine(std::move(cfg));
           }),
           py::arg("transport") = "auto", py::arg("max_inflight_bytes") = 64ull << 20,
           py::arg("chunk_bytes") = 1ull << 20,
           py::arg("ucx_options") = std::map<std::string, std::string>{}, py::arg("direct_copy") = true,
           py::arg("max_unconfirmed_bytes") = 2ull << 20, py::arg("copy_lanes") = 0u,
           py::arg("progress_spin_us") = 100u, py::arg("keepalive_ms") = 0u, py::arg("prewarm") = false,
           py::arg("prefault") = false)
      .def_property_readonly("copy_lanes", [](const PyEngine& e) { return e.copy_lanes(); })
      .def_property_readonly("progress_spin_us", [](const PyEngine& e) { return e.progress_spin_us(); })
      .def_property_readonly("event_fd", &Engine::event_fd)
      .def_property_readonly("release_fd", [](PyEngine& e) { return e.release_fd(); })
      .def("arm_release_signal", &Engine::arm_release_signal)
      .def_property_readonly("worker_address", [](const PyEngine& e) { return py::bytes(e.worker_address()); })
      .def_property_readonly("closed", &Engine::closed)
      .def_property_readonly("prewarm_ns", &Engine::prewarm_ns)
      .def_property_readonly("prewarmed", &Engine::prewarmed)
      .def_property_readonly("closing", &Engine::closing)
      .def("info", &Engine::info, py::call_guard<py::gil_scoped_release>())
      .def("ucx_config", &Engine::ucx_config);
}

// Engine: memory regions.
void bind_engine_memory(py::class_<PyEngine>& cls) {
  cls
      .def("mem_alloc", &Engine::mem_alloc, py::arg("length"), py::call_guard<py::gil_scoped_release>())
      .def("mem_register", &Engine::mem_register, py::arg("address"), py::arg("length"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "mem_register_buffer",
          [](PyEngine& e, const py::object& obj) {
            py::buffer buf = py::reinterpret_borrow<py::buffer>(obj);
            py::buffer_info info = buf.request(true);  // writable
            ssize_t expect = info.itemsize;
            for (ssize_t i = info.ndim - 1; i >= 0; --i) {
              if (info.shape[i] > 1 && info.strides[i] != expect) throw akv::InvalidArgument("buffer must be C-contiguous");
              expect *= info.shape[i];
            }
            uint64_t len = static_cast<uint64_t>(info.size * info.itemsize);
            if (len == 0) throw akv::InvalidArgument("buffer is empty");
            uint64_t addr = reinterpret_cast<uint64_t>(info.ptr);
            uint64_t rid;
            {
              py::gil_scoped_release nogil;
              rid = e.mem_register(addr, len);
            }
            e.keep[rid] = py::memoryview(obj);
            return py::make_tuple(rid, addr, len);
          },
          py::arg("buffer"))
      .def(
          "mem_release",
          [](PyEngine& e, uint64_t rid) {
            {
              py::gil_scoped_release nogil;
              e.mem_release(rid);
            }
            e.keep.erase(rid);
          },
          py::arg("region_id"))
      .def("mem_quarantine", &Engine::mem_quarantine, py::arg("region_id"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "rkey_pack",
          [](PyEngine& e, uint64_t rid) {
            std::string s;
            {
              py::gil_scoped_release nogil;
              s = e.rkey_pack(rid);
            }
            return py::bytes(s);
          },
          py::arg("region_id"));
}

// Engine: endpoints, liveness and remote keys.
void bind_engine_links(py::class_<PyEngine>& cls) {
  cls
      .def(
          "connect",
          [](PyEngine& e, const py::bytes& addr, bool peer_errors, const py::bytes& send_key,
             const py::bytes& recv_key, uint64_t peer_id) {
            std::string a = addr;
            akv::NoteKeys keys{send_key, recv_key, peer_id};
            py::gil_scoped_release nogil;
            return e.connect(a, peer_errors, keys);
          },
          py::arg("worker_address"), py::arg("peer_errors") = true, py::arg("send_key") = py::bytes(),
          py::arg("recv_key") = py::bytes(), py::arg("peer_id") = 0)
      .def("disconnect", &Engine::disconnect, py::arg("ep_id"), py::call_guard<py::gil_scoped_release>())
      .def(
          "set_note_keys",
          [](PyEngine& e, uint64_t ep, const py::bytes& send_key, const py::bytes& recv_key, uint64_t peer_id) {
            std::string s = send_key, r = recv_key;
            py::gil_scoped_release nogil;
            e.set_note_keys(ep, s, r, peer_id);
          },
          py::arg("ep_id"), py::arg("send_key"), py::arg("recv_key"), py::arg("peer_id"))
      .def("fail_endpoint", &Engine::fail_endpoint, py::arg("ep_id"), py::call_guard<py::gil_scoped_release>())
      .def("endpoint_closed", &Engine::endpoint_closed, py::arg("ep_id"),
           py::call_guard<py::gil_scoped_release>())
      .def("endpoint_unproven", &Engine::endpoint_unproven, py::arg("ep_id"),
           py::call_guard<py::gil_scoped_release>())
      .def("silent_s", &Engine::silent_s, py::arg("ep_id"), py::call_guard<py::gil_scoped_release>())
      .def("keepalive_now", &Engine::keepalive_now, py::arg("ep_id"), py::call_guard<py::gil_scoped_release>())
      .def(
          "rkey_unpack",
          [](PyEngine& e, uint64_t ep, const py::bytes& packed, uint64_t base, uint64_t len) {
            std::string p = packed;
            py::gil_scoped_release nogil;
            return e.rkey_unpack(ep, p, base, len);
          },
          py::arg("ep_id"), py::arg("packed"), py::arg("base"), py::arg("length"))
      .def("rkey_release", &Engine::rkey_release, py::arg("rkey_id"), py::call_guard<py::gil_scoped_release>());
}

// Engine: submitting jobs.
void bind_engine_jobs(py::class_<PyEngine>& cls) {
  cls
      .def(
          "submit",
          [](PyEngine& e, int op, uint64_t ep, const py::buffer& segs, const py::bytes& payload, uint64_t timeout_ms) {
            akv::Op checked = op_from(op);
            std::vector<akv::SegmentIn> v = segments_from(segs);
            std::string p = payload;
            return e.submit(checked, ep, std::move(v), std::move(p), timeout_ms);
          },
          py::arg("op"), py::arg("ep_id"), py::arg("segments"), py::arg("payload") = py::bytes(),
          py::arg("timeout_ms") = 0)
      .def(
          "submit_many",
          [](PyEngine& e, const py::list& jobs) {
            // The GIL stays held: this never blocks (a short lock), and a
            // release would let the service thread in for a context switch.
            return e.submit_many(specs_from(jobs));
          },
          py::arg("jobs"))
      .def(
          "copy_inline",
          [](PyEngine& e, int op, uint64_t ep, const py::list& tables, uint64_t max_bytes, const py::object& guard) {
            akv::Op checked = op_from(op);
            std::vector<std::vector<akv::SegmentIn>> jobs;
            jobs.reserve(tables.size());
            for (const auto& t : tables) jobs.push_back(segments_from(t.cast<py::buffer>()));
            return e.copy_inline(checked, ep, jobs, max_bytes, guard_from(guard));
          },
          py::arg("op"), py::arg("ep_id"), py::arg("tables"), py::arg("max_bytes"), py::arg("guard") = py::none());
}

// Engine: cancellation, waiting for release, completions, stats and close.
void bind_engine_completions(py::class_<PyEngine>& cls) {
  cls
      .def("cancel", &Engine::cancel, py::arg("job_id"))
      .def(
          "cancel_many", [](PyEngine& e, const py::handle& ids) { e.cancel_many(job_ids_from(ids)); },
          py::arg("job_ids"))
      .def(
          "wait_released",
          [](PyEngine& e, const py::handle& ids, double timeout) {
            std::vector<uint64_t> v = job_ids_from(ids);
            // In slices, so that Ctrl-C reaches a main thread blocked here.
            constexpr double kSlice = 0.1;
            auto start = std::chrono::steady_clock::now();
            while (true) {
              double left = timeout - std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
              bool last = !(left > kSlice);  // also for NaN: the engine rejects it
              bool released;
              {
                py::gil_scoped_release nogil;
                released = e.wait_released(v, last ? left : kSlice);
              }
              if (released || last) return released;
              if (PyErr_CheckSignals() != 0) throw py::error_already_set();
            }
          },
          py::arg("job_ids"), py::arg("timeout"))
      .def("drain", [](PyEngine& e) { return completions_list(e.drain()); })
      .def("take", [](PyEngine& e) { return completions_list(e.take()); })
      .def("stats",
           [](const PyEngine& e) {
             akv::EngineStats s = e.stats();
             py::dict d;
#define AKV_STAT(name, doc) d[#name] = s.name;
#include "stats.def"
#undef AKV_STAT
             return d;
           })
      .def(
          "close",
          [](PyEngine& e) {
            {
              py::gil_scoped_release nogil;
              e.close();
            }
            // Closed means stopped: nothing touches a registered buffer any
            // more, so the exports held for them go now, not with the object.
            if (e.closed()) e.keep.clear();
          });
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "aiokvcache native transfer engine (UCX)";
  static_assert(sizeof(akv::SegmentIn) == 32, "segment rows are four uint64");
  bind_errors(m);
  bind_constants(m);
  bind_functions(m);
  py::class_<PyEngine> cls(m, "Engine");
  bind_engine_setup(cls);
  bind_engine_memory(cls);
  bind_engine_links(cls);
  bind_engine_jobs(cls);
  bind_engine_completions(cls);
}
