// Where one-shot stops paying against two-shot (all_reduce), by the alpha-beta model every
// transport plans with; each passes its own figures. Header-only, no CUDA or torch.
#pragma once
#include <cstddef>

namespace ringreduce::ring {

// The largest size (bytes of the full tensor) one-shot should run: it moves (n-1) x size per rank
// against two-shot's 2(n-1)/n x size, (n-1)(n-2)/n x size more, and saves round_trip_s (the round
// trip it skips); worth it while those extra bytes take less than that at link_bytes_per_s.
// Rounded down to a power of two, at most cap; at world 2 there are no extra bytes: cap.
inline size_t oneshot_crossover(int nranks, double round_trip_s, double link_bytes_per_s, size_t cap) {
  if (nranks <= 2) return cap;
  const double limit = round_trip_s * link_bytes_per_s * nranks / ((nranks - 1.0) * (nranks - 2.0));
  size_t b = 1;
  while (b * 2 <= limit && b * 2 <= cap) b *= 2;
  return b;
}

}  // namespace ringreduce::ring
