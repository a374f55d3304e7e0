// kvattn's int8 dot for XLA:CPU: out[m, n] = sum_k a[m, k] * w[n, k], int8 by int8 into int32, exactly.
//
// XLA:CPU's own int8 dot (YNNPACK's, jaxlib 0.10) widens both operands to
// int16 (vpmaddwd) and repacks the weights on every call. This one reads
// weights laid out once in AVX512-VNNI's order and multiplies them where
// they lie. Sums are exact in int32, so the result equals XLA's dot bit for
// bit, whichever body runs:
//
// - AVX512-VNNI: vpdpbusd (uint8 by int8, four products summed per 32-bit
//   lane) on the stored uint8 w + 128, the rows kept int8, each row's shift
//   taken back once: sum_k (w + 128) a = sum_k w a + 128 sum_k a.
// - AVX2 (every other x86 CPU kvattn's dots run on): half a tile (eight
//   outputs' four inputs) per 256-bit vector, w recovered in register
//   (xor 128), then llama.cpp's sign trick for vpmaddubsw's uint8 by int8:
//   |w| by a * sign(w), pairs summed in int16 (at most 2 * 128 * 127, no
//   saturation) and by vpmaddwd into the output's int32 lane. A row holding
//   -128 (whose sign cannot flip in int8; `kvattn.math.quant.quantize_rows`
//   never gives one) is summed one product at a time instead.
//
// Weights: uint8 `(N / 16, K / 4, 16, 4)`, tile t holding outputs 16t..16t+15,
// each 64-byte group their four consecutive k (`kvattn.math.quant.tile` lays them
// out). Rows: int8 `(..., K)`. Work is split over XLA's intra-op thread pool
// by output tiles; the handler returns a future completed by the last part.
//
// `int8_dense` is the whole int8 dense of `kvattn.kernels.dots` in one call:
// float32 rows quantized here as `kvattn.math.quant.quantize_rows` does it,
// the same dot, and each sum taken to float32 times its row's scale and its
// output's, bit for bit what XLA computes around `int8_dot` (where those
// steps were some twenty small programs of a decode step's layer).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>

#include "kvattn/kernels/native/native.h"
#include "xla/ffi/api/ffi.h"

#ifdef KVATTN_X86
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;
using kvattn::Failed;

namespace {

constexpr int64_t kTileOutputs = 16;  // int32 lanes of a 512-bit vector
constexpr int64_t kGroup = 4;         // int8 products summed per lane by vpdpbusd

using TiledWeights = ffi::Buffer<ffi::U8, 4>;  // w + 128, (N / 16, K / 4, 16, 4)

#ifdef KVATTN_X86

// Rows [0, MR) of `a` (row stride `lda`) by tiles [t, t + NT), read side by side; `shift[i]` is
// 128 * sum_k a[i, k], the part of the products that the weights' + 128 added.
template <int MR, int NT>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void Tiles(const int8_t* a, int64_t lda,
                                                                    const uint8_t* w, int64_t K,
                                                                    const int32_t* shift, int32_t* out,
                                                                    int64_t ldo, int64_t t) {
  const int64_t groups = K / kGroup;
  const int64_t tile_bytes = K * kTileOutputs;
  const uint8_t* tiles[NT];
  __m512i acc[MR][NT];
  for (int j = 0; j < NT; ++j) {
    tiles[j] = w + (t + j) * tile_bytes;
    for (int i = 0; i < MR; ++i) acc[i][j] = _mm512_setzero_si512();
  }
  for (int64_t g = 0; g < groups; ++g) {
    __m512i b[NT];
    for (int j = 0; j < NT; ++j) b[j] = _mm512_loadu_si512(tiles[j] + g * 64);
    for (int i = 0; i < MR; ++i) {
      int32_t four;
      std::memcpy(&four, a + i * lda + g * kGroup, sizeof(four));
      const __m512i x = _mm512_set1_epi32(four);
      for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], b[j], x);
    }
  }
  for (int i = 0; i < MR; ++i) {
    const __m512i taken = _mm512_set1_epi32(shift[i]);
    for (int j = 0; j < NT; ++j) {
      _mm512_storeu_si512(out + i * ldo + (t + j) * kTileOutputs, _mm512_sub_epi32(acc[i][j], taken));
    }
  }
}

