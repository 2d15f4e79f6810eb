// A minimal check macro for the native tests: count failures, print where, exit non-zero at the end.
#pragma once
#include <cstdio>

inline int& failures() {
  static int n = 0;
  return n;
}

#define CHECK(cond, ...)                                                   \
  do {                                                                     \
    if (!(cond)) {                                                         \
      ++failures();                                                        \
      std::fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                   \
      std::fprintf(stderr, "\n");                                          \
    }                                                                      \
  } while (0)

inline int finish(const char* name) {
  if (failures()) {
    std::fprintf(stderr, "%s: %d checks failed\n", name, failures());
    return 1;
  }
  std::printf("%s: all checks passed\n", name);
  return 0;
}
