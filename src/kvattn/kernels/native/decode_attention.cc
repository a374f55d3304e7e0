// kvattn's decode attention for XLA:CPU: one query per sequence and head over a float32 cache, contiguous
// (`decode_attention`) or paged (`paged_decode_attention`).
//
// For each sequence b, kv head k and query g of its group, over slots
// s < visible[b] of the sequence's keys and values:
//   score[s] = q[b, k, g] . keys[b, k, s]
//   top      = max_s score[s]
//   total    = sum_s exp(score[s] - top)
//   o        = sum_s exp(score[s] - top) values[b, k, s]
// unnormalised, as jax's Pallas decode kernel returns them with its
// residuals, so `kvattn.kernels.cpu` folds in the new token and divides
// alike for both. Slots at or past visible[b] are never read; with none
// visible, o and total are 0 and top is -inf (exp: `kvattn::Exp`). A NaN or
// inf among the visible scores spreads as in a float64 softmax: top NaN or
// +inf, weights NaN.
//
// The contiguous caches are heads-major (B, K, S, H). A paged pool is
// (P, K, page, H), heads-major within each page, and table[b, j] names the
// page holding the sequence's slots j*page .. (j+1)*page - 1 (an entry
// outside [0, P) reads page 0 or P - 1, never past the pool): the same
// sums, read page by page where the pages lie, with no copy into a view.
// Each sum runs over s in order whatever the layout, so a sequence's
// outputs are the same bits paged or contiguous.
//
// XLA's own path for this step reads a cache bucket under a `cond` (a paged
// one gathers its pages into views first), with a scores dot, a masked
// softmax and a values dot as separate thunks; this reads the visible
// slots once per (b, k), splitting the pairs over XLA's intra-op thread pool.
//
// AVX-512 (`Pair`), else AVX2 and FMA (`PairAvx2`, sixteen lanes as two halves: the same bits). The AVX2
// body mixes the values of up to four queries in one pass over the slots (`MixTile`: up to twelve chains of
// fused multiply-adds side by side, each output still one chain in slot order), and asks for each page two
// ahead of the one it reads (`kvattn::Prefetch`).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kvattn/kernels/native/native.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using kvattn::Failed;

