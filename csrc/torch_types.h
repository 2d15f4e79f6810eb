// torch dtype / ReduceOp code -> the core's DType / RedOp, shared by the CPU and CUDA bindings.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include "cpu/reduce.h"

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

}  // namespace ringreduce