template <int MR>
void Rows(const int8_t* a, int64_t lda, const uint8_t* w, int64_t K, const int32_t* shift, int32_t* out,
          int64_t ldo, int64_t t0, int64_t t1) {
  constexpr int kSideBySide = MR <= 2 ? 4 : 2;  // 32 registers: MR * NT accumulators, NT tiles, a row
  int64_t t = t0;
  for (; t + kSideBySide <= t1; t += kSideBySide) Tiles<MR, kSideBySide>(a, lda, w, K, shift, out, ldo, t);
  for (; t < t1; ++t) Tiles<MR, 1>(a, lda, w, K, shift, out, ldo, t);
}

// Every row by tiles [t0, t1), eight rows at a time.
void Part(const int8_t* a, int64_t M, int64_t K, const uint8_t* w, const int32_t* shift, int32_t* out,
          int64_t N, int64_t t0, int64_t t1) {
  for (int64_t m = 0; m < M; m += 8) {
    const int8_t* rows = a + m * K;
    const int32_t* taken = shift + m;
    int32_t* outs = out + m * N;
    switch (std::min<int64_t>(8, M - m)) {
      case 1: Rows<1>(rows, K, w, K, taken, outs, N, t0, t1); break;
      case 2: Rows<2>(rows, K, w, K, taken, outs, N, t0, t1); break;
      case 3: Rows<3>(rows, K, w, K, taken, outs, N, t0, t1); break;
      case 4: Rows<4>(rows, K, w, K, taken, outs, N, t0, t1); break;
      case 5: Rows<5>(rows, K, w, K, taken, outs, N, t0, t1); break;
      case 6: Rows<6>(rows, K, w, K, taken, outs, N, t0, t1); break;
      case 7: Rows<7>(rows, K, w, K, taken, outs, N, t0, t1); break;
      default: Rows<8>(rows, K, w, K, taken, outs, N, t0, t1); break;
    }
  }
}

// Whether the VNNI body runs: the CPU has AVX512-VNNI (and AVX512BW) and KVATTN_NATIVE_AVX2 is unset.
inline bool Vnni() {
  static const bool has = (__builtin_cpu_init(), __builtin_cpu_supports("avx512vnni") &&
                                                     __builtin_cpu_supports("avx512bw"));
  return has && kvattn::Avx512();
}

// The AVX2 body's `Tiles`: rows [0, MR) (none holding -128) by tiles [t, t + NT), two vectors a tile.
// `ahead`: bytes past each tile to prefetch as it is read (0: none), so the next group of tiles is on its way
// while the last run of rows multiplies this one, which it reads from L2.
template <int MR, int NT>
KVATTN_AVX2 void HalfTiles(const int8_t* a, int64_t lda, const uint8_t* w, int64_t K, int32_t* out, int64_t ldo,
                           int64_t t, int64_t ahead) {
  constexpr int kVectors = 2 * NT;
  const int64_t groups = K / kGroup;
  const int64_t tile_bytes = K * kTileOutputs;
  const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  const uint8_t* tiles[NT];
  __m256i acc[MR][kVectors];
  for (int j = 0; j < NT; ++j) tiles[j] = w + (t + j) * tile_bytes;
  for (int i = 0; i < MR; ++i) {
    for (int v = 0; v < kVectors; ++v) acc[i][v] = _mm256_setzero_si256();
  }
  for (int64_t g = 0; g < groups; ++g) {
    if (ahead) {
      for (int j = 0; j < NT; ++j) _mm_prefetch(reinterpret_cast<const char*>(tiles[j] + g * 64 + ahead), _MM_HINT_T0);
    }
    __m256i x[MR];
    for (int i = 0; i < MR; ++i) {
      int32_t four;
      std::memcpy(&four, a + i * lda + g * kGroup, sizeof(four));
      x[i] = _mm256_set1_epi32(four);
    }
    for (int v = 0; v < kVectors; ++v) {
      const __m256i stored = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tiles[v / 2] + g * 64 + v % 2 * 32));
      const __m256i signed_w = _mm256_xor_si256(stored, bias), magnitude = _mm256_abs_epi8(signed_w);
      for (int i = 0; i < MR; ++i) {
        const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(x[i], signed_w));
        acc[i][v] = _mm256_add_epi32(acc[i][v], _mm256_madd_epi16(pairs, ones));
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int v = 0; v < kVectors; ++v) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i * ldo + t * kTileOutputs + v * 8), acc[i][v]);
    }
  }
}

