#include <immintrin.h>
#include <stdio.h>
#include <omp.h>
int main(){
  __m256 a0=_mm256_set1_ps(1),a1=a0,a2=a0,a3=a0,a4=a0,a5=a0,a6=a0,a7=a0,a8=a0,a9=a0,a10=a0,a11=a0;
  __m256 b=_mm256_set1_ps(0.999f), c=_mm256_set1_ps(0.001f);
  long N=200000000;
  double t0=omp_get_wtime();
  for(long it=0;it<N;it++){
#define F(x) x=_mm256_fmadd_ps(x,b,c);
    F(a0)F(a1)F(a2)F(a3)F(a4)F(a5)F(a6)F(a7)F(a8)F(a9)F(a10)F(a11)
    __asm__ volatile("" : "+x"(a0),"+x"(a1),"+x"(a2),"+x"(a3),"+x"(a4),"+x"(a5),"+x"(a6),"+x"(a7),"+x"(a8),"+x"(a9),"+x"(a10),"+x"(a11));
  }
  double t=omp_get_wtime()-t0;
  printf("%.1f GFLOP/s one core; %.2f GHz if 2 FMA/cycle\n", N*12*16/t/1e9, N*12/t/2/1e9);
  float o[8]; _mm256_storeu_ps(o,_mm256_add_ps(a0,a11)); printf("%f\n",o[0]);
}
