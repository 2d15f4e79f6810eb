// The fast path of rr.all_reduce (fast_path.h): one function and one exception map for every
// communicator.
#include "binding/fast_path.h"

#include <torch/csrc/Exceptions.h>

#include <exception>
#include <new>
#include <stdexcept>
#include <utility>

#include "ring/call.h"

namespace ringreduce::binding {

PyObject*& ring_error_type();  // ringreduce.RingReduceError (binding/shm_comm.cpp), set at import
namespace {

struct Fast {
  py::object owner;
  FastTarget* target;
  std::vector<py::object> ops;    // ops[code]
  std::vector<py::object> wires;  // wires[code] (code 0: None)
};

constexpr const char* kCapsule = "ringreduce.FastPath";

// The code of obj among objs (identity), or -1.
int code_of(PyObject* obj, const std::vector<py::object>& objs, size_t first) {
  for (size_t i = first; i < objs.size(); ++i)
    if (obj == objs[i].ptr()) return static_cast<int>(i);
  return -1;
}

PyObject* fast_all_reduce(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  auto* f = static_cast<Fast*>(PyCapsule_GetPointer(self, kCapsule));
  if (f == nullptr) return nullptr;
  if (nargs < 2 || nargs > 4) {
    PyErr_Format(PyExc_TypeError, "fast all_reduce takes (tensor, op[, async_op[, wire_dtype]]), got "
                 "%zd arguments", nargs);
    return nullptr;
  }
  const int op = code_of(args[1], f->ops, 0);
  const int wire = nargs == 4 && args[3] != Py_None ? code_of(args[3], f->wires, 1) : 0;
  const bool async_op = nargs >= 3 && args[2] == Py_True;
  if (op < 0 || wire < 0 || (nargs >= 3 && !async_op && args[2] != Py_False)) Py_RETURN_FALSE;
  try {
    if (async_op) {
      if (wire) Py_RETURN_FALSE;  // an async wire call: the full path
      py::object w = f->target->fast_all_reduce_async(args[0], op);
      if (!w) Py_RETURN_FALSE;
      return w.release().ptr();
    }
    if (f->target->fast_all_reduce(args[0], op, wire)) Py_RETURN_TRUE;
    Py_RETURN_FALSE;
  } catch (...) {
    set_python_error();
  }
  return nullptr;
}

PyMethodDef fast_def = {
    "fast_all_reduce", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&fast_all_reduce)),
    METH_FASTCALL, "fast(tensor, op[, async_op[, wire_dtype]]) -> True, a Work, or False (not taken)"};

}  // namespace

void set_python_error() {
  try {
    throw;
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const RingError& e) {
    PyErr_SetString(ring_error_type(), e.what());
  } catch (const c10::Error&) {
    torch::translate_exception_to_python(std::current_exception());
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
  } catch (const std::domain_error& e) {  // pybind11's mapping of the standard exceptions
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const std::invalid_argument& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const std::length_error& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const std::out_of_range& e) {
    PyErr_SetString(PyExc_IndexError, e.what());
  } catch (const std::range_error& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const std::overflow_error& e) {  // a float16 wire's overflow
    PyErr_SetString(PyExc_OverflowError, e.what());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  } catch (...) {
    PyErr_SetString(PyExc_RuntimeError, "ringreduce: unknown C++ exception in all_reduce");
  }
}

py::object make_fast_path(py::object owner, FastTarget* target, const std::vector<py::object>& ops,
                          const std::vector<py::object>& wires) {
  auto* f = new Fast{std::move(owner), target, ops, wires};
  py::capsule cap(f, kCapsule, [](void* p) { delete static_cast<Fast*>(p); });
  PyObject* fn = PyCFunction_New(&fast_def, cap.ptr());
  if (fn == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(fn);
}

}  // namespace ringreduce::binding
