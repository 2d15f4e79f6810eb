// torch dtype / ReduceOp code -> the core's DType / RedOp, shared by the CPU and CUDA bindings.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include "ring/types.h"

namespace ringreduce {

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

inline DType to_dtype(const at::Tensor& t, const char* arg) {
  DType dt;
  TORCH_CHECK_TYPE(try_dtype(t.scalar_type(), dt), "ringreduce: ", arg, " has dtype ", t.scalar_type(),
                   "; expected one of float32, float64, float16, bfloat16, int8, uint8, int32, int64");
  return dt;
}

inline RedOp to_op(int op) {
  TORCH_CHECK_VALUE(op >= 0 && op < static_cast<int>(RedOp::kCount), "ringreduce: op code ", op,
                    " is not SUM, AVG, MIN, MAX or PRODUCT");
  return static_cast<RedOp>(op);
}

// A wire code from Python, checked against the tensor and the op (the Python API says the same
// first, naming its own arguments).
inline Wire to_wire(int wire, const at::Tensor& t, int op, const char* arg) {
  TORCH_CHECK_VALUE(wire >= 0 && wire < static_cast<int>(Wire::kCount), "ringreduce: wire code ",
                    wire, " out of range");
  if (wire == 0) return Wire::None;
  const auto st = t.scalar_type();
  TORCH_CHECK_TYPE(st == at::kFloat || st == at::kHalf || st == at::kBFloat16, "ringreduce: ", arg,
                   " is ", st, "; wire_dtype takes float32, float16 and bfloat16 tensors");
  TORCH_CHECK_VALUE(op == static_cast<int>(RedOp::Sum) || op == static_cast<int>(RedOp::Avg),
                    "ringreduce: wire_dtype takes SUM and AVG, got ", op_name(RedOp(op)));
  return Wire(wire);
}


}  // namespace ringreduce
