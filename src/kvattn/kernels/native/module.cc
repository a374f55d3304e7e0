// The Python module `kvattn.kernels.native.compiled`: `handlers()`, each compiled kernel's XLA FFI handler
// as a PyCapsule by name (every kernel file joins through `KVATTN_KERNEL`, so nothing here names one), and
// `cpu_features()`, which of the instructions kernels use this CPU has. Python's table of kernels says which
// features each needs and registers it only where the CPU has them all.

#include <Python.h>

#include "kvattn/kernels/native/native.h"

namespace {

PyObject* Handlers(PyObject*, PyObject*) {
  PyObject* handlers = PyDict_New();
  if (handlers == nullptr) return nullptr;
  for (const kvattn::Kernel& kernel : kvattn::Kernels()) {
    PyObject* capsule = PyCapsule_New(reinterpret_cast<void*>(kernel.handler), nullptr, nullptr);
    if (capsule == nullptr || PyDict_SetItemString(handlers, kernel.name, capsule) < 0) {
      Py_XDECREF(capsule);
      Py_DECREF(handlers);
      return nullptr;
    }
    Py_DECREF(capsule);
  }
  return handlers;
}

PyObject* CpuFeatures(PyObject*, PyObject*) {
#ifdef KVATTN_X86
  __builtin_cpu_init();
  return Py_BuildValue("{s:O,s:O,s:O,s:O,s:O}", "avx2", __builtin_cpu_supports("avx2") ? Py_True : Py_False,
                       "fma", __builtin_cpu_supports("fma") ? Py_True : Py_False,
                       "avx512f", __builtin_cpu_supports("avx512f") ? Py_True : Py_False,
                       "avx512bw", __builtin_cpu_supports("avx512bw") ? Py_True : Py_False, "avx512vnni",
                       __builtin_cpu_supports("avx512vnni") ? Py_True : Py_False);
#else
  return PyDict_New();  // no x86 instructions, and no kernel compiled that would use them
#endif
}

PyMethodDef kMethods[] = {
    {"handlers", Handlers, METH_NOARGS, "Each compiled kernel's XLA FFI handler, as a PyCapsule, by name."},
    {"cpu_features", CpuFeatures, METH_NOARGS, "Which instructions the kernels use this CPU has, by name."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "compiled", "kvattn's native kernels for XLA:CPU.", -1, kMethods};

}  // namespace

PyMODINIT_FUNC PyInit_compiled() { return PyModule_Create(&kModule); }
