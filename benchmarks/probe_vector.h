// The vector width of the flags a benchmark probe is compiled with (setup.py's flags of one kernel
// unit): kVecBytes, for benchmarks/kv_read_probe.cpp and benchmarks/fma_peak_probe.cpp.
#pragma once

#if defined(__AVX512F__)
constexpr int kVecBytes = 64;
#elif defined(__AVX2__)
constexpr int kVecBytes = 32;
#else
constexpr int kVecBytes = 16;
#endif
