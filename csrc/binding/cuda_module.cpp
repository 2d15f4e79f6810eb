// The CUDA half of the module ringreduce._C: the communicator (cuda_comm.h) as a Python type, made
// over either device transport (P2pComm, NcclComm), its fast path, and the transport choice's device
// queries.
#include <Python.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/utils/pybind.h>

#include "binding/cuda_comm.h"
#include "binding/cuda_imports.h"
#include "binding/torch_types.h"
#include "cuda/hier/endpoint.h"
#include "cuda/nccl/endpoint.h"
#include "cuda/p2p/endpoint.h"

namespace ringreduce::binding {
namespace {

namespace rc = ringreduce::cuda;

// The p2p endpoint behind c, for what only that transport has (IPC handles, shared buffers, the
// copy algorithm, its tuning): the transport that serves this host's ranks (Transport::local; the
// two-level transport answers with its host's ring). The binding's one downcast.
rc::p2p::Endpoint& p2p_of(CudaComm& c) {
  auto* e = dynamic_cast<rc::p2p::Endpoint*>(&c.transport().local());
  TORCH_CHECK(e != nullptr, "ringreduce: this communicator runs ", c.transport().name(),
              "; only the p2p transport has this");
  return *e;
}

}  // namespace
}  // namespace ringreduce::binding

using namespace ringreduce::binding;
namespace rr = ringreduce;

