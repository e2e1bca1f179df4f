// quant_linear on 16-row interleaved blocks with int8 activations (cpu/quant_linear_x16.cpp),
// called by the quant_linear op's CPU kernel for ggml_type kX16Offset + {2, 3, 6, 8, 12, 14}.
#pragma once
#include <ATen/core/Tensor.h>
#include <cstdint>
#include <optional>

namespace osd {

// ggml_type of a GGUF type's blocks regrouped 16 rows at a time (Q4_0 1002, Q4_1 1003,
// Q5_0 1006, Q8_0 1008, Q4_K 1012, Q6_K 1014); osd_kernels.quant_x16.X16_OFFSET matches.
constexpr int64_t kX16Offset = 1000;

// True when the AVX-512 VNNI path runs (else the portable one, the same results).
bool x16_vnni_available();
// True when passes of several rows run on AMX-INT8 tiles (cpu/quant_linear_x16_amx.cpp):
// the VNNI path runs, the CPU has AMX and the OS gives this process the tile state.
bool x16_amx_available();

at::Tensor quant_linear_x16_cpu(const at::Tensor& x, const at::Tensor& qweight, int64_t ggml_type,
                                const std::optional<at::Tensor>& bias,
                                const std::optional<at::Tensor>& norm_weight, double eps);

}  // namespace osd
