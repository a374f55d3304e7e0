// What kvattn's native kernels share: the CPU checks, a handler's refusal, the split over XLA's thread pool,
// exp, and a maximum that keeps NaN.

#ifndef KVATTN_NATIVE_NATIVE_H_
#define KVATTN_NATIVE_NATIVE_H_

#include <algorithm>
#include <cstdint>

#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KVATTN_X86 1
#include <immintrin.h>
#define KVATTN_AVX512 __attribute__((target("avx512f")))
#endif

namespace kvattn {

// Whether this CPU has AVX512F, all that the float32 kernels (the float32 dot, both attentions) use.
inline bool HasAvx512() {
#ifdef KVATTN_X86
  return __builtin_cpu_supports("avx512f");
#else
  return false;
#endif
}

// Whether this CPU has AVX512F, AVX512BW and AVX512-VNNI, which the int8 dot is compiled for.
inline bool HasAvx512Vnni() {
#ifdef KVATTN_X86
  return HasAvx512() && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
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

#ifdef KVATTN_X86

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
