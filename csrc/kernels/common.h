// Shared, torch-free helpers for osd kernels. Included by the C++ CPU kernels and by the
// CUDA kernels, so per-row logic written here runs identically on both.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define OSD_HD __host__ __device__ __forceinline__
#else
#define OSD_HD inline
#endif

namespace osd {

// Data types understood by the torch-free kernels (the glue maps torch dtypes to these).
enum class DType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

}  // namespace osd
