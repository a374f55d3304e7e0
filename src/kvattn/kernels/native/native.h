// What kvattn's native kernels share: the registry each kernel joins (`KVATTN_KERNEL`), a handler's refusal,
// the split over XLA's thread pool, exp, and a maximum that keeps NaN.
//
// A kernel is one .cc file: its code inside `#ifdef KVATTN_X86` (the instructions it uses named in its
// functions' target attributes), ending with `KVATTN_KERNEL(name, Handler);`. The handler's FFI binding is
// read from its signature; the module (`module.cc`) hands every registered kernel to Python, which checks
// the CPU features the kernel's entry in `kvattn.kernels.native`'s table names before registering it with
// XLA. Off x86-64 no kernel is compiled, so none is registered and Python reports each as unsupported.

#ifndef KVATTN_NATIVE_NATIVE_H_
#define KVATTN_NATIVE_NATIVE_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KVATTN_X86 1
#include <immintrin.h>
#define KVATTN_AVX512 __attribute__((target("avx512f")))
#define KVATTN_AVX2 __attribute__((target("avx2,fma")))
#include <cstdlib>
#endif

namespace kvattn {

// A compiled kernel: the name its table entry and FFI target take (without the "kvattn_" prefix), and its
// XLA FFI handler.
struct Kernel {
  const char* name;
  XLA_FFI_Handler* handler;
};

// Every kernel compiled into the module, in the order their files were linked.
inline std::vector<Kernel>& Kernels() {
  static std::vector<Kernel> kernels;
  return kernels;
}

// Adds a kernel to `Kernels()` when the module is loaded (a namespace-scope object of each kernel's file).
struct Registration {
  Registration(const char* name, XLA_FFI_Handler* handler) { Kernels().push_back({name, handler}); }
};

// A handler's result that fails with `message` (an invalid argument), as an already completed future.
inline xla::ffi::Future Failed(const char* message) {
  xla::ffi::Promise failed;
  failed.SetError(xla::ffi::Error::InvalidArgument(message));
  return xla::ffi::Future(failed);
}

// Runs work(first, last) over items [0, items), split into at most min(the pool's threads, most_parts) parts
// on XLA's intra-op thread pool; the returned future completes when the last part has.
template <typename Work>
xla::ffi::Future Split(xla::ffi::ThreadPool& pool, int64_t items, int64_t most_parts, Work work) {
  const int64_t parts = std::clamp<int64_t>(pool.num_threads(), 1, std::max<int64_t>(1, most_parts));
  xla::ffi::CountDownPromise done(parts);
  xla::ffi::Future future(done);
  for (int64_t p = 0; p < parts; ++p) {
    const int64_t first = items * p / parts, last = items * (p + 1) / parts;
    pool.Schedule([=]() mutable {
      work(first, last);
      done.CountDown(1);
    });
  }
  return future;
}

}  // namespace kvattn

// A handler's thread pool, bound from its signature as the other parameters are (`KVATTN_KERNEL`).
template <>
struct xla::ffi::CtxBinding<xla::ffi::ThreadPool> {
  using Ctx = xla::ffi::ThreadPool;
};

// Registers `handler` (an `ffi::Future handler(ffi::ThreadPool, arguments..., results...)`) as kernel `name`.
#define KVATTN_KERNEL(name, handler)                        \
  XLA_FFI_DEFINE_HANDLER_AUTO(kvattn_##name##_ffi, handler); \
  const ::kvattn::Registration kvattn_##name##_registration(#name, kvattn_##name##_ffi)

namespace kvattn {

#ifdef KVATTN_X86

// Whether a kernel with two bodies runs its AVX-512 one, else its AVX2 one: the CPU has AVX512F, and
// KVATTN_NATIVE_AVX2 is unset (the harness sets it to hold the AVX2 bodies to their twins on such a CPU).
inline bool Avx512() {
  static const bool has = (__builtin_cpu_init(), __builtin_cpu_supports("avx512f"));
  return has && std::getenv("KVATTN_NATIVE_AVX2") == nullptr;
}

// exp(x) for x <= 0, sixteen at a time: Cephes' expf polynomial (relative error below 2e-7) scaled by
// 2^n. Below -104 it returns 0, as float32's exp rounds there; -inf gives 0 and NaN gives NaN (maxps
// returns its second operand when either is NaN, so x goes second).
KVATTN_AVX512 inline __m512 Exp(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// The largest of the lanes of `x` in `lanes` folded into `top`, and in `unordered` those holding NaN:
// maxps alone drops a NaN, where a softmax must keep it (a NaN score makes the whole row NaN).
KVATTN_AVX512 inline void Fold(__m512 x, __mmask16 lanes, __m512& top, __mmask16& unordered) {
  top = _mm512_mask_max_ps(top, lanes, top, x);
  unordered |= _mm512_mask_cmp_ps_mask(lanes, x, x, _CMP_UNORD_Q);
}

// The maximum `Fold` gathered: NaN when any lane held one.
KVATTN_AVX512 inline float Maximum(__m512 top, __mmask16 unordered) {
  return unordered ? __builtin_nanf("") : _mm512_reduce_max_ps(top);
}

#endif  // KVATTN_X86

}  // namespace kvattn

#endif  // KVATTN_NATIVE_NATIVE_H_
