// The fast path of rr.all_reduce, one for every communicator (CPU and CUDA): a plain CPython
// function (METH_FASTCALL) fast(tensor, op[, async_op[, wire_dtype]]) that returns True when a
// synchronous all_reduce ran (or was enqueued), the Work of an async one, or False when it did not
// take the call (the caller's full path then checks it and raises the API's errors). pybind11's
// dispatch costs ~0.3 us a call and hashing a ReduceOp ~0.4 us, as much as a CPU all_reduce of
// 4 KiB between two ranks; this costs a C call. op and wire_dtype must be among the objects given
// when the function was made (matched by identity); anything else returns False.
#pragma once
#include <Python.h>
#include <torch/csrc/utils/pybind.h>

#include <vector>

namespace ringreduce::binding {

// What the fast path calls: the communicator's own checks decide whether it takes the call.
struct FastTarget {
  virtual ~FastTarget() = default;
  // A synchronous all_reduce of obj (op and wire codes; wire 0: none): true when taken.
  virtual bool fast_all_reduce(PyObject* obj, int op, int wire) = 0;
  // An async one: its Work as a Python object, or a null object when not taken.
  virtual py::object fast_all_reduce_async(PyObject* /*obj*/, int /*op*/) { return py::object(); }
};

// The function; owner keeps target alive for as long as the function lives. ops[code] is the
// ReduceOp object of each op code; wires[code] each wire_dtype object (code 0: None; empty: the
// target takes no wire, and a call with one returns False).
py::object make_fast_path(py::object owner, FastTarget* target, const std::vector<py::object>& ops,
                          const std::vector<py::object>& wires);

// The Python exception of the C++ exception being handled, set as pybind11 with torch's
// translators would set it (RingReduceError, torch's c10 errors, the standard ones).
void set_python_error();

}  // namespace ringreduce::binding
