#include <immintrin.h>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <vector>
#include <omp.h>
constexpr int64_t kTileOutputs=16, kGroup=4;
int64_t g_pf_tiles = 0; int g_pf_hint = 0;
template <int MR, int NT>
__attribute__((target("avx2,fma"))) void HalfTiles(const int8_t* a, int64_t lda, const uint8_t* w, int64_t K, int32_t* out, int64_t ldo, int64_t t) {
  constexpr int kVectors = 2 * NT;
  const int64_t groups = K / kGroup;
  const int64_t tile_bytes = K * kTileOutputs;
  const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  const uint8_t* tiles[NT];
  __m256i acc[MR][kVectors];
  for (int j = 0; j < NT; ++j) tiles[j] = w + (t + j) * tile_bytes;
  for (int i = 0; i < MR; ++i) for (int v = 0; v < kVectors; ++v) acc[i][v] = _mm256_setzero_si256();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i x[MR];
    for (int i = 0; i < MR; ++i) { int32_t four; std::memcpy(&four, a + i * lda + g * kGroup, 4); x[i] = _mm256_set1_epi32(four); }
    if (g_pf_tiles) { for (int j = 0; j < NT; ++j) { const char* p = reinterpret_cast<const char*>(tiles[j] + g * 64 + g_pf_tiles * tile_bytes); if (g_pf_hint) _mm_prefetch(p, _MM_HINT_T1); else _mm_prefetch(p, _MM_HINT_T0); } }
    for (int v = 0; v < kVectors; ++v) {
      const __m256i stored = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tiles[v / 2] + g * 64 + v % 2 * 32));
      const __m256i signed_w = _mm256_xor_si256(stored, bias), magnitude = _mm256_abs_epi8(signed_w);
      for (int i = 0; i < MR; ++i) {
        const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(x[i], signed_w));
        acc[i][v] = _mm256_add_epi32(acc[i][v], _mm256_madd_epi16(pairs, ones));
      }
    }
  }
  for (int i = 0; i < MR; ++i) for (int v = 0; v < kVectors; ++v)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i * ldo + t * kTileOutputs + v * 8), acc[i][v]);
}
template <int MR> void HalfRows(const int8_t* a, int64_t lda, const uint8_t* w, int64_t K, int32_t* out, int64_t ldo, int64_t t0, int64_t t1) {
  constexpr int S = MR == 1 ? 4 : MR == 2 ? 2 : 1;
  int64_t t = t0;
  for (; t + S <= t1; t += S) HalfTiles<MR, S>(a, lda, w, K, out, ldo, t);
  for (; t < t1; ++t) HalfTiles<MR, 1>(a, lda, w, K, out, ldo, t);
}

