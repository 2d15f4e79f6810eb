// Python binding: torch tensors in, typed spans out. Thin and defensive; the ring lives elsewhere.
#include <algorithm>
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <torch/csrc/autograd/python_variable.h>

#include "binding/fast_path.h"
#include "binding/shm_comm.h"
#include "binding/torch_types.h"
#include "cpu/wire.h"
#include "cuda/nccl/defaults.h"
#include "cuda/p2p/layout.h"
#include "cuda/p2p/plan.h"
#include "runtime/shm_map.h"

namespace rr = ringreduce;

// Defined in csrc/binding/backend.cpp: the torch.distributed backend's C++ half.
void register_backend(py::module_& m);

#ifdef RINGREDUCE_WITH_CUDA
// Defined in csrc/binding/cuda_comm.cpp: adds the CUDA communicator classes to the module.
void register_cuda(py::module_& m);
#endif

namespace {

using rr::binding::ShmComm;
using ShmPtr = std::shared_ptr<ShmComm>;

// The flight recorder as the Python transports (hierarchical, CUDA) and dumps use it.
void register_recorder(py::module_& m) {
  namespace runtime = rr::runtime;
  using Rec = runtime::Recorder;
  py::class_<Rec, std::shared_ptr<Rec>>(m, "Recorder")
      .def(py::init([](size_t capacity) {  // checked by Python (_lifecycle.trace_buffer)
             auto r = std::make_shared<Rec>(capacity);
             Rec::add(r);
             return r;
           }),
           py::arg("capacity"))
      .def_property_readonly("on", &Rec::on)
      .def_property_readonly("capacity", &Rec::capacity)
      .def("begin", [](Rec& r, const std::string& coll, int64_t numel, const std::string& dtype,
                       const std::string& op, const std::string& algo, int64_t nbytes, bool started) {
        if (!r.on()) return uint64_t{0};
        const int64_t t = runtime::now_ns();
        return r.begin(r.intern(coll), r.intern(dtype), r.intern(op), r.intern(algo), numel,
                       static_cast<uint64_t>(nbytes), runtime::current_source(), t, started ? t : 0);
      }, py::arg("coll"), py::arg("numel"), py::arg("dtype"), py::arg("op"), py::arg("algo"),
         py::arg("nbytes"), py::arg("started") = true,
         "records a new call made now by this thread's source; returns its seq (0: off)")
      .def("started", [](Rec& r, uint64_t seq) { r.started(seq); }, py::arg("seq"))
      .def("finished", [](Rec& r, uint64_t seq) { r.finished(seq); }, py::arg("seq"))
      .def("failed", [](Rec& r, uint64_t seq, const std::string& e) { r.failed(seq, e); },
           py::arg("seq"), py::arg("error"))
      .def("set_algo", [](Rec& r, uint64_t seq, const std::string& a) { r.set_algo(seq, r.intern(a)); },
           py::arg("seq"), py::arg("algo"))
      .def("configure", &Rec::configure, py::arg("dir"), py::arg("file"), py::arg("header"))
      .def("json", &Rec::json, py::call_guard<py::gil_scoped_release>())
      .def("dump", [](Rec& r, const std::string& path) {
        std::string error, out;
        {
          py::gil_scoped_release nogil;
          out = r.dump(path, &error);
        }
        if (out.empty()) throw std::runtime_error("ringreduce: trace dump failed: " + error);
        return out;
      }, py::arg("path") = "", "writes the dump (path '': the configured file); returns its path")
      .def("fail_and_dump", &Rec::fail_and_dump, py::call_guard<py::gil_scoped_release>(),
           py::arg("seq"), py::arg("error"), "marks seq failed, dumps once; error naming the dump")
      .def("dump_on_failure", &Rec::dump_on_failure, py::call_guard<py::gil_scoped_release>(),
           "the first failure's dump (written once); '' when none could be written");
  m.def("trace_source", [](const std::string& name) {
    runtime::Source s;
    TORCH_CHECK_VALUE(runtime::parse_source(name, s), "ringreduce: unknown call source '", name, "'");
    const char* before = runtime::source_name(runtime::current_source());
    runtime::current_source() = s;
    return std::string(before);
  }, py::arg("name"), "sets this thread's call source for the flight recorder; returns the old one");
  m.def("install_trace_signal", [](int signo) {
    std::string error;
    if (!runtime::install_dump_signal(signo, &error))
      throw std::runtime_error("ringreduce: RINGREDUCE_TRACE_SIGNAL: " + error);
  }, py::arg("signo"), "a signal that dumps every flight recorder of the process (idempotent)");
}

// A call from Python: None when synchronous, else the call's Work (a c10d Work).
py::object start(ShmComm& c, rr::binding::Prepared p, bool async_op, const char* op) {
  rr::binding::WorkPtr w = c.start(std::move(p), async_op, rr::binding::op_type(op), /*gil=*/true);
  if (!w) return py::none();
  return py::cast(w);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ringreduce native core: ring collectives over shared memory";
  rr::binding::ring_error_type() =
      py::register_exception<rr::RingError>(m, "RingReduceError", PyExc_RuntimeError).ptr();
  rr::binding::main_thread_ident() = PyThread_get_thread_ident();

  // Every call takes async_op: False runs it now (None; errors raised here), True queues it and
  // returns its Work. Non-contiguous tensors are run through contiguous copies.
  py::class_<ShmComm, ShmPtr>(m, "ShmComm")
      .def(py::init<const std::string&, bool, int, int, size_t, double, int64_t, int64_t,
                    const std::string&, int64_t, size_t, const std::string&,
                    const std::vector<rr::binding::AutoStep>&, uint64_t>(),
           py::arg("name"), py::arg("create"), py::arg("rank"), py::arg("nranks"), py::arg("slice_bytes"),
           py::arg("timeout_s"), py::arg("spin_ns"), py::arg("yield_ns") = 0, py::arg("algo") = "auto",
           py::arg("oneshot_max_bytes") = 0, py::arg("trace_buffer") = rr::runtime::Recorder::kDefaultCapacity, py::arg("stream") = "auto",
           py::arg("auto_steps") = std::vector<rr::binding::AutoStep>{},
           py::arg("cma_block_bytes") = static_cast<uint64_t>(rr::shm::kDefaultSliceBytes))
      .def("set_auto_steps", &ShmComm::set_auto_steps, py::arg("steps"))
      .def("cma_probe", &ShmComm::cma_probe,
           "'' when this rank can read every peer's memory by cross-memory attach, else why not")
      .def("drop_cma_scratch", &ShmComm::drop_cma_scratch,
           "frees the scratch cma read whole chunks into (after the calibration's timings)")
      .def("recorder", &ShmComm::recorder, "this communicator's flight recorder")
      .def("pids", &ShmComm::pids, "every rank's process id")
      .def("pool_create", &ShmComm::pool_create, py::arg("name"), py::arg("bytes"))
      .def("pool_attach", &ShmComm::pool_attach, py::arg("names"))
      .def("pool_drop", &ShmComm::pool_drop)
      .def("all_reduce", [](ShmComm& c, const at::Tensor& t, int op, bool async_op, int wire) {
        return start(c, c.all_reduce(t, op, wire), async_op, "allreduce");
      }, py::arg("tensor"), py::arg("op"), py::arg("async_op") = false, py::arg("wire") = 0)
      .def("try_all_reduce", [](ShmComm& c, py::handle t, int op) { return c.try_all_reduce(t.ptr(), op); },
           py::arg("tensor"), py::arg("op"))
      .def("fast_all_reduce", [](py::object self, const std::vector<py::object>& ops,
                                 const std::vector<py::object>& wires) {
        ShmComm* c = self.cast<ShmComm*>();
        return rr::binding::make_fast_path(std::move(self), c, ops, wires);
      }, py::arg("ops"), py::arg("wires") = std::vector<py::object>(),
         "A function fast(tensor, op[, async_op[, wire_dtype]]) -> bool running try_all_reduce; "
         "wires[code] is each wire_dtype object (code 0: None); ops[code] is "
         "the ReduceOp object of each op code")
      .def("reduce_scatter", [](ShmComm& c, const at::Tensor& out, const at::Tensor& in, int op,
                                bool async_op, int wire) {
        return start(c, c.reduce_scatter(out, in, op, wire), async_op, "_reduce_scatter_base");
      }, py::arg("output"), py::arg("input"), py::arg("op"), py::arg("async_op") = false,
         py::arg("wire") = 0)
      .def("all_gather", [](ShmComm& c, const at::Tensor& out, const at::Tensor& in, bool async_op) {
        return start(c, c.all_gather(out, in), async_op, "_allgather_base");
      }, py::arg("output"), py::arg("input"), py::arg("async_op") = false)
      .def("abort", &ShmComm::abort, py::arg("why"))
      .def("broken", &ShmComm::broken)
      .def("reason", &ShmComm::reason)
      .def("slice_bytes", &ShmComm::slice_bytes)
      .def("op_seq", &ShmComm::op_seq)
      .def("algo", &ShmComm::algo, py::arg("numel"), py::arg("like"))
      .def("stream_switches", &ShmComm::stream_switches,
           "how often RINGREDUCE_STREAM=auto switched to non-temporal stores after a slow copy")
      .def("inflight", &ShmComm::inflight, "calls queued or running")
      .def("synchronize", [](ShmComm& c) { c.synchronize(/*gil=*/true); },
           "waits until every call made so far has finished")
      .def("close", &ShmComm::close, py::call_guard<py::gil_scoped_release>())
      .def("closed", &ShmComm::closed);

  register_recorder(m);

  // Direct API's Work.wait(): runs the call here if it is still queued (see Executor).
  m.def("ring_work_help", [](const rr::binding::WorkPtr& work) {
    if (auto* w = dynamic_cast<rr::binding::RingWork*>(work.get())) w->help();
  }, py::arg("work"));
  // Direct API's Work.wait() with no timeout: help(), then the call's error (RingReduceError), if
  // any. Cheaper than torch's Work.wait (no timedelta argument to convert).
  m.def("ring_work_wait", [](const rr::binding::WorkPtr& work) {
    work->wait(std::chrono::milliseconds(0));  // kNoTimeout; after help() it is complete
  }, py::arg("work"));
  m.def("set_deterministic", &rr::set_deterministic, py::arg("on"));
  m.def("deterministic", &rr::deterministic);
  // out = the rank-order fold of rows' rows (accumulation type, one rounding; AVG divides by the
  // row count): the hierarchical plan's deterministic mode, and the kernel's tests.
  m.def("reduce_rows", [](at::Tensor& out, const at::Tensor& rows, int op) {
    TORCH_CHECK_VALUE(rows.dim() == 2 && rows.is_contiguous() && !rows.is_cuda(),
                      "ringreduce.reduce_rows: rows must be a contiguous 2-D CPU tensor, got ",
                      rows.sizes(), rows.is_cuda() ? " on CUDA" : "");
    TORCH_CHECK_VALUE(out.is_contiguous() && !out.is_cuda() && out.numel() == rows.size(1) &&
                          out.scalar_type() == rows.scalar_type(),
                      "ringreduce.reduce_rows: out must be a contiguous CPU tensor of ", rows.size(1),
                      " elements of ", rows.scalar_type(), ", got ", out.numel(), " of ",
                      out.scalar_type());
    const rr::DType dt = rr::binding::to_dtype(rows, "rows");
    const int n = static_cast<int>(rows.size(0));
    std::vector<const void*> srcs(n);
    const auto* base = static_cast<const char*>(rows.data_ptr());
    for (int q = 0; q < n; ++q) srcs[q] = base + q * rows.stride(0) * rows.element_size();
    const rr::RedOp o = rr::binding::to_op(op);
    py::gil_scoped_release nogil;
    rr::cpu::reduce_rows(dt, o, out.data_ptr(), srcs.data(), n, out.numel(),
                         o == rr::RedOp::Avg ? n : 1);
  }, py::arg("out"), py::arg("rows"), py::arg("op"));
  // out = what a wire call gives for these rows (one per rank, rank order): each rounded onto the
  // wire, folded in fp32, divided by the row count for AVG, rounded again when round_result
  // (all-reduce; reduce-scatter does not). The wire kernels' tests compare it with torch.
  m.def("wire_fold", [](at::Tensor& out, const at::Tensor& rows, int op, int wire, bool round_result) {
    TORCH_CHECK_VALUE(rows.dim() == 2 && rows.is_contiguous() && !rows.is_cuda() &&
                          out.is_contiguous() && out.numel() == rows.size(1) &&
                          out.scalar_type() == rows.scalar_type(),
                      "ringreduce.wire_fold: rows (ranks x n, contiguous, CPU) and out (n) of one dtype");
    const rr::Wire w = rr::binding::to_wire(wire, rows, op, "rows");
    TORCH_CHECK_VALUE(w != rr::Wire::None, "ringreduce.wire_fold: no wire");
    const rr::DType dt = rr::binding::to_dtype(rows, "rows");
    const int n = static_cast<int>(rows.size(0));
    const int64_t len = rows.size(1);
    std::vector<std::vector<char>> enc(n, std::vector<char>(rr::wire_span_bytes(w, len)));
    std::vector<char> res(rr::wire_span_bytes(w, len));
    std::vector<const void*> srcs(n);
    const auto* base = static_cast<const char*>(rows.data_ptr());
    py::gil_scoped_release nogil;
    int64_t over = 0;
    for (int q = 0; q < n; ++q) {
      over += rr::cpu::wire_encode(w, dt, base + q * len * rows.element_size(), len, enc[q].data());
      srcs[q] = enc[q].data();
    }
    over += rr::cpu::wire_reduce(w, srcs.data(), n, len, op == static_cast<int>(rr::RedOp::Avg) ? n : 1,
                                 round_result ? res.data() : nullptr, dt, out.data_ptr());
    return over;
  }, py::arg("out"), py::arg("rows"), py::arg("op"), py::arg("wire"), py::arg("round_result"));
  // out = src rounded onto the wire and back (what a wire call sends of src): the DDP wire hooks'
  // error feedback. Returns the fp16 overflows.
  m.def("wire_round", [](at::Tensor& out, const at::Tensor& src, int wire) {
    TORCH_CHECK_VALUE(src.is_contiguous() && out.is_contiguous() && !src.is_cuda() && !out.is_cuda() &&
                          out.numel() == src.numel() && out.scalar_type() == src.scalar_type(),
                      "ringreduce.wire_round: out and src contiguous CPU tensors of one size and dtype");
    const rr::Wire w = rr::binding::to_wire(wire, src, 0, "src");
    TORCH_CHECK_VALUE(w != rr::Wire::None, "ringreduce.wire_round: no wire");
    const rr::DType dt = rr::binding::to_dtype(src, "src");
    const int64_t n = src.numel();
    py::gil_scoped_release nogil;
    constexpr int64_t kPiece = 64 * rr::kWireBlock;  // blocks from element 0, as a call's
    std::vector<char> enc(rr::wire_span_bytes(w, kPiece));
    const size_t es = src.element_size();
    int64_t over = 0;
    for (int64_t i = 0; i < n; i += kPiece) {
      const int64_t k = std::min(kPiece, n - i);
      over += rr::cpu::wire_encode(w, dt, static_cast<const char*>(src.data_ptr()) + i * es, k, enc.data());
      rr::cpu::wire_decode(w, enc.data(), k, dt, static_cast<char*>(out.data_ptr()) + i * es);
    }
    return over;
  }, py::arg("out"), py::arg("src"), py::arg("wire"));
  // The wire kernels on raw bytes, for the plans that move the wire bytes themselves (groups across
  // hosts, _hier.py): a span of n elements is wire_bytes(wire, n) bytes (csrc/cpu/wire.h).
  m.def("wire_bytes", [](int wire, int64_t n) {
    TORCH_CHECK_VALUE(wire > 0 && wire < static_cast<int>(rr::Wire::kCount), "ringreduce: wire ", wire);
    return static_cast<int64_t>(rr::wire_span_bytes(rr::Wire(wire), n));
  }, py::arg("wire"), py::arg("n"));
  m.def("wire_encode", [](at::Tensor& out, const at::Tensor& src, int wire) {
    const rr::Wire w = rr::binding::to_wire(wire, src, 0, "src");
    TORCH_CHECK_VALUE(w != rr::Wire::None && src.is_contiguous() && !src.is_cuda() &&
                          out.is_contiguous() && out.scalar_type() == at::kByte &&
                          static_cast<size_t>(out.numel()) == rr::wire_span_bytes(w, src.numel()),
                      "ringreduce.wire_encode: out must be ", rr::wire_span_bytes(w, src.numel()),
                      " contiguous uint8 for a contiguous CPU src of ", src.numel());
    const rr::DType dt = rr::binding::to_dtype(src, "src");
    py::gil_scoped_release nogil;
    return rr::cpu::wire_encode(w, dt, src.data_ptr(), src.numel(), out.data_ptr());
  }, py::arg("out"), py::arg("src"), py::arg("wire"));
  m.def("wire_decode", [](at::Tensor& out, const at::Tensor& src, int wire) {
    const rr::Wire w = rr::binding::to_wire(wire, out, 0, "out");
    TORCH_CHECK_VALUE(w != rr::Wire::None && out.is_contiguous() && !out.is_cuda() &&
                          src.is_contiguous() && src.scalar_type() == at::kByte &&
                          static_cast<size_t>(src.numel()) == rr::wire_span_bytes(w, out.numel()),
                      "ringreduce.wire_decode: src must be ", rr::wire_span_bytes(w, out.numel()),
                      " contiguous uint8 for a contiguous CPU out of ", out.numel());
    const rr::DType dt = rr::binding::to_dtype(out, "out");
    py::gil_scoped_release nogil;
    rr::cpu::wire_decode(w, src.data_ptr(), out.numel(), dt, out.data_ptr());
  }, py::arg("out"), py::arg("src"), py::arg("wire"));
  // out = the fold of rows (one wire span of out.numel() elements per row, rank order); AVG
  // divides by the row count; wire_out (or None): the result rounded onto the wire, and out then
  // holds those values. Returns the fp16 overflows of that rounding.
  m.def("wire_reduce", [](at::Tensor& out, std::optional<at::Tensor> wire_out, const at::Tensor& rows,
                          int op, int wire) {
    const rr::Wire w = rr::binding::to_wire(wire, out, op, "out");
    const size_t wb = rr::wire_span_bytes(w, out.numel());
    TORCH_CHECK_VALUE(w != rr::Wire::None && out.is_contiguous() && !out.is_cuda() &&
                          rows.dim() == 2 && (rows.size(0) < 2 || rows.stride(1) == 1) &&
                          rows.scalar_type() == at::kByte && static_cast<size_t>(rows.size(1)) == wb &&
                          (!wire_out || (wire_out->is_contiguous() && wire_out->scalar_type() == at::kByte &&
                                         static_cast<size_t>(wire_out->numel()) == wb)),
                      "ringreduce.wire_reduce: rows (ranks x ", wb, " uint8, rows contiguous) and wire_out (", wb,
                      " uint8) for out of ", out.numel());
    const rr::DType dt = rr::binding::to_dtype(out, "out");
    const int n = static_cast<int>(rows.size(0));
    std::vector<const void*> srcs(n);
    for (int q = 0; q < n; ++q) srcs[q] = static_cast<const char*>(rows.data_ptr()) + q * rows.stride(0);
    void* wo = wire_out ? wire_out->data_ptr() : nullptr;
    py::gil_scoped_release nogil;
    return rr::cpu::wire_reduce(w, srcs.data(), n, out.numel(),
                                op == static_cast<int>(rr::RedOp::Avg) ? n : 1, wo, dt, out.data_ptr());
  }, py::arg("out"), py::arg("wire_out"), py::arg("rows"), py::arg("op"), py::arg("wire"));
  m.def("shm_unlink", &rr::runtime::shm_unlink, py::arg("name"));
  m.def("segment_bytes", &rr::shm::segment_bytes, py::arg("nranks"), py::arg("slice_bytes"));
  // The one dtype check of a collective's tensor (binding/torch_types.h), for the Python API to ask
  // before it creates a communicator (collectively: a rank refused later strands its peers).
  m.def("check_dtype", [](const at::Tensor& t, const std::string& arg, const std::string& api) {
    rr::binding::to_dtype(t, arg.c_str(), api.c_str());
  }, py::arg("tensor"), py::arg("arg"), py::arg("api"));
  // The size check of reduce_scatter's and all_gather's tensors, for the backend's Python half.
  m.def("check_sizes", [](const std::string& api, const std::string& big_name, const at::Tensor& big,
                          const std::string& small_name, const at::Tensor& small, int world) {
    rr::binding::check_sizes(api.c_str(), big_name.c_str(), big, small_name.c_str(), small, world);
  }, py::arg("api"), py::arg("big_name"), py::arg("big"), py::arg("small_name"), py::arg("small"),
     py::arg("world"));
  m.attr("SHM_SLICE_BYTES") = rr::shm::kDefaultSliceBytes;
  m.attr("TRACE_BUFFER") = rr::runtime::Recorder::kDefaultCapacity;  // RINGREDUCE_TRACE_BUFFER's default
  m.attr("SHM_ALGOS") = rr::binding::algo_tuple(rr::shm::kForcedAlgos);      // RINGREDUCE_ALGO's names
  py::list step_algos(rr::binding::algo_tuple(rr::shm::kStepAlgos));  // an auto step's names
  step_algos.append(rr::shm::kCmaWholeStep);
  m.attr("SHM_STEP_ALGOS") = py::tuple(step_algos);
  register_backend(m);
  // The call vocabulary's codes (ring/types.h), so that Python never spells them itself.
  py::dict ops, wires;
  for (int k = 0; k < static_cast<int>(rr::RedOp::kCount); ++k) ops[rr::op_name(rr::RedOp(k))] = k;
  for (int k = 1; k < static_cast<int>(rr::Wire::kCount); ++k) wires[rr::wire_name(rr::Wire(k))] = k;
  m.attr("OP_CODES") = ops;      // {"SUM": 0, "AVG": 1, "MIN": 2, "MAX": 3, "PRODUCT": 4}
  m.attr("WIRE_CODES") = wires;  // {"bfloat16": 1, "float16": 2, "float8_e4m3fn": 3, "float8_e5m2": 4}
  m.attr("WIRE_BLOCK") = rr::kWireBlock;  // elements per fp8 scale
  py::list wire_ops;
  for (int k = 0; k < static_cast<int>(rr::RedOp::kCount); ++k)
    if (rr::wire_takes(rr::RedOp(k))) wire_ops.append(rr::op_name(rr::RedOp(k)));
  m.attr("WIRE_OPS") = py::tuple(wire_ops);  // ("SUM", "AVG")
  m.attr("CLOSED_MESSAGE") = rr::kClosedMessage;  // ring/call.h: the one "closed" error's text
  // The dtypes the core reduces, by name in code order, and those a wire takes (torch's names).
  py::list dtypes, wire_dtypes;
  for (int k = 0; k < static_cast<int>(rr::DType::kCount); ++k) dtypes.append(rr::dtype_name(rr::DType(k)));
  for (const std::string& name : rr::wire_dtype_names()) wire_dtypes.append(name);
  m.attr("DTYPES") = py::tuple(dtypes);  // ("float32", "float64", ..., "int64")
  m.attr("WIRE_TENSOR_DTYPES") = py::tuple(wire_dtypes);  // ("float32", "float16", "bfloat16")
  // The CUDA transports' defaults (cuda/p2p/layout.h, cuda/nccl/defaults.h; CUDA-free, so in
  // every build): the policy's knobs (ringreduce/_cuda/policy.py) start from these.
  namespace rc = rr::cuda;
  py::dict d;
  d["channels"] = rc::p2p::kDefaultChannels;
  d["slice_bytes"] = rc::p2p::kDefaultSliceBytes;
  d["chunk_bytes"] = rc::p2p::kDefaultChunkBytes;
  d["copy_bytes"] = rc::p2p::kDefaultCopySlotBytes;
  d["sym_blocks"] = rc::p2p::kDefaultSymBlocks;
  d["max_sym_blocks"] = rc::p2p::kMaxSymBlocks;
  d["max_peers"] = rc::p2p::kMaxPeers;
  d["staging_bytes"] = rc::nccl::kDefaultStagingBytes;
  m.attr("CUDA_DEFAULTS") = d;
  m.attr("P2P_ALGOS") = rr::binding::algo_tuple(rc::p2p::kForcedAlgos);  // RINGREDUCE_CUDA_ALGO's names
#ifdef RINGREDUCE_WITH_CUDA
  m.attr("cuda_compiled") = true;
  register_cuda(m);
#else
  m.attr("cuda_compiled") = false;
#endif
}