// Rows by tiles [t0, t1), prefetching the tiles `ahead` tiles on while they lie before `end` (ahead 0: none).
template <int MR>
void HalfRows(const int8_t* a, int64_t lda, const uint8_t* w, int64_t K, int32_t* out, int64_t ldo, int64_t t0,
              int64_t t1, int64_t ahead, int64_t end) {
  constexpr int kSideBySide = MR == 1 ? 4 : MR == 2 ? 2 : 1;  // 16 registers: MR * 2NT accumulators, MR rows
  const auto bytes = [&](int64_t t, int64_t n) { return ahead && t + n + ahead <= end ? ahead * K * kTileOutputs : 0; };
  int64_t t = t0;
  for (; t + kSideBySide <= t1; t += kSideBySide) {
    HalfTiles<MR, kSideBySide>(a, lda, w, K, out, ldo, t, bytes(t, kSideBySide));
  }
  for (; t < t1; ++t) HalfTiles<MR, 1>(a, lda, w, K, out, ldo, t, bytes(t, 1));
}

// One row by tiles [t0, t1), a product at a time: a row holding -128.
void Exact(const int8_t* a, const uint8_t* w, int64_t K, int32_t* out, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t o = 0; o < kTileOutputs; ++o) {
      int32_t total = 0;
      for (int64_t k = 0; k < K; ++k) {
        total += a[k] * (static_cast<int32_t>(w[(t * (K / kGroup) + k / kGroup) * 64 + o * kGroup + k % kGroup]) - 128);
      }
      out[t * kTileOutputs + o] = total;
    }
  }
}

// The AVX2 body's `Part`: runs of up to four rows without -128 (`clean`) by tiles [t0, t1), the others alone.
// The tiles are taken eight at a time (96 KB at K = 768), every run of rows reading them before the next eight:
// the first run fetches them from memory, the others find them in L2 (not so when each run read all the tiles),
// and with more than one row the last prefetches the next eight, so that the next first run finds them in cache
// too instead of waiting on memory while it multiplies (one row streams as fast without it).
void HalfPart(const int8_t* a, int64_t M, int64_t K, const uint8_t* w, const bool* clean, int32_t* out, int64_t N,
              int64_t t0, int64_t t1) {
  constexpr int64_t kGroupTiles = 8;
  for (int64_t g = t0; g < t1; g += kGroupTiles) {
    const int64_t g1 = std::min(t1, g + kGroupTiles);
    for (int64_t m = 0; m < M;) {
      if (!clean[m]) {
        Exact(a + m * K, w, K, out + m * N, g, g1);
        ++m;
        continue;
      }
      int64_t run = 1;
      while (run < 4 && m + run < M && clean[m + run]) ++run;
      const int8_t* rows = a + m * K;
      int32_t* outs = out + m * N;
      const int64_t ahead = M > 1 && m + run == M ? kGroupTiles : 0;  // the last run fetches the next group
      switch (run) {
        case 1: HalfRows<1>(rows, K, w, K, outs, N, g, g1, ahead, t1); break;
        case 2: HalfRows<2>(rows, K, w, K, outs, N, g, g1, ahead, t1); break;
        case 3: HalfRows<3>(rows, K, w, K, outs, N, g, g1, ahead, t1); break;
        default: HalfRows<4>(rows, K, w, K, outs, N, g, g1, ahead, t1); break;
      }
      m += run;
    }
  }
}