template <int MR, int NT>
__attribute__((target("avx2,fma"))) void HalfTilesC(const int8_t* a, int64_t lda, const uint8_t* w, int64_t K, int32_t* out, int64_t ldo, int64_t t) {
  constexpr int kVectors = 2 * NT;
  const int64_t groups = K / kGroup;
  const int64_t tile_bytes = K * kTileOutputs;
  const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
  const uint8_t* tiles[NT];
  __m256i acc[MR][kVectors];
  for (int j = 0; j < NT; ++j) tiles[j] = w + (t + j) * tile_bytes;
  for (int i = 0; i < MR; ++i) for (int v = 0; v < kVectors; ++v) acc[i][v] = _mm256_setzero_si256();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i x[MR];
    for (int i = 0; i < MR; ++i) { int32_t four; std::memcpy(&four, a + i * lda + g * kGroup, 4); x[i] = _mm256_set1_epi32(four); }
    for (int v = 0; v < kVectors; ++v) {
      const __m256i stored = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tiles[v / 2] + g * 64 + v % 2 * 32));
      const __m256i signed_w = _mm256_xor_si256(stored, bias), magnitude = _mm256_abs_epi8(signed_w);
      for (int i = 0; i < MR; ++i) {
        const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(x[i], signed_w));
        const __m256i low = _mm256_srai_epi32(_mm256_slli_epi32(pairs, 16), 16), high = _mm256_srai_epi32(pairs, 16);
        acc[i][v] = _mm256_add_epi32(acc[i][v], _mm256_add_epi32(low, high));
      }
    }
  }
  for (int i = 0; i < MR; ++i) for (int v = 0; v < kVectors; ++v)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i * ldo + t * kTileOutputs + v * 8), acc[i][v]);
}
template <int MR> void HalfRowsC(const int8_t* a, int64_t lda, const uint8_t* w, int64_t K, int32_t* out, int64_t ldo, int64_t t0, int64_t t1) {
  constexpr int S = MR == 1 ? 4 : MR == 2 ? 2 : 1;
  int64_t t = t0;
  for (; t + S <= t1; t += S) HalfTilesC<MR, S>(a, lda, w, K, out, ldo, t);
  for (; t < t1; ++t) HalfTilesC<MR, 1>(a, lda, w, K, out, ldo, t);
}
template <int MR, int NT>
__attribute__((target("avx2,fma"))) void HalfTilesB(const int8_t* a, int64_t lda, const uint8_t* w, int64_t K, int32_t* out, int64_t ldo, int64_t t) {
  constexpr int kVectors = 2 * NT;
  const int64_t groups = K / kGroup;
  const int64_t tile_bytes = K * kTileOutputs;
  const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  const uint8_t* tiles[NT];
  __m256i acc[MR][kVectors];
  for (int j = 0; j < NT; ++j) tiles[j] = w + (t + j) * tile_bytes;
  for (int i = 0; i < MR; ++i) for (int v = 0; v < kVectors; ++v) acc[i][v] = _mm256_setzero_si256();
  for (int64_t g = 0; g < groups; ++g) {
    for (int v = 0; v < kVectors; ++v) {
      const __m256i stored = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tiles[v / 2] + g * 64 + v % 2 * 32));
      const __m256i signed_w = _mm256_xor_si256(stored, bias), magnitude = _mm256_abs_epi8(signed_w);
      for (int i = 0; i < MR; ++i) {
        const __m256i x = _mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float*>(a + i * lda + g * kGroup)));
        const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(x, signed_w));
        acc[i][v] = _mm256_add_epi32(acc[i][v], _mm256_madd_epi16(pairs, ones));
      }
    }
  }
  for (int i = 0; i < MR; ++i) for (int v = 0; v < kVectors; ++v)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i * ldo + t * kTileOutputs + v * 8), acc[i][v]);
}
template <int MR> void HalfRowsB(const int8_t* a, int64_t lda, const uint8_t* w, int64_t K, int32_t* out, int64_t ldo, int64_t t0, int64_t t1) {
  constexpr int S = MR == 1 ? 4 : MR == 2 ? 2 : 1;
  int64_t t = t0;
  for (; t + S <= t1; t += S) HalfTilesB<MR, S>(a, lda, w, K, out, ldo, t);
  for (; t < t1; ++t) HalfTilesB<MR, 1>(a, lda, w, K, out, ldo, t);
}
int main(int argc, char** argv){
  int64_t K=768, tiles=atoi(argv[1]); int M=atoi(argv[2]); int reps=atoi(argv[3]);
  int64_t N=tiles*16;
  uint8_t* w=(uint8_t*)aligned_alloc(64,K*N); int8_t* a=(int8_t*)aligned_alloc(64,8*K); int32_t* out=(int32_t*)aligned_alloc(64,8*N*4);
  for(int64_t i=0;i<K*N;i++) w[i]=(i*7)%255; for(int i=0;i<8*K;i++) a[i]=(i%200)-100;
  std::vector<double> ts;
  for(int r=0;r<7;r++){ double t0=omp_get_wtime();
    #pragma omp parallel num_threads(2)
    { int id=omp_get_thread_num(); int64_t p0=tiles*id/2, p1=tiles*(id+1)/2;
      bool B = getenv("VB") != nullptr; int R = getenv("RUN") ? atoi(getenv("RUN")) : 4;
      int64_t G = getenv("GROUP") ? atol(getenv("GROUP")) : (p1 - p0);
      const int64_t P0 = p0, P1 = p1;
      for(int q=0;q<reps;q++) for (int64_t g0 = P0; g0 < P1; g0 += G) { int64_t p0 = g0, p1 = std::min(P1, g0 + G);
      for(int m=0;m<M;m+=R){ int run=std::min(R,M-m);
        if (getenv("VC")) { switch(run){case 1: HalfRowsC<1>(a+m*K,K,w,K,out+m*N,N,p0,p1);break; case 2: HalfRowsC<2>(a+m*K,K,w,K,out+m*N,N,p0,p1);break; case 3: HalfRowsC<3>(a+m*K,K,w,K,out+m*N,N,p0,p1);break; default: HalfRowsC<4>(a+m*K,K,w,K,out+m*N,N,p0,p1);} continue; }
        if (B) { switch(run){case 1: HalfRowsB<1>(a+m*K,K,w,K,out+m*N,N,p0,p1);break; case 2: HalfRowsB<2>(a+m*K,K,w,K,out+m*N,N,p0,p1);break; case 3: HalfRowsB<3>(a+m*K,K,w,K,out+m*N,N,p0,p1);break; case 4: HalfRowsB<4>(a+m*K,K,w,K,out+m*N,N,p0,p1);break; case 5: HalfRowsB<5>(a+m*K,K,w,K,out+m*N,N,p0,p1);break; default: HalfRowsB<6>(a+m*K,K,w,K,out+m*N,N,p0,p1);} continue; }
        g_pf_tiles = (getenv("PF") && m + run >= M && p1 + G <= P1) ? G : 0; g_pf_hint = getenv("HINT") ? 1 : 0;
        switch(run){case 1: HalfRows<1>(a+m*K,K,w,K,out+m*N,N,p0,p1);break; case 2: HalfRows<2>(a+m*K,K,w,K,out+m*N,N,p0,p1);break; case 3: HalfRows<3>(a+m*K,K,w,K,out+m*N,N,p0,p1);break; default: HalfRows<4>(a+m*K,K,w,K,out+m*N,N,p0,p1);} } } }
    ts.push_back(omp_get_wtime()-t0);}
  std::sort(ts.begin(),ts.end()); double t=ts[3];
  long long sum=0; for (int64_t i=0;i<(int64_t)M*N;i++) sum += out[i]*(i%13+1); printf("checksum %lld\n", sum);
  double macs=(double)M*K*N*reps; double bound=macs/16/2/3.35e9;
  printf("tiles %ld M %d: %.2f ms, mul-port bound %.2f ms -> %.0f%%; %.1f GB/s weights\n", tiles, M, t*1e3, bound*1e3, bound/t*100, (double)K*N*reps/t/1e9);
}
