// The collectives as registered torch operators (namespace ringreduce), so that torch.compile and
// torch.export trace them instead of breaking the graph. Schemas only: the CPU, CUDA and fake
// (meta) kernels are registered from Python (ringreduce/ops.py) and call the communicators. The
// group is its torch.distributed name (a str), as in torch's functional collectives.
//   *_ forms: write into a given tensor ((a!): mutated, returns nothing: torch.compile
//             functionalizes them); plain forms: return a new tensor.
#include <torch/library.h>

TORCH_LIBRARY(ringreduce, m) {
  // wire: a narrow wire's code (ringreduce/collectives.py _WIRE_CODES; 0: none)
  m.def("all_reduce_(Tensor(a!) tensor, int op, str group, int wire=0) -> ()");
  m.def("all_reduce(Tensor tensor, int op, str group) -> Tensor");
  m.def("reduce_scatter_tensor_(Tensor(a!) output, Tensor input, int op, str group, int wire=0) -> ()");
  m.def("reduce_scatter_tensor(Tensor input, int op, str group) -> Tensor");
  m.def("all_gather_into_tensor_(Tensor(a!) output, Tensor input, str group) -> ()");
  m.def("all_gather_into_tensor(Tensor input, str group) -> Tensor");
}
