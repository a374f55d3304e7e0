// kvattn's streaming read for XLA:CPU: the maximum of each row of a float32 matrix, every byte read once.
//
// out[r] = max_c x[r, c], NaN where the row holds one (as `jnp.max`), for C >= 1. It does nothing but read:
// four independent 512-bit maxima per row keep several loads in flight, the row's tail is a masked load
// (nothing past the row is touched), and the rows are split over XLA's intra-op thread pool. The
// benchmarks time it over a buffer larger than the last-level cache as the machine's bandwidth limit, on
// the threads the contenders get (`benchmarks.baselines.Calibration`): the bytes a step must read over
// this rate is a floor no implementation of the step can beat, where a library's own mat-vec is only
// that library's speed.

#include <algorithm>
#include <cstdint>
#include <limits>

#include "kvattn/kernels/native/native.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using kvattn::Failed;

namespace {

#ifdef KVATTN_X86

constexpr int64_t kLanes = 16;

KVATTN_AVX512 float RowMax(const float* row, int64_t C) {
  const __m512 low = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 top[4] = {low, low, low, low};
  __mmask16 unordered = 0;
  int64_t c = 0;
  for (; c + 4 * kLanes <= C; c += 4 * kLanes) {
    for (int i = 0; i < 4; ++i) kvattn::Fold(_mm512_loadu_ps(row + c + i * kLanes), 0xFFFF, top[i], unordered);
  }
  for (; c < C; c += kLanes) {
    const __mmask16 lanes = C - c >= kLanes ? 0xFFFF : static_cast<__mmask16>((1u << (C - c)) - 1);
    kvattn::Fold(_mm512_maskz_loadu_ps(lanes, row + c), lanes, top[0], unordered);
  }
  return kvattn::Maximum(_mm512_max_ps(_mm512_max_ps(top[0], top[1]), _mm512_max_ps(top[2], top[3])), unordered);
}

// Without AVX-512 (`kvattn::Avx512`): four 256-bit maxima, NaN tracked by an unordered compare, the row's
// tail read one float at a time.
KVATTN_AVX2 float RowMax2(const float* row, int64_t C) {
  const __m256 low = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 top[4] = {low, low, low, low};
  __m256 unordered = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 32 <= C; c += 32) {
    for (int i = 0; i < 4; ++i) {
      const __m256 x = _mm256_loadu_ps(row + c + 8 * i);
      top[i] = _mm256_max_ps(top[i], x);
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    }
  }
  const __m256 both = _mm256_max_ps(_mm256_max_ps(top[0], top[1]), _mm256_max_ps(top[2], top[3]));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, both);
  bool nan = _mm256_movemask_ps(unordered) != 0;
  float result = lanes[0];
  for (int i = 1; i < 8; ++i) result = std::max(result, lanes[i]);
  for (; c < C; ++c) {
    nan |= row[c] != row[c];
    result = std::max(result, row[c]);
  }
  return nan ? __builtin_nanf("") : result;
}

ffi::Future Read(ffi::ThreadPool pool, ffi::Buffer<ffi::F32, 2> x, ffi::Result<ffi::Buffer<ffi::F32, 1>> out) {
  const auto xd = x.dimensions();
  const int64_t R = xd[0], C = xd[1];
  if (C < 1 || out->dimensions()[0] != R) return Failed("kvattn read_max: x (R, C) with C >= 1, out (R,)");
  const float* xp = x.typed_data();
  float* op = out->typed_data();
  const bool wide = kvattn::Avx512();
  return kvattn::Split(pool, R, R, [=](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) op[r] = wide ? RowMax(xp + r * C, C) : RowMax2(xp + r * C, C);
  });
}

KVATTN_KERNEL(read_max, Read);

#endif  // KVATTN_X86

}  // namespace
