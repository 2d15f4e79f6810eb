// torch dtype / ReduceOp code -> the core's DType / RedOp, shared by the CPU and CUDA bindings.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include "cpu/reduce.h"
#include "cpu/wire.h"

namespace ringreduce {

inline DType to_dtype(const at::Tensor& t, const char* arg) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::F32;
    case at::kDouble: return DType::F64;
    case at::kHalf: return DType::F16;
    case at::kBFloat16: return DType::BF16;
    case at::kChar: return DType::I8;
    case at::kByte: return DType::U8;
    case at::kInt: return DType::I32;
    case at::kLong: return DType::I64;
    default:
      TORCH_CHECK_TYPE(false, "ringreduce: ", arg, " has dtype ", t.scalar_type(),
                       "; expected one of float32, float64, float16, bfloat16, int8, uint8, int32, int64");
  }
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