namespace {

#ifdef KVATTN_X86

using kvattn::Exp;

// Where one (b, k) pair's slots lie in a contiguous cache: one run of rows of H from `base`.
struct Contiguous {
  const float* base;
  int64_t H;
  int64_t span;  // slots from `at(first)` that lie one after another: all of them
  const float* at(int64_t first) const { return base + first * H; }
};

// Where one (b, k) pair's slots lie in a paged pool (P, K, page, H): runs of `span` = page slots, the run
// from slot `first` (a multiple of the page) in page table[first / page].
struct Pages {
  const float* pool;
  const int32_t* table;
  int64_t P, K, k, H, span;
  const float* at(int64_t first) const {
    const int64_t page = std::clamp<int64_t>(table[first / span], 0, P - 1);
    return pool + ((page * K + k) * span) * H;
  }
};

// The run two after the one from `first`, asked for while that one is read (`kvattn::Prefetch`); nullptr
// when it starts past the visible slots (always for a contiguous cache: one run).
template <typename Slots>
const float* RunAhead(const Slots& slots, int64_t first, int64_t visible) {
  return first + 2 * slots.span < visible ? slots.at(first + 2 * slots.span) : nullptr;
}

// One (b, k) pair: G queries of H (a multiple of 16) over `visible` slots of `keys` and `values`, read run
// by run (`Contiguous` or `Pages`), each sum in slot order.
template <typename Slots>
KVATTN_AVX512 void Pair(const float* q, Slots keys, Slots values, int64_t visible, int64_t G, int64_t H, float* o,
                        float* total, float* top, std::vector<float>& scores) {
  const int64_t chunks = H / 16;
  const int64_t padded = (visible + 15) / 16 * 16;
  scores.assign(G * padded, -std::numeric_limits<float>::infinity());
  for (int64_t first = 0; first < visible; first += keys.span) {
    const float* run = keys.at(first);
    const int64_t count = std::min(keys.span, visible - first);
    for (int64_t s = 0; s < count; ++s) {
      const float* key = run + s * H;
      for (int64_t g = 0; g < G; ++g) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t c = 0; c < chunks; ++c) {
          acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * H + 16 * c), _mm512_loadu_ps(key + 16 * c), acc);
        }
        scores[g * padded + first + s] = _mm512_reduce_add_ps(acc);
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* row = scores.data() + g * padded;
    __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    __mmask16 unordered = 0;
    for (int64_t s = 0; s < padded; s += 16) kvattn::Fold(_mm512_loadu_ps(row + s), 0xFFFF, best, unordered);
    // A NaN or +inf score makes top NaN or +inf, so every weight is NaN, as in a float64 softmax; so do
    // scores all -inf (-inf - -inf). Nothing visible: top -inf and no weights.
    const float high = visible ? kvattn::Maximum(best, unordered) : -std::numeric_limits<float>::infinity();
    __m512 sum = _mm512_setzero_ps();
    for (int64_t s = 0; s < padded; s += 16) {  // padding slots hold -inf; their weights are masked to 0
      const __mmask16 real = visible - s >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (visible - s)) - 1);
      const __m512 w = _mm512_maskz_mov_ps(real, Exp(_mm512_sub_ps(_mm512_loadu_ps(row + s), _mm512_set1_ps(high))));
      _mm512_storeu_ps(row + s, w);
      sum = _mm512_add_ps(sum, w);
    }
    top[g] = high;
    total[g] = _mm512_reduce_add_ps(sum);
  }
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t c = 0; c < chunks; ++c) {
      const float* weights = scores.data() + g * padded;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t first = 0; first < visible; first += values.span) {
        const float* run = values.at(first) + 16 * c;
        const int64_t count = std::min(values.span, visible - first);
        for (int64_t s = 0; s < count; ++s) {
          acc = _mm512_fmadd_ps(_mm512_set1_ps(weights[first + s]), _mm512_loadu_ps(run + s * H), acc);
        }
      }
      _mm512_storeu_ps(o + g * H + 16 * c, acc);
    }
  }
}


// The values pass of `PairAvx2` for GQ queries (their weights rows `padded` apart) and HV eight-lane columns
// from `column`: o[g, column .. column + 8 HV) = sum_s weights[g][s] values[s, ...], each output one chain of
// fused multiply-adds in slot order, the AVX-512 body's sums. Every query of the group reads a slot's values
// while they are in registers, and the GQ x HV chains run side by side (GQ HV + HV + 1 of 16 registers).
template <int GQ, int HV, typename Slots>
KVATTN_AVX2 void MixTile(const float* weights, int64_t padded, Slots values, int64_t visible, int64_t H,
                         int64_t column, float* o) {
  __m256 acc[GQ][HV];
  for (int g = 0; g < GQ; ++g)
    for (int h = 0; h < HV; ++h) acc[g][h] = _mm256_setzero_ps();
  for (int64_t first = 0; first < visible; first += values.span) {
    const float* run = values.at(first) + column;
    const float* ahead = column == 0 ? RunAhead(values, first, visible) : nullptr;  // the first pass asks
    const int64_t count = std::min(values.span, visible - first);
    for (int64_t s = 0; s < count; ++s) {
      if (ahead) kvattn::Prefetch(ahead + s * H, H);
      __m256 v[HV];
      for (int h = 0; h < HV; ++h) v[h] = _mm256_loadu_ps(run + s * H + 8 * h);
      for (int g = 0; g < GQ; ++g) {
        const __m256 w = _mm256_set1_ps(weights[g * padded + first + s]);
        for (int h = 0; h < HV; ++h) acc[g][h] = _mm256_fmadd_ps(w, v[h], acc[g][h]);
      }
    }
  }
  for (int g = 0; g < GQ; ++g)
    for (int h = 0; h < HV; ++h) _mm256_storeu_ps(o + g * H + column + 8 * h, acc[g][h]);
}

