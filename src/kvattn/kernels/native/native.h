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

// Asks for a row of `count` floats to be brought into the cache, a line at a time. Kernels that read pages
// ask for the rows ahead of the ones they read: pages lie anywhere, so the CPU's own prefetcher cannot run
// past the end of one.
inline void Prefetch(const float* row, int64_t count) {
  for (int64_t i = 0; i < count; i += 16) _mm_prefetch(reinterpret_cast<const char*>(row + i), _MM_HINT_T0);
}

// ------------------------------------------------------------------ sixteen lanes on AVX2

// Sixteen float lanes as two 256-bit halves: what a kernel's AVX2 body works in where its AVX-512 body works
// in one __m512. Each operation below does what its AVX-512 counterpart does, lane for lane and in the same
// order (the reductions as GCC's `_mm512_reduce_*_ps` do), so the two bodies give the same bits.
struct F16 {
  __m256 lo, hi;
};

KVATTN_AVX2 inline F16 Load16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }

KVATTN_AVX2 inline void Store16(float* p, F16 x) {
  _mm256_storeu_ps(p, x.lo);
  _mm256_storeu_ps(p + 8, x.hi);
}

KVATTN_AVX2 inline F16 Splat16(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }

KVATTN_AVX2 inline F16 Add16(F16 a, F16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }

KVATTN_AVX2 inline F16 Sub16(F16 a, F16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }

KVATTN_AVX2 inline F16 Mul16(F16 a, F16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }

KVATTN_AVX2 inline F16 Fmadd16(F16 a, F16 b, F16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}

// All ones in the lanes below `count`, zero in the others (a __mmask16 of those lanes).
KVATTN_AVX2 inline F16 Lanes16(int64_t count) {
  const __m256i n = _mm256_set1_epi32(static_cast<int32_t>(std::clamp<int64_t>(count, 0, 16)));
  const __m256i low = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return {_mm256_castsi256_ps(_mm256_cmpgt_epi32(n, low)),
          _mm256_castsi256_ps(_mm256_cmpgt_epi32(n, _mm256_add_epi32(low, _mm256_set1_epi32(8))))};
}

// x in `lanes`, +0 elsewhere (`_mm512_maskz_mov_ps`).
KVATTN_AVX2 inline F16 Keep16(F16 lanes, F16 x) {
  return {_mm256_and_ps(lanes.lo, x.lo), _mm256_and_ps(lanes.hi, x.hi)};
}

// The sum of the sixteen lanes in `_mm512_reduce_add_ps`'s order: halves, quarters, pairs, then the last two.
KVATTN_AVX2 inline float Sum16(F16 x) {
  const __m256 t3 = _mm256_add_ps(x.hi, x.lo);
  const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(_mm_add_ss(t8, _mm_shuffle_ps(t8, t8, _MM_SHUFFLE(0, 1, 0, 1))));
}

// `Exp` on AVX2: the same polynomial; p * 2^n (scalef's one rounding) as two exact scalings by powers of two,
// 2^(n - n/2) and 2^(n/2), each a normal float for n >= -150 (x >= -104).
KVATTN_AVX2 inline __m256 Exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-104.0f), x);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i whole = _mm256_cvtps_epi32(n);  // NaN gives INT_MIN: the product stays p's NaN
  const __m256i half = _mm256_srai_epi32(whole, 1), rest = _mm256_sub_epi32(whole, half);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 first = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(rest, bias), 23));
  const __m256 second = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, first), second);
}

KVATTN_AVX2 inline F16 Exp16(F16 x) { return {Exp8(x.lo), Exp8(x.hi)}; }

// `Fold` on AVX2: the lanes of x in `lanes` folded into `top` (maxps, x second), NaN lanes into `unordered`.
KVATTN_AVX2 inline void Fold16(F16 x, F16 lanes, F16& top, __m256& unordered) {
  top.lo = _mm256_blendv_ps(top.lo, _mm256_max_ps(top.lo, x.lo), lanes.lo);
  top.hi = _mm256_blendv_ps(top.hi, _mm256_max_ps(top.hi, x.hi), lanes.hi);
  unordered = _mm256_or_ps(unordered, _mm256_and_ps(lanes.lo, _mm256_cmp_ps(x.lo, x.lo, _CMP_UNORD_Q)));
  unordered = _mm256_or_ps(unordered, _mm256_and_ps(lanes.hi, _mm256_cmp_ps(x.hi, x.hi, _CMP_UNORD_Q)));
}

// `Maximum` on AVX2: NaN when any lane held one, else the largest lane in `_mm512_reduce_max_ps`'s order.
KVATTN_AVX2 inline float Maximum16(F16 top, __m256 unordered) {
  if (_mm256_movemask_ps(unordered)) return __builtin_nanf("");
  const __m256 t3 = _mm256_max_ps(top.hi, top.lo);
  const __m128 t6 = _mm_max_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  const __m128 t8 = _mm_max_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(_mm_max_ps(t8, _mm_shuffle_ps(t8, t8, _MM_SHUFFLE(0, 1, 0, 1))));
}

#endif  // KVATTN_X86

}  // namespace kvattn

#endif  // KVATTN_NATIVE_NATIVE_H_
