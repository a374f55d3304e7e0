#include <immintrin.h>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <algorithm>
#include <omp.h>
constexpr int64_t kLanes=16, kAhead=4096;
template <int MR, int NT>
__attribute__((target("avx2,fma"))) void Panel2(const float* a, int64_t K, const float* w, int64_t t, float* out, int64_t ldo, int64_t k0, int64_t k1, bool pf) {
  const float* panels[NT];
  __m256 acc[MR][NT][2];
  for (int j = 0; j < NT; ++j) {
    panels[j] = w + (t + j) * K * kLanes;
    for (int i = 0; i < MR; ++i) {
      const float* sums = out + i * ldo + (t + j) * kLanes;
      acc[i][j][0] = k0 ? _mm256_loadu_ps(sums) : _mm256_setzero_ps();
      acc[i][j][1] = k0 ? _mm256_loadu_ps(sums + 8) : _mm256_setzero_ps();
    }
  }
  for (int64_t k = k0; k < k1; ++k) {
    __m256 b[NT][2];
    for (int j = 0; j < NT; ++j) {
      const float* at = panels[j] + k * kLanes;
      if (pf) _mm_prefetch(reinterpret_cast<const char*>(at) + kAhead, _MM_HINT_T0);
      b[j][0]=_mm256_loadu_ps(at); b[j][1]=_mm256_loadu_ps(at+8);
    }
    for (int i = 0; i < MR; ++i) {
      const __m256 x = _mm256_set1_ps(a[i * K + k]);
      for (int j = 0; j < NT; ++j) {
        acc[i][j][0] = _mm256_fmadd_ps(x, b[j][0], acc[i][j][0]);
        acc[i][j][1] = _mm256_fmadd_ps(x, b[j][1], acc[i][j][1]);
      }
    }
  }
  for (int i = 0; i < MR; ++i) for (int j = 0; j < NT; ++j) {
      _mm256_storeu_ps(out + i * ldo + (t + j) * kLanes, acc[i][j][0]);
      _mm256_storeu_ps(out + i * ldo + (t + j) * kLanes + 8, acc[i][j][1]);
  }
}
template<int MR> void Block(const float* a, int64_t K, const float* w, float* out, int64_t ldo, int64_t t0, int64_t t1, int64_t k0, int64_t k1, bool pf){
  for (int64_t t=t0;t<t1;++t) Panel2<MR,1>(a,K,w,t,out,ldo,k0,k1,pf);
}
void Rows(int64_t rows, const float* a, int64_t K, const float* w, float* out, int64_t ldo, int64_t t0, int64_t t1, int64_t k0, int64_t k1, bool pf){
  switch(rows){case 6: Block<6>(a,K,w,out,ldo,t0,t1,k0,k1,pf);break; case 5: Block<5>(a,K,w,out,ldo,t0,t1,k0,k1,pf);break;
   case 4: Block<4>(a,K,w,out,ldo,t0,t1,k0,k1,pf);break; case 3: Block<3>(a,K,w,out,ldo,t0,t1,k0,k1,pf);break; case 2: Block<2>(a,K,w,out,ldo,t0,t1,k0,k1,pf);break; case 1: Block<1>(a,K,w,out,ldo,t0,t1,k0,k1,pf);break; default: abort();}
}
void Part(const float* a, int64_t M, int64_t K, const float* w, float* out, int64_t N, int64_t t0, int64_t t1, int64_t group, int64_t tile, bool even, bool pf){
  const int64_t blocks=(M+5)/6;
  const int64_t tiles=(K+tile-1)/tile;
  for (int64_t g=t0; g<t1; g+=group){ int64_t g1=std::min(t1,g+group);
    for (int64_t i=0;i<tiles;++i){ int64_t k0=i*tile,k1=std::min(K,k0+tile);
      for(int64_t b=0;b<blocks;++b){
        int64_t m, m1;
        if (even) { m=M*b/blocks; m1=M*(b+1)/blocks; } else { m=b*6; m1=std::min(M,m+6); }
        Rows(m1-m, a+m*K, K, w, out+m*N, N, g, g1, k0, k1, pf);
      }}}
}
int main(int argc, char** argv){
  int64_t M=atoi(argv[1]), K=atoi(argv[2]), N=atoi(argv[3]);
  int threads=atoi(argv[4]);
  float* a=(float*)aligned_alloc(64,M*K*4); float* w=(float*)aligned_alloc(64,K*N*4); float* out=(float*)aligned_alloc(64,M*N*4);
  for(int64_t i=0;i<M*K;i++)a[i]=(i%7)*1e-2f; for(int64_t i=0;i<K*N;i++)w[i]=(i%5)*1e-2f;
  int64_t panels=N/16;
  struct V{int64_t group,tile;bool even,pf;} vs[]={{12,K,true,true},{12,K,true,false},{12,256,true,true},{12,128,true,true},{4,K,true,true},{24,256,true,true},{8,384,true,true},{12,K,false,true}};
  bool fresh = argc > 5 && atoi(argv[5]);
  if (fresh) { vs[1]=vs[0]; }
  for (auto v: vs){
    double best=1e9;
    for(int rep=0;rep<7;rep++){
      double t0=omp_get_wtime();
      float* o2 = out;
      if (fresh && (&v - vs) == 0) { o2=(float*)malloc(M*N*4); }
      float* outp = o2;
      #pragma omp parallel num_threads(threads)
      { int id=omp_get_thread_num(); int64_t p0=panels*id/threads, p1=panels*(id+1)/threads;
        Part(a,M,K,w,outp,N,p0,p1,v.group,v.tile,v.even,v.pf); }
      if (outp != out) free(outp);
      double dt=omp_get_wtime()-t0; best=std::min(best,dt);
    }
    printf("M%ld K%ld N%ld thr%d group %ld tile %ld even %d pf %d: %.3f ms %.1f GFLOP/s\n",M,K,N,threads,v.group,v.tile,v.even,v.pf,best*1e3,2.0*M*K*N/best/1e9);
  }
}
