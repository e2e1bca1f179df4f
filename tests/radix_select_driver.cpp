// Test driver for kernels/radix_select.h (torch-free): reads rows from stdin, writes the
// selected keys to stdout. Built and run by tests/test_radix_select.py.
//
// Input (little endian): int32 rows, then per row
//   int32 mode (0: top-k, 1: top-p), int32 levels, int64 n, int64 k, float temperature,
//   float top_p, float inv_z, n floats (logits for top-k, e for top-p).
// Output per row: uint32 key (top-k: the k-th largest logit key; top-p: the threshold key on
// p = e * inv_z), uint32 floor (top-k: top_k_logit_floor(key, temperature); top-p: 0).
#include <cstdint>
#include <cstdio>
#include <vector>

#include "kernels/radix_select.h"

namespace {

template <typename T>
bool read(T* x, size_t n = 1) {
  return std::fread(x, sizeof(T), n, stdin) == n;
}

}  // namespace

int main() {
  int32_t rows = 0;
  if (!read(&rows)) return 1;
  std::vector<float> x;
  for (int32_t r = 0; r < rows; ++r) {
    int32_t mode, levels;
    int64_t n, k;
    float temperature, top_p, inv_z;
    if (!(read(&mode) && read(&levels) && read(&n) && read(&k) && read(&temperature) &&
          read(&top_p) && read(&inv_z))) {
      return 1;
    }
    x.resize(static_cast<size_t>(n));
    if (!read(x.data(), x.size())) return 1;
    const float* row = x.data();
    uint32_t out[2] = {0, 0};
    if (mode == 0) {
      out[0] = osd::radix_select_serial(n, levels, static_cast<uint64_t>(k),
                                        [row](int64_t v, uint32_t& key, uint64_t& weight) {
                                          key = osd::radix_key(row[v]);
                                          weight = 1;
                                        });
      out[1] = osd::top_k_logit_floor(out[0], temperature);
    } else {
      out[0] = osd::radix_select_serial(n, 4, osd::radix_mass_target(top_p),
                                        [row, inv_z](int64_t v, uint32_t& key, uint64_t& weight) {
                                          const float p = row[v] * inv_z;
                                          key = osd::radix_key(p);
                                          weight = osd::radix_mass(p);
                                        });
    }
    if (std::fwrite(out, sizeof(uint32_t), 2, stdout) != 2) return 1;
  }
  return 0;
}
