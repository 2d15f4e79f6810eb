// What a shared-memory transfer costs between two processes, without ringreduce: each round,
// both processes write B bytes into their half of a shared mapping (timed: "write"), meet at a
// barrier, add the peer's half into a private array (timed: "read"), and meet again. The write
// is the cost a staged collective pays to publish data the other core read the round before.
// Built and run by benchmarks/store_probe.py (see there); standalone:
//   cc -O2 -o store_probe benchmarks/store_probe.c && ./store_probe 1048576 300 copy
// modes: copy     memcpy into the same buffer every round (the ring's slots)
//        stream   non-temporal stores (the lines leave the cache; the reader fetches from memory)
//        rotate   memcpy into the next of 64 buffers each round (lines long evicted from caches)
// Prints: "<median write us> <median read us>" (process 0's rounds).
#include <emmintrin.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e6 + t.tv_nsec * 1e-3;
}

static void copy_stream(char* d, const char* s, size_t n) {  // n and d: multiples of 64
  for (size_t i = 0; i < n; i += 64)
    for (int k = 0; k < 64; k += 16)
      _mm_stream_si128((__m128i*)(d + i + k), _mm_loadu_si128((const __m128i*)(s + i + k)));
  _mm_sfence();
}

static void meet(_Atomic long* c, long* v) {  // two-process barrier on one counter
  atomic_fetch_add(c, 1);
  *v += 2;
  while (atomic_load(c) < *v) _mm_pause();
}

static int cmp(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

int main(int argc, char** argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: %s BYTES ROUNDS copy|stream|rotate\n", argv[0]);
    return 2;
  }
  const size_t B = (strtoul(argv[1], 0, 10) + 63) / 64 * 64;
  const long rounds = strtol(argv[2], 0, 10);
  const int stream = !strcmp(argv[3], "stream"), nbuf = !strcmp(argv[3], "rotate") ? 64 : 1;
  char* sh = mmap(0, 2 * B * nbuf + 64, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (sh == MAP_FAILED || B == 0 || rounds < 1) return 2;
  memset(sh, 0, 2 * B * nbuf + 64);
  _Atomic long* c = (_Atomic long*)(sh + 2 * B * nbuf);
  const pid_t child = fork();
  const int me = child == 0;
  char* own = aligned_alloc(64, B);
  float* acc = aligned_alloc(64, B);
  memset(own, 1 + me, B);
  memset(acc, 0, B);
  double* wr = calloc(rounds, sizeof(double));
  double* rd = calloc(rounds, sizeof(double));
  long v = 0;
  meet(c, &v);
  for (long k = 0; k < rounds; ++k) {
    char* mine = sh + (me * nbuf + k % nbuf) * B;
    const float* peer = (const float*)(sh + ((1 - me) * nbuf + k % nbuf) * B);
    const double t0 = now_us();
    if (stream)
      copy_stream(mine, own, B);
    else
      memcpy(mine, own, B);
    const double t1 = now_us();
    meet(c, &v);
    const double t2 = now_us();
    for (size_t i = 0; i < B / 4; ++i) acc[i] += peer[i];
    const double t3 = now_us();
    meet(c, &v);
    wr[k] = t1 - t0;
    rd[k] = t3 - t2;
  }
  if (me) return acc[0] == 12345.f;  // keep the reads
  waitpid(child, 0, 0);
  qsort(wr, rounds, sizeof(double), cmp);
  qsort(rd, rounds, sizeof(double), cmp);
  printf("%.2f %.2f\n", wr[rounds / 2], rd[rounds / 2]);
  return 0;
}