// `MixTile` with the last pass narrower: `halves` (at most HV) columns of eight from `column`.
template <int GQ, int HV, typename Slots>
void MixHalves(int64_t halves, const float* weights, int64_t padded, Slots values, int64_t visible, int64_t H,
               int64_t column, float* o) {
  if constexpr (HV > 1) {
    if (halves < HV) return MixHalves<GQ, HV - 1>(halves, weights, padded, values, visible, H, column, o);
  }
  MixTile<GQ, HV>(weights, padded, values, visible, H, column, o);
}

// Every column of GQ queries, HV eight-lane columns a pass.
template <int GQ, int HV, typename Slots>
void MixQueries(const float* weights, int64_t padded, Slots values, int64_t visible, int64_t H, float* o) {
  for (int64_t column = 0; column < H; column += 8 * HV) {
    MixHalves<GQ, HV>(std::min<int64_t>(HV, (H - column) / 8), weights, padded, values, visible, H, column, o);
  }
}

// `Pair` on AVX2, sixteen lanes as two halves (`kvattn::F16`): the same operations lane for lane, the same bits.
template <typename Slots>
KVATTN_AVX2 void PairAvx2(const float* q, Slots keys, Slots values, int64_t visible, int64_t G, int64_t H, float* o,
                          float* total, float* top, std::vector<float>& scores) {
  using kvattn::F16;
  const int64_t chunks = H / 16;
  const int64_t padded = (visible + 15) / 16 * 16;
  scores.assign(G * padded, -std::numeric_limits<float>::infinity());
  for (int64_t first = 0; first < visible; first += keys.span) {
    const float* run = keys.at(first);
    const float* ahead = RunAhead(keys, first, visible);
    const int64_t count = std::min(keys.span, visible - first);
    for (int64_t s = 0; s < count; ++s) {
      const float* key = run + s * H;
      if (ahead) kvattn::Prefetch(ahead + s * H, H);
      for (int64_t g = 0; g < G; ++g) {
        F16 acc = kvattn::Splat16(0.0f);
        for (int64_t c = 0; c < chunks; ++c) {
          acc = kvattn::Fmadd16(kvattn::Load16(q + g * H + 16 * c), kvattn::Load16(key + 16 * c), acc);
        }
        scores[g * padded + first + s] = kvattn::Sum16(acc);
      }
    }
  }
  const F16 every = kvattn::Lanes16(16);
  for (int64_t g = 0; g < G; ++g) {
    float* row = scores.data() + g * padded;
    F16 best = kvattn::Splat16(-std::numeric_limits<float>::infinity());
    __m256 unordered = _mm256_setzero_ps();
    for (int64_t s = 0; s < padded; s += 16) kvattn::Fold16(kvattn::Load16(row + s), every, best, unordered);
    const float high = visible ? kvattn::Maximum16(best, unordered) : -std::numeric_limits<float>::infinity();
    F16 sum = kvattn::Splat16(0.0f);
    for (int64_t s = 0; s < padded; s += 16) {
      const F16 w = kvattn::Keep16(kvattn::Lanes16(visible - s),
                                   kvattn::Exp16(kvattn::Sub16(kvattn::Load16(row + s), kvattn::Splat16(high))));
      kvattn::Store16(row + s, w);
      sum = kvattn::Add16(sum, w);
    }
    top[g] = high;
    total[g] = kvattn::Sum16(sum);
  }
  for (int64_t g = 0; g < G; g += 4) {
    switch (std::min<int64_t>(4, G - g)) {
      case 4: MixQueries<4, 3>(scores.data() + g * padded, padded, values, visible, H, o + g * H); break;
      case 3: MixQueries<3, 3>(scores.data() + g * padded, padded, values, visible, H, o + g * H); break;
      case 2: MixQueries<2, 4>(scores.data() + g * padded, padded, values, visible, H, o + g * H); break;
      default: MixQueries<1, 6>(scores.data() + g * padded, padded, values, visible, H, o + g * H); break;
    }
  }
}

// One (b, k) pair on the CPU's body.
template <typename Slots>
void OnePair(bool wide, const float* q, Slots keys, Slots values, int64_t visible, int64_t G, int64_t H, float* o,
            float* total, float* top, std::vector<float>& scores) {
  if (wide) {
    Pair(q, keys, values, visible, G, H, o, total, top, scores);
  } else {
    PairAvx2(q, keys, values, visible, G, H, o, total, top, scores);
  }
}

