// What kvattn's native kernels share: the CPU check and a handler's refusal.

#ifndef KVATTN_NATIVE_NATIVE_H_
#define KVATTN_NATIVE_NATIVE_H_

#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KVATTN_X86 1
#endif

namespace kvattn {

// Whether this CPU has what every kernel needs: AVX512F, AVX512BW and AVX512-VNNI.
inline bool Supported() {
#ifdef KVATTN_X86
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

// A handler's result that fails with `message` (an invalid argument), as an already completed future.
inline xla::ffi::Future Failed(const char* message) {
  xla::ffi::Promise failed;
  failed.SetError(xla::ffi::Error::InvalidArgument(message));
  return xla::ffi::Future(failed);
}

}  // namespace kvattn

#endif  // KVATTN_NATIVE_NATIVE_H_
