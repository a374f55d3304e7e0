// The Python module `kvattn.kernels.native.compiled`: each kernel's XLA FFI handler as a PyCapsule, and
// `supported()`, which of them this CPU can run: each needs only the instructions it uses (the int8 dot
// AVX512F, AVX512BW and AVX512-VNNI; the others AVX512F).

#include <Python.h>

#include "kvattn/kernels/native/native.h"
#include "xla/ffi/api/c_api.h"

extern "C" XLA_FFI_Error* KvattnInt8Dot(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* KvattnF32Dot(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* KvattnDecodeAttention(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* KvattnPrefillAttention(XLA_FFI_CallFrame* call_frame);

namespace {

PyObject* Int8Dot(PyObject*, PyObject*) {
  return PyCapsule_New(reinterpret_cast<void*>(&KvattnInt8Dot), nullptr, nullptr);
}

PyObject* F32Dot(PyObject*, PyObject*) {
  return PyCapsule_New(reinterpret_cast<void*>(&KvattnF32Dot), nullptr, nullptr);
}

PyObject* DecodeAttention(PyObject*, PyObject*) {
  return PyCapsule_New(reinterpret_cast<void*>(&KvattnDecodeAttention), nullptr, nullptr);
}

PyObject* PrefillAttention(PyObject*, PyObject*) {
  return PyCapsule_New(reinterpret_cast<void*>(&KvattnPrefillAttention), nullptr, nullptr);
}

PyObject* Supported(PyObject*, PyObject*) {
  const bool avx512 = kvattn::HasAvx512(), vnni = kvattn::HasAvx512Vnni();
  return Py_BuildValue("{s:O,s:O,s:O,s:O}", "int8_dot", vnni ? Py_True : Py_False, "f32_dot",
                       avx512 ? Py_True : Py_False, "decode_attention", avx512 ? Py_True : Py_False,
                       "prefill_attention", avx512 ? Py_True : Py_False);
}

PyMethodDef kMethods[] = {
    {"int8_dot", Int8Dot, METH_NOARGS, "The XLA FFI handler of the int8 dot, as a PyCapsule."},
    {"f32_dot", F32Dot, METH_NOARGS, "The XLA FFI handler of the float32 dot, as a PyCapsule."},
    {"decode_attention", DecodeAttention, METH_NOARGS, "The XLA FFI handler of decode attention, as a PyCapsule."},
    {"prefill_attention", PrefillAttention, METH_NOARGS,
     "The XLA FFI handler of prefill (chunk) attention, as a PyCapsule."},
    {"supported", Supported, METH_NOARGS, "Each kernel's name and whether this CPU has what it uses."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "compiled", "kvattn's native kernels for XLA:CPU.", -1, kMethods};

}  // namespace

PyMODINIT_FUNC PyInit_compiled() { return PyModule_Create(&kModule); }