using Rank4 = ffi::Buffer<ffi::F32, 4>;
using Rank3 = ffi::Buffer<ffi::F32, 3>;
using Lengths = ffi::Buffer<ffi::S32, 1>;

ffi::Future Attend(ffi::ThreadPool pool, Rank4 q, Rank4 keys, Rank4 values, Lengths visible, ffi::Result<Rank4> o,
                   ffi::Result<Rank3> total, ffi::Result<Rank3> top) {
  const auto qd = q.dimensions(), kd = keys.dimensions();
  const int64_t B = qd[0], K = qd[1], G = qd[2], H = qd[3], S = kd[2];
  const auto vd = values.dimensions();
  if (kd[0] != B || kd[1] != K || kd[3] != H || vd[0] != B || vd[1] != K || vd[2] != S || vd[3] != H ||
      visible.dimensions()[0] != B || H % 16 != 0) {
    return Failed("kvattn decode attention: q (B, K, G, H), caches (B, K, S, H), visible (B,), H % 16 == 0");
  }
  const float* qp = q.typed_data();
  const float* kp = keys.typed_data();
  const float* vp = values.typed_data();
  const int32_t* seen = visible.typed_data();
  float* op = o->typed_data();
  float* tp = total->typed_data();
  float* mp = top->typed_data();
  const bool wide = kvattn::Avx512();
  return kvattn::Split(pool, B * K, B * K, [=](int64_t first, int64_t last) {
    std::vector<float> scores;
    for (int64_t pair = first; pair < last; ++pair) {
      const int64_t n = std::clamp<int64_t>(seen[pair / K], 0, S);
      OnePair(wide, qp + pair * G * H, Contiguous{kp + pair * S * H, H, S}, Contiguous{vp + pair * S * H, H, S}, n,
              G, H, op + pair * G * H, tp + pair * G, mp + pair * G, scores);
    }
  });
}

KVATTN_KERNEL(decode_attention, Attend);

using Table = ffi::Buffer<ffi::S32, 2>;

ffi::Future AttendPages(ffi::ThreadPool pool, Rank4 q, Rank4 keys, Rank4 values, Table table, Lengths filled,
                        ffi::Result<Rank4> o, ffi::Result<Rank3> total, ffi::Result<Rank3> top) {
  const auto qd = q.dimensions(), kd = keys.dimensions(), vd = values.dimensions(), td = table.dimensions();
  const int64_t B = qd[0], K = qd[1], G = qd[2], H = qd[3], P = kd[0], page = kd[2], M = td[1];
  if (kd[1] != K || kd[3] != H || vd[0] != P || vd[1] != K || vd[2] != page || vd[3] != H || td[0] != B ||
      filled.dimensions()[0] != B || H % 16 != 0 || P < 1 || page < 1) {
    return Failed("kvattn paged decode attention: q (B, K, G, H), pools (P, K, page, H), table (B, M), "
                  "filled (B,), H % 16 == 0");
  }
  const float* qp = q.typed_data();
  const float* kp = keys.typed_data();
  const float* vp = values.typed_data();
  const int32_t* tp = table.typed_data();
  const int32_t* seen = filled.typed_data();
  float* op = o->typed_data();
  float* sp = total->typed_data();
  float* mp = top->typed_data();
  const bool wide = kvattn::Avx512();
  return kvattn::Split(pool, B * K, B * K, [=](int64_t first, int64_t last) {
    std::vector<float> scores;
    for (int64_t pair = first; pair < last; ++pair) {
      const int64_t b = pair / K, k = pair % K;
      const int64_t n = std::clamp<int64_t>(seen[b], 0, M * page);
      OnePair(wide, qp + pair * G * H, Pages{kp, tp + b * M, P, K, k, H, page},
              Pages{vp, tp + b * M, P, K, k, H, page}, n, G, H, op + pair * G * H, sp + pair * G, mp + pair * G, scores);
    }
  });
}

KVATTN_KERNEL(paged_decode_attention, AttendPages);

#endif  // KVATTN_X86

}  // namespace