// Rows `(M, K)` by every tile into `sums (M, N)`, split over the pool by tiles; each part calls
// `finish(first, last)` once its tiles' sums are in. `rows` must stay alive until the returned future completes
// (`finish` may hold it). `quantized`: no row holds -128 (`Quantize` made them), so none is looked through for one.
template <typename Finish>
ffi::Future Sums(ffi::ThreadPool& pool, const int8_t* rows, int64_t M, int64_t K, const uint8_t* weights,
                 int64_t tiles, int32_t* sums, bool quantized, Finish finish) {
  const int64_t N = tiles * kTileOutputs;
  if (!Vnni()) {
    auto clean = std::shared_ptr<bool[]>(new bool[std::max<int64_t>(M, 1)]);
    for (int64_t m = 0; m < M; ++m) {
      clean[m] = quantized || std::find(rows + m * K, rows + (m + 1) * K, -128) == rows + (m + 1) * K;
    }
    return kvattn::Split(pool, tiles, tiles / 8, [=](int64_t first, int64_t last) {
      HalfPart(rows, M, K, weights, clean.get(), sums, N, first, last);
      finish(first, last);
    });
  }
  // 128 * sum_k a[m, k] per row, which the weights' + 128 added to every product sum.
  auto shift = std::shared_ptr<int32_t[]>(new int32_t[std::max<int64_t>(M, 1)]);
  for (int64_t m = 0; m < M; ++m) {
    int32_t total = 0;
    for (int64_t k = 0; k < K; ++k) total += rows[m * K + k];
    shift[m] = 128 * total;
  }
  return kvattn::Split(pool, tiles, tiles / 8, [=](int64_t first, int64_t last) {
    Part(rows, M, K, weights, shift.get(), sums, N, first, last);
    finish(first, last);
  });
}

// Tiles `(N / 16, K / 4, 16, 4)` whose K matches the rows' last axis, and `outputs` elements for (..., N).
bool Shaped(const ffi::Span<const int64_t> dims, const ffi::Span<const int64_t> rows, int64_t count,
            int64_t outputs) {
  const int64_t K = dims[1] * kGroup;
  return dims[2] == kTileOutputs && dims[3] == kGroup && rows.size() != 0 && rows.back() == K &&
         outputs == count / std::max<int64_t>(K, 1) * dims[0] * kTileOutputs;
}

ffi::Future Dot(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> a, TiledWeights w, ffi::ResultBuffer<ffi::S32> out) {
  const auto dims = w.dimensions();
  if (!Shaped(dims, a.dimensions(), a.element_count(), out->element_count())) {
    return Failed("kvattn's int8 dot: rows (..., K) and tiles (N / 16, K / 4, 16, 4) into (..., N) expected");
  }
  const int64_t K = dims[1] * kGroup;
  const int64_t M = K ? a.element_count() / K : 0;
  return Sums(pool, a.typed_data(), M, K, w.typed_data(), dims[0], out->typed_data(), false,
              [](int64_t, int64_t) {});
}

KVATTN_KERNEL(int8_dot, Dot);