void register_cuda(py::module_& m) {
  namespace rc = ringreduce::cuda;
  py::class_<CudaWork>(m, "CudaWork")
      .def("is_completed", &CudaWork::is_completed)
      .def("synchronize", &CudaWork::synchronize);

  py::class_<CudaComm> comm(m, "CudaComm");
  comm.def("all_reduce", &CudaComm::all_reduce, py::arg("tensor"), py::arg("op"), py::arg("async_op"),
           py::arg("wire") = 0)
      .def("reduce_scatter", &CudaComm::reduce_scatter, py::arg("output"), py::arg("input"),
           py::arg("op"), py::arg("async_op"), py::arg("wire") = 0)
      .def("all_gather", &CudaComm::all_gather, py::arg("output"), py::arg("input"), py::arg("async_op"))
      .def("transport", [](CudaComm& c) { return std::string(c.transport().name()); })
      .def("failure", &CudaComm::failure)
      .def("abort", &CudaComm::abort, py::arg("why"))
      .def("synchronize", &CudaComm::synchronize)
      .def("close", &CudaComm::close, py::arg("peers_done"))
      .def("unmap_peers", &CudaComm::unmap_peers)
      .def("closed", &CudaComm::closed)
      .def("watch_peers", &CudaComm::watch_peers, py::arg("peers"))
      .def("failed_seq", &CudaComm::failed_seq)
      .def("stream_ptr", &CudaComm::stream_ptr)
      .def("marker", &CudaComm::marker)
      .def("attach_recorder", &CudaComm::attach_recorder, py::arg("recorder"))
      .def("op_seq", &CudaComm::op_seq)
      .def("held_calls", &CudaComm::held_calls)
      .def("release_finished", &CudaComm::release_finished)
      .def("device", &CudaComm::device)
      .def("fast_all_reduce", [](py::object self, const std::vector<py::object>& ops) {
        CudaComm* c = self.cast<CudaComm*>();
        return make_fast_path(std::move(self), c, ops, {});
      }, py::arg("ops"), "A function fast(tensor, op[, async_op[, wire_dtype]]) -> bool: a "
         "synchronous all_reduce without a wire on the caller's stream, or False (the full path); "
         "ops[code] is the ReduceOp object of each op code")
      // The p2p transport's own (p2p_of raises on another transport).
      .def("handle", [](CudaComm& c) { return py::bytes(p2p_of(c).handle()); })
      .def("connect", [](CudaComm& c, const std::vector<py::bytes>& handles) {
        c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(c.device()));
        std::vector<std::string> h;
        for (const py::bytes& b : handles) h.push_back(std::string(b));
        p2p_of(c).connect(h);
      }, py::arg("handles"))
      .def("direct", [](CudaComm& c) { return p2p_of(c).direct(); })
      .def("wire_overflowed", [](CudaComm& c, uint64_t seq) { return p2p_of(c).wire_overflowed(seq); },
           py::arg("op_seq"))
      // Device memory the communicator holds (p2p::Endpoint::area_bytes), for the log.
      .def("device_bytes", [](CudaComm& c) { return p2p_of(c).area_bytes(); })
      // The copy algorithm (ranks sharing a GPU without MPS): whether this endpoint has it, and its
      // counters' shared memory (rank 0 creates the segment, the others map it).
      .def("copies", [](CudaComm& c) { return p2p_of(c).copies(); })
      .def("copy_attach", [](CudaComm& c, const std::string& name, bool create) {
        c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(c.device()));
        p2p_of(c).copy_attach(name, create);
      }, py::arg("name"), py::arg("create"))
      // Imported memory (p2p::Endpoint::board_attach): ordinary tensors of torch's caching
      // allocator, each kept allocated (a reference to its storage) while a peer may map it.
      .def("board_attach", [](CudaComm& c, const std::string& name, bool create) {
        rc::p2p::Endpoint& ep = p2p_of(c);
        ep.set_holder(&hold_storage);
        ep.board_attach(name, create);
      }, py::arg("name"), py::arg("create"))
      .def("holds", [](CudaComm& c) { return p2p_of(c).holds(); })
      .def("imported", [](CudaComm& c) {  // (calls seen, of them in place, peers' allocations mapped)
        rc::p2p::Endpoint& ep = p2p_of(c);
        return py::make_tuple(ep.imported_seen(), ep.imported_in_place(), ep.imports());
      })
      // Shared buffers (ringreduce.shared_empty on CUDA; p2p::Endpoint::reg_alloc).
      .def("reg_alloc", [](CudaComm& c, size_t nbytes) {
        c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(c.device()));
        std::string h;
        const int id = p2p_of(c).reg_alloc(nbytes, &h);
        return py::make_tuple(id, py::bytes(h));
      }, py::arg("nbytes"))
      .def("reg_connect", [](CudaComm& c, int id, const std::vector<py::bytes>& handles) {
        c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(c.device()));
        std::vector<std::string> h;
        for (const py::bytes& b : handles) h.push_back(std::string(b));
        p2p_of(c).reg_connect(id, h);
      }, py::arg("id"), py::arg("handles"))
      .def("reg_tensor", [](CudaComm& c, int id, int64_t numel, const at::Tensor& like) {
        // The tensor holds the buffer (a shared_ptr in its deleter). When it goes, this rank
        // releases the buffer (p2p::Endpoint::reg_release: the peers' copies unmapped, this one
        // freed with the tensor); after the communicator closed, only its memory remains to free.
        // At the interpreter's exit the deleter makes no CUDA call (see cuda_comm.h).
        rc::p2p::Endpoint* ep = &p2p_of(c);
        auto* mem = new std::shared_ptr<char>(ep->reg_memory(id));
        std::weak_ptr<Shared> weak = c.shared();
        auto opts = at::TensorOptions().dtype(like.scalar_type()).device(at::kCUDA, c.device());
        return at::from_blob(mem->get(), {numel}, [mem, weak, ep, id](void*) {
          if (finalizing()) return;
          if (auto s = weak.lock())
            if (s->t.get() == ep) ep->reg_release(id);  // a no-op once the endpoint closed
          delete mem;
        }, opts);
      }, py::arg("id"), py::arg("numel"), py::arg("like"))
      .def("set_threshold", [](CudaComm& c, size_t oneshot_max) { p2p_of(c).set_threshold(oneshot_max); },
           py::arg("oneshot_max"))
      .def("set_sym_blocks", [](CudaComm& c, int blocks) { p2p_of(c).set_sym_blocks(blocks); },
           py::arg("blocks"))
      .def("algorithm", [](CudaComm& c, const std::string& coll, int64_t numel, int dtype_bytes) {
        // The plan of a float-like call of this size (for logs and tests of the choice).
        const rr::Coll k = coll == "all_reduce" ? rr::Coll::AllReduce
                           : coll == "reduce_scatter" ? rr::Coll::ReduceScatter : rr::Coll::AllGather;
        const rr::DType t = dtype_bytes == 2 ? rr::DType::F16 : dtype_bytes == 8 ? rr::DType::F64
                                                                                 : rr::DType::F32;
        return std::string(rr::algo_name(p2p_of(c).plan_of({k, t, rr::RedOp::Sum, numel, nullptr, nullptr}).algo));
      }, py::arg("coll"), py::arg("numel"), py::arg("dtype_bytes") = 4);

  // The communicator over each transport (the names Python constructs them by).
  m.def("P2pComm", [](int device, int rank, int nranks, int channels, size_t slice_bytes,
                      double timeout_s, const std::string& algo, size_t chunk_bytes,
                      int max_blocks, bool direct, size_t copy_slot_bytes, int sym_blocks) {
           c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
           rc::p2p::Options o;
           o.rank = rank;
           o.nranks = nranks;
           o.channels = channels;
           o.slice_bytes = slice_bytes;
           o.timeout_s = timeout_s;
           o.chunk_bytes = chunk_bytes;
           o.max_blocks = max_blocks;
           o.direct = direct;
           o.copy_slot_bytes = copy_slot_bytes;
           o.sym_blocks = sym_blocks;
           o.algo = rr::binding::parse_algo(algo, rc::p2p::kForcedAlgos, "RINGREDUCE_CUDA_ALGO");
           return std::make_unique<CudaComm>(std::make_unique<rc::p2p::Endpoint>(o));
         },
         py::arg("device"), py::arg("rank"), py::arg("nranks"), py::arg("channels"),
         py::arg("slice_bytes"), py::arg("timeout_s"), py::arg("algo") = "auto",
         py::arg("chunk_bytes") = rc::p2p::kDefaultChunkBytes, py::arg("max_blocks") = 0,
         py::arg("direct") = true,
         py::arg("copy_slot_bytes") = rc::p2p::kDefaultCopySlotBytes,
         py::arg("sym_blocks") = rc::p2p::kDefaultSymBlocks);
  m.def("NcclComm", [](int device, int rank, int nranks, double timeout_s, size_t staging_bytes,
                       const std::string& lib, const std::string& id) {
          c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
          rc::nccl::Options o;
          o.rank = rank;
          o.nranks = nranks;
          o.timeout_s = timeout_s;
          o.staging_bytes = staging_bytes;
          o.lib = lib;
          std::unique_ptr<rc::nccl::Endpoint> ep;
          {
            py::gil_scoped_release nogil;  // waits for the other ranks (bounded by timeout_s)
            ep = std::make_unique<rc::nccl::Endpoint>(o, id);
          }
          return std::make_unique<CudaComm>(std::move(ep));
        },
        py::arg("device"), py::arg("rank"), py::arg("nranks"), py::arg("timeout_s"),
        py::arg("staging_bytes"), py::arg("lib"), py::arg("id"));

  // The two-level transport (ranks on several hosts): this host's ring (p2p, connected afterwards
  // by connect(), as P2pComm's) and the ring of this local rank over the hosts (nccl, collective
  // over them: every one constructs with the same id).
  m.def("HierComm", [](int device, int rank, const std::vector<std::vector<int>>& hosts, size_t piece_bytes,
                       double timeout_s, double intra_timeout_s, size_t chunk_bytes, int max_blocks,
                       int sym_blocks, size_t staging_bytes, const std::string& lib, const std::string& id) {
          c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
          rc::hier::Options ho;
          ho.rank = rank;
          ho.hosts = hosts;
          ho.piece_bytes = piece_bytes;
          const rc::hier::Layout where(ho);  // checks the layout before anything is made
          rc::p2p::Options po;
          po.rank = where.local;
          po.nranks = where.nlocal;
          po.timeout_s = intra_timeout_s;
          po.chunk_bytes = chunk_bytes;
          po.max_blocks = max_blocks;
          po.sym_blocks = sym_blocks;
          auto intra = std::make_unique<rc::p2p::Endpoint>(po);
          rc::nccl::Options no;
          no.rank = where.host;
          no.nranks = where.nhosts;
          no.timeout_s = timeout_s;
          no.staging_bytes = staging_bytes;
          no.lib = lib;
          std::unique_ptr<rc::nccl::Endpoint> cross;
          {
            py::gil_scoped_release nogil;  // waits for the other hosts (bounded by timeout_s)
            cross = std::make_unique<rc::nccl::Endpoint>(no, id);
          }
          return std::make_unique<CudaComm>(
              std::make_unique<rc::hier::Endpoint>(ho, std::move(intra), std::move(cross)));
        },
        py::arg("device"), py::arg("rank"), py::arg("hosts"), py::arg("piece_bytes"), py::arg("timeout_s"),
        py::arg("intra_timeout_s"), py::arg("chunk_bytes"), py::arg("max_blocks"), py::arg("sym_blocks"),
        py::arg("staging_bytes"), py::arg("lib"), py::arg("id"));
  m.attr("HIER_PIECE_BYTES") = rc::hier::kDefaultPieceBytes;

  m.def("nccl_unique_id", [](const std::string& lib) { return py::bytes(rc::nccl::unique_id(lib)); },
        py::arg("lib"));
  m.def("nccl_version", &rc::nccl::version, py::arg("lib"));
  m.def("cuda_bus_id", [](int device) {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    return rc::p2p::device_bus_id();
  }, py::arg("device"));
  m.def("cuda_can_map", [](int device, const std::string& bus_id) {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    std::string why;
    const bool ok = rc::p2p::can_map(bus_id, &why);
    return py::make_tuple(ok, why);
  }, py::arg("device"), py::arg("bus_id"));
  m.def("cuda_free_streams", &free_stream_count, py::arg("device"));
  // Why imported memory is off on this process's allocator ("" where it can be on).
  m.def("cuda_allocator_why_not", &allocator_why_not);
  m.def("cuda_device_count", [] {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
  });
}
