// torch dtype / ReduceOp code -> the core's DType / RedOp, shared by the CPU and CUDA bindings.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>
#include <torch/csrc/utils/pybind.h>

#include "ring/call.h"

namespace ringreduce::binding {

// False for a dtype the core does not reduce (the fast paths then leave the call to the full one).
inline bool try_dtype(at::ScalarType st, DType& dt) {
  switch (st) {
    case at::kFloat: dt = DType::F32; return true;
    case at::kDouble: dt = DType::F64; return true;
    case at::kHalf: dt = DType::F16; return true;
    case at::kBFloat16: dt = DType::BF16; return true;
    case at::kChar: dt = DType::I8; return true;
    case at::kByte: dt = DType::U8; return true;
    case at::kInt: dt = DType::I32; return true;
    case at::kLong: dt = DType::I64; return true;
    default: return false;
  }
}

// "a, b or c": the names of the values of E (ring/types.h) that keep(value) takes, for messages.
template <class E, class Keep>
std::string names_of(const char* (*name)(E), Keep keep) {
  std::vector<std::string> ns;
  for (int k = 0; k < static_cast<int>(E::kCount); ++k)
    if (keep(E(k))) ns.push_back(name(E(k)));
  std::string s;
  for (size_t k = 0; k < ns.size(); ++k) s += (k == 0 ? "" : k + 1 == ns.size() ? " or " : ", ") + ns[k];
  return s;
}
// Every dtype the core reduces, for messages.
inline std::string dtype_names() { return names_of(dtype_name, [](DType) { return true; }); }

// The API call a collective's checks name: rr.all_reduce, rr.reduce_scatter_tensor, ...
inline const char* api_name(Coll c) {
  switch (c) {
    case Coll::AllReduce: return "all_reduce";
    case Coll::ReduceScatter: return "reduce_scatter_tensor";
    case Coll::AllGather: return "all_gather_into_tensor";
  }
  return "collective";
}
// "ringreduce.<api>: " (api null: "ringreduce: "), the head of every check's message.
inline std::string who(const char* api) {
  return api ? std::string("ringreduce.") + api + ": " : std::string("ringreduce: ");
}
// torch's name of a dtype, as Python prints it: torch.complex64.
inline std::string torch_name(at::ScalarType st) {
  return "torch." + std::string(c10::getDtypeNames(st).first);
}

// reduce_scatter's and all_gather's tensors, checked once for every communicator and the backend:
// the same dtype (out's named first), and the world-sized one holds world times the other's elements.
inline void check_same_dtype(const char* api, const char* out_name, const at::Tensor& out,
                             const char* in_name, const at::Tensor& in) {
  TORCH_CHECK_TYPE(out.scalar_type() == in.scalar_type(), who(api), out_name, " dtype ",
                   torch_name(out.scalar_type()), " differs from ", in_name, " dtype ", torch_name(in.scalar_type()));
}
inline void check_sizes(const char* api, const char* big_name, const at::Tensor& big, const char* small_name,
                        const at::Tensor& small, int world) {
  TORCH_CHECK_VALUE(big.numel() == small.numel() * world, who(api), big_name, " has ", big.numel(),
                    " elements; expected ", small_name, ".numel() * world size = ", small.numel(), " * ",
                    world, " = ", small.numel() * world);
}

// The one dtype check of a collective's tensors (Python does not check dtypes; ring/types.h says
// which the core reduces). api: the API call, for the message.
inline DType to_dtype(const at::Tensor& t, const char* arg, const char* api = nullptr) {
  DType dt;
  TORCH_CHECK_TYPE(try_dtype(t.scalar_type(), dt), who(api), arg, " has dtype ", torch_name(t.scalar_type()),
                   "; expected one of ", dtype_names());
  return dt;
}

inline RedOp to_op(int op) {
  TORCH_CHECK_VALUE(op >= 0 && op < static_cast<int>(RedOp::kCount), "ringreduce: op code ", op,
                    " is not ", names_of(op_name, [](RedOp) { return true; }));
  return static_cast<RedOp>(op);
}

// A wire code from Python, checked against the tensor and the op (ring/types.h: wire_takes). The
// one place a wire's tensor and op are checked (a traced call's Python says it first: its fake
// kernel never gets here); what a transport's wire runs: runtime::wire_refusal.
inline Wire to_wire(int wire, const at::Tensor& t, int op, const char* arg, const char* api = nullptr) {
  TORCH_CHECK_VALUE(wire >= 0 && wire < static_cast<int>(Wire::kCount), who(api), "wire code ",
                    wire, " out of range");
  if (wire == 0) return Wire::None;
  DType dt;
  TORCH_CHECK_TYPE(try_dtype(t.scalar_type(), dt) && wire_takes(dt), who(api), arg, " is ",
                   torch_name(t.scalar_type()), "; wire_dtype takes ",
                   names_of(dtype_name, [](DType d) { return wire_takes(d); }), " tensors");
  TORCH_CHECK_VALUE(wire_takes(to_op(op)), who(api), "wire_dtype takes ",
                    names_of(op_name, [](RedOp o) { return wire_takes(o); }), ", got ",
                    op_name(RedOp(op)));
  return Wire(wire);
}

// The name of one of a transport's algos (shm/options.h, cuda/p2p/plan.h: the lists Python reads as
// _C.SHM_ALGOS, _C.P2P_ALGOS), or a ValueError naming what, the names and the value.
template <size_t N>
Algo parse_algo(const std::string& name, const Algo (&algos)[N], const char* what) {
  for (Algo a : algos)
    if (name == algo_name(a)) return a;
  TORCH_CHECK_VALUE(false, "ringreduce: ", what, " must be one of ", algo_names(algos), "; got '", name, "'");
}

// algos' names as a Python tuple (_C.SHM_ALGOS, _C.P2P_ALGOS).
template <size_t N>
py::tuple algo_tuple(const Algo (&algos)[N]) {
  py::list names;
  for (Algo a : algos) names.append(algo_name(a));
  return py::tuple(names);
}

// Whether to_wire would accept these, without raising (the fast paths leave the rest to the full
// path, which raises the API's error).
inline bool wire_fits(int wire, DType dt, int op) {
  if (wire == 0) return true;
  return wire > 0 && wire < static_cast<int>(Wire::kCount) && wire_takes(dt) && op >= 0 &&
         op < static_cast<int>(RedOp::kCount) && wire_takes(RedOp(op));
}

}  // namespace ringreduce::binding