// One row quantized as `kvattn.math.quant.quantize_rows` does it under XLA, bit for bit; returns its scale.
// The scale is max|x| * float32(1 / 127) (NaN when the row holds one; 1 for a row of zeros); each value is
// x / scale rounded half to even and clipped to [-127, 127], a NaN quotient (inf / inf, or a NaN scale)
// giving 0 as XLA's conversion to int8 does.
KVATTN_AVX2 float Quantize(const float* x, int64_t K, int8_t* q) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 top = _mm256_setzero_ps(), unordered = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m256 v = _mm256_loadu_ps(x + k);
    top = _mm256_max_ps(top, _mm256_and_ps(v, magnitude));
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  float lanes[8], most = 0.0f;
  bool nan = _mm256_movemask_ps(unordered) != 0;
  _mm256_storeu_ps(lanes, top);
  for (float lane : lanes) most = std::max(most, lane);
  for (; k < K; ++k) {
    nan |= std::isnan(x[k]);
    most = std::max(most, std::fabs(x[k]));
  }
  float scale = nan ? __builtin_nanf("") : most * static_cast<float>(1.0 / 127.0);
  if (scale == 0.0f) scale = 1.0f;
  const __m256 divisor = _mm256_set1_ps(scale), low = _mm256_set1_ps(-127.0f), high = _mm256_set1_ps(127.0f);
  for (k = 0; k + 8 <= K; k += 8) {
    const __m256 r = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + k), divisor),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 kept = _mm256_and_ps(_mm256_min_ps(_mm256_max_ps(r, low), high), _mm256_cmp_ps(r, r, _CMP_ORD_Q));
    const __m256i whole = _mm256_cvtps_epi32(kept);
    const __m128i halves = _mm_packs_epi32(_mm256_castsi256_si128(whole), _mm256_extracti128_si256(whole, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + k), _mm_packs_epi16(halves, halves));
  }
  for (; k < K; ++k) {
    const float r = std::nearbyint(x[k] / scale);
    q[k] = std::isnan(r) ? 0 : static_cast<int8_t>(std::clamp(r, -127.0f, 127.0f));
  }
  return scale;
}

// Outputs [n0, n1) of each row, held as int32 sums where they lie, made float32 sum * row_scale[m] * scale[n]
// (that order, as XLA's elementwise product in `kvattn.kernels.dots`). n0 and n1 are whole tiles.
KVATTN_AVX2 void Scale(float* out, int64_t M, int64_t N, const float* row_scale, const float* scale, int64_t n0,
                       int64_t n1) {
  for (int64_t m = 0; m < M; ++m) {
    const __m256 by_row = _mm256_set1_ps(row_scale[m]);
    float* row = out + m * N;
    for (int64_t n = n0; n < n1; n += 8) {
      const __m256 sums = _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + n)));
      _mm256_storeu_ps(row + n, _mm256_mul_ps(_mm256_mul_ps(sums, by_row), _mm256_loadu_ps(scale + n)));
    }
  }
}

ffi::Future Dense(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, TiledWeights w, ffi::Buffer<ffi::F32> scale,
                  ffi::ResultBuffer<ffi::F32> out) {
  const auto dims = w.dimensions();
  if (!Shaped(dims, x.dimensions(), x.element_count(), out->element_count()) ||
      static_cast<int64_t>(scale.element_count()) != dims[0] * kTileOutputs) {
    return Failed("kvattn's int8 dense: rows (..., K), tiles (N / 16, K / 4, 16, 4) and scale (N,) into (..., N) "
                  "expected");
  }
  const int64_t K = dims[1] * kGroup, N = dims[0] * kTileOutputs;
  const int64_t M = K ? x.element_count() / K : 0;
  auto values = std::shared_ptr<int8_t[]>(new int8_t[std::max<int64_t>(M * K, 1)]);
  auto row_scale = std::shared_ptr<float[]>(new float[std::max<int64_t>(M, 1)]);
  for (int64_t m = 0; m < M; ++m) row_scale[m] = Quantize(x.typed_data() + m * K, K, values.get() + m * K);
  float* result = out->typed_data();
  const float* by_output = scale.typed_data();
  // The sums go where their float32 outputs will be, each part scaling its own tiles once they are in.
  // `values` is held by every part, so the rows live until the last is done.
  return Sums(pool, values.get(), M, K, w.typed_data(), dims[0], reinterpret_cast<int32_t*>(result), true,
              [result, M, N, row_scale, by_output, values](int64_t first, int64_t last) {
                Scale(result, M, N, row_scale.get(), by_output, first * kTileOutputs, last * kTileOutputs);
              });
}

KVATTN_KERNEL(int8_dense, Dense);

#endif  // KVATTN_X86

}  // namespace
