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

#include <algorithm>
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

ffi::Future Dot(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> a, TiledWeights w, ffi::ResultBuffer<ffi::S32> out) {
  const auto dims = w.dimensions();
  const int64_t tiles = dims[0], K = dims[1] * kGroup, N = tiles * kTileOutputs;
  if (dims[2] != kTileOutputs || dims[3] != kGroup || a.dimensions().size() == 0 || a.dimensions().back() != K ||
      out->element_count() != a.element_count() / std::max<int64_t>(K, 1) * N) {
    return Failed("kvattn's int8 dot: rows (..., K) and tiles (N / 16, K / 4, 16, 4) into (..., N) expected");
  }
  const int64_t M = K ? a.element_count() / K : 0;
  const int8_t* rows = a.typed_data();
  const uint8_t* weights = w.typed_data();
  int32_t* result = out->typed_data();
  if (!Vnni()) {
    auto clean = std::shared_ptr<bool[]>(new bool[std::max<int64_t>(M, 1)]);
    for (int64_t m = 0; m < M; ++m) clean[m] = std::find(rows + m * K, rows + (m + 1) * K, -128) == rows + (m + 1) * K;
    return kvattn::Split(pool, tiles, tiles / 8, [=](int64_t first, int64_t last) {
      HalfPart(rows, M, K, weights, clean.get(), result, N, first, last);
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
    Part(rows, M, K, weights, shift.get(), result, N, first, last);
  });
}

KVATTN_KERNEL(int8_dot, Dot);

#endif  // KVATTN_X86

}  // namespace
