// The C++ CPU kernels of the fused decode-layer ops (osd/models/fused_layers.py):
// add_rms_norm, rope_kv_write (and rope_kv_write_qkv, the same op on the qkv projection as
// it comes out of the GEMV) and silu_mul. Float32 only (rope_kv_write's cache may also be
// float16: K and V rounded to nearest as they are written, as Tensor.half() rounds); each
// kernel is a few microseconds of work at decode sizes, so what they save is the op calls
// they replace.
//
// Rounding is that of the unfused CPU forward, operation for operation, so the fused CPU
// layers give its results bit for bit:
// - add_rms_norm: h = residual + x (x * scale rounded first when scale != 1); the norm of
//   h as decode_linear's and quant_linear's fused norm computes it (linear_rows.h
//   rms_norm_rows: the sum of squares in double, in order; y = w * (h * inv)). Against
//   F.rms_norm (a float32 sum) y agrees within a rounding of the inverse norm.
// - rope: torch.addcmul(x * cos, roll(x), sin) as ATen computes it: x * cos rounded, then
//   one fused multiply-add.
// - silu_mul: x / (1 + exp(-x)) times up, as ATen's SiLU computes it: SLEEF's expf (u10,
//   the very functions libtorch exports) over whole blocks of two vectors, glibc's expf on
//   the rest of a row; the AVX-512 path blocks by 32 and the AVX2 one by 16, as ATen does
//   at those capabilities.
// The file compiles without floating-point contraction so that none of this becomes FMA
// where the unfused ops round twice.
#pragma GCC optimize("fp-contract=off")

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include <cmath>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include "checks.h"
#include "cpu/fast_math.h"

#if defined(__x86_64__)
#include <immintrin.h>
// SLEEF's float exp, 1.0 ulp, as linked into libtorch_cpu (what ATen's Vectorized<float>::exp
// calls at the AVX-512 and AVX2 capabilities).
extern "C" __m512 Sleef_expf16_u10avx512f(__m512);
extern "C" __m256 Sleef_expf8_u10avx2(__m256);
#endif

namespace osd {
namespace {

// ---------------------------------------------------------------------------------------
// add_rms_norm

void add_rms_norm_row(const float* x, const float* r, const float* w, float* h, float* y,
                      int64_t K, float scale, float eps) {
  if (scale == 1.0f) {
    for (int64_t k = 0; k < K; ++k) h[k] = r[k] + x[k];
  } else {
    for (int64_t k = 0; k < K; ++k) h[k] = r[k] + x[k] * scale;
  }
  double ss = 0.0;
  for (int64_t k = 0; k < K; ++k) ss += static_cast<double>(h[k]) * h[k];
  const float inv = 1.0f / std::sqrt(static_cast<float>(ss / static_cast<double>(K)) + eps);
  for (int64_t k = 0; k < K; ++k) y[k] = w[k] * (h[k] * inv);
}

// t [..., K] as [M, K] rows with a contiguous last dim: t itself when it is such a matrix
// already (the fused layers' case), else a reshaped (copied if need be) one.
at::Tensor as_rows(const at::Tensor& t) {
  const int64_t K = t.size(-1);
  if (t.dim() == 2 && (t.stride(1) == 1 || K <= 1)) return t;
  at::Tensor rows = t.reshape({-1, K});
  return rows.stride(1) == 1 || K <= 1 ? rows : rows.contiguous();
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_cpu(const at::Tensor& x,
                                                    const at::Tensor& residual,
                                                    const at::Tensor& weight, double eps,
                                                    double scale) {
  OSD_CHECK(x.device().is_cpu(), "add_rms_norm CPU kernel got a ", x.device(), " tensor");
  check_dtype(x, at::kFloat, "x");
  check_dtype(residual, at::kFloat, "residual");
  check_dtype(weight, at::kFloat, "weight");
  OSD_CHECK(x.dim() >= 1 && x.sizes() == residual.sizes(), "x ", x.sizes(), " and residual ",
            residual.sizes(), " must be one shape [..., H]");
  const int64_t K = x.size(-1);
  OSD_CHECK(weight.dim() == 1 && weight.size(0) == K && weight.is_contiguous(),
            "weight must be contiguous [H=", K, "], got ", weight.sizes());
  OSD_CHECK(eps >= 0.0, "eps must be >= 0, got ", eps);
  check_same_device(x, residual, "x", "residual");
  check_same_device(x, weight, "x", "weight");
  at::Tensor h = at::empty(x.sizes(), x.options());
  at::Tensor y = at::empty(x.sizes(), x.options());
  const int64_t M = K == 0 ? 0 : x.numel() / K;
  if (M == 0) return {h, y};
  const at::Tensor xr = as_rows(x);
  const at::Tensor rr = as_rows(residual);
  const int64_t ldx = xr.stride(0);
  const int64_t ldr = rr.stride(0);
  const float* xp = xr.data_ptr<float>();
  const float* rp = rr.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float s = static_cast<float>(scale);
  const float e = static_cast<float>(eps);
  at::parallel_for(0, M, std::max<int64_t>(1, 65536 / K), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      add_rms_norm_row(xp + m * ldx, rp + m * ldr, wp, hp + m * K, yp + m * K, K, s, e);
    }
  });
  return {h, y};
}

// ---------------------------------------------------------------------------------------
// rope_kv_write

// A [B, T, H, D] operand by its base pointer and element strides (last dim contiguous).
struct Heads {
  const float* p;
  int64_t sb, st, sh;
};

constexpr int64_t kMaxHalfDim = 512;  // head dims a float16 cache takes (a stack row)

struct RopeArgs {
  Heads q, k, v;
  const float* cos = nullptr;  // [B, T, R] rows, or nullptr (no rotation)
  const float* sin = nullptr;
  int64_t cb = 0, ct = 0, sb = 0, st = 0;  // cos / sin strides of b and t
  void* kv;                                // [2, B_max, Hkv, S, D]: float32 or float16
  bool half_kv = false;                    // a float16 cache (written rounded to nearest)
  int64_t kv_s0, kv_sb, kv_sh, kv_ss;      // strides of K/V, row, head, slot
  const int64_t* slots;                    // [B, T]
  int64_t slots_sb, slots_st;
  float* out;  // the rotated queries, [B, T, Hq, D] contiguous
  int64_t B, T, Hq, Hkv, D, R;
};

// out = rotate(x): for d < R / 2, x[d] c[d] + x[d + R/2] s[d]; for R/2 <= d < R,
// x[d] c[d] + x[d - R/2] s[d] (x * cos rounded, then one fused multiply-add, as addcmul);
// dims past R copied.
template <bool kHw>
OSD_INLINE void rotate(const float* x, const float* c, const float* s, float* out, int64_t R,
                       int64_t D) {
  const int64_t half = R / 2;
  for (int64_t d = 0; d < half; ++d) {
    out[d] = kHw ? __builtin_fmaf(x[d + half], s[d], x[d] * c[d])
                 : std::fma(x[d + half], s[d], x[d] * c[d]);
  }
  for (int64_t d = half; d < R; ++d) {
    out[d] = kHw ? __builtin_fmaf(x[d - half], s[d], x[d] * c[d])
                 : std::fma(x[d - half], s[d], x[d] * c[d]);
  }
  for (int64_t d = R; d < D; ++d) out[d] = x[d];
}

template <bool kHw>
OSD_INLINE void rope_kv_token(const RopeArgs& a, int64_t b, int64_t t) {
  const float* c = a.cos == nullptr ? nullptr : a.cos + b * a.cb + t * a.ct;
  const float* s = a.sin == nullptr ? nullptr : a.sin + b * a.sb + t * a.st;
  float* q_out = a.out + ((b * a.T + t) * a.Hq) * a.D;
  for (int64_t h = 0; h < a.Hq; ++h) {
    const float* x = a.q.p + b * a.q.sb + t * a.q.st + h * a.q.sh;
    if (c == nullptr) {
      std::memcpy(q_out + h * a.D, x, a.D * sizeof(float));
    } else {
      rotate<kHw>(x, c, s, q_out + h * a.D, a.R, a.D);
    }
  }
  const int64_t slot = a.slots[b * a.slots_sb + t * a.slots_st];
  if (a.half_kv) {  // rotated in float32, then rounded to the cache's float16
    float buf[kMaxHalfDim];
    c10::Half* kv = static_cast<c10::Half*>(a.kv);
    for (int64_t h = 0; h < a.Hkv; ++h) {
      c10::Half* k_dst = kv + b * a.kv_sb + h * a.kv_sh + slot * a.kv_ss;
      const float* x = a.k.p + b * a.k.sb + t * a.k.st + h * a.k.sh;
      if (c == nullptr) {
        std::memcpy(buf, x, a.D * sizeof(float));
      } else {
        rotate<kHw>(x, c, s, buf, a.R, a.D);
      }
      const float* y = a.v.p + b * a.v.sb + t * a.v.st + h * a.v.sh;
      for (int64_t d = 0; d < a.D; ++d) {
        k_dst[d] = c10::Half(buf[d]);
        k_dst[a.kv_s0 + d] = c10::Half(y[d]);
      }
    }
    return;
  }
  for (int64_t h = 0; h < a.Hkv; ++h) {
    float* k_dst = static_cast<float*>(a.kv) + b * a.kv_sb + h * a.kv_sh + slot * a.kv_ss;
    const float* x = a.k.p + b * a.k.sb + t * a.k.st + h * a.k.sh;
    if (c == nullptr) {
      std::memcpy(k_dst, x, a.D * sizeof(float));
    } else {
      rotate<kHw>(x, c, s, k_dst, a.R, a.D);
    }
    std::memcpy(k_dst + a.kv_s0, a.v.p + b * a.v.sb + t * a.v.st + h * a.v.sh,
                a.D * sizeof(float));
  }
}

void rope_kv_portable(const RopeArgs& a, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) rope_kv_token<false>(a, i / a.T, i % a.T);
}

#if defined(__x86_64__)
OSD_AVX2 void rope_kv_avx2(const RopeArgs& a, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) rope_kv_token<true>(a, i / a.T, i % a.T);
}
#endif

Heads heads_of(const at::Tensor& t) {
  return {t.data_ptr<float>(), t.stride(0), t.stride(1), t.stride(2)};
}

// Checks the tables, the cache and the slots against q [B, T, Hq, D], k, v [B, T, Hkv, D],
// runs the kernel and returns the rotated queries.
at::Tensor rope_kv_run(RopeArgs& a, const at::Tensor& like, const std::optional<at::Tensor>& cos,
                       const std::optional<at::Tensor>& sin, at::Tensor& kv,
                       const at::Tensor& slots) {
  OSD_CHECK(kv.scalar_type() == at::kFloat || kv.scalar_type() == at::kHalf,
            "kv must be float32 or float16, got ", kv.scalar_type());
  OSD_CHECK(kv.scalar_type() == at::kFloat || a.D <= kMaxHalfDim, "a float16 kv takes head dims up to ",
            kMaxHalfDim, ", got ", a.D);
  OSD_CHECK(kv.dim() == 5 && kv.size(0) == 2 && kv.size(1) >= a.B && kv.size(2) == a.Hkv &&
                kv.size(4) == a.D && kv.stride(4) == 1,
            "kv must be [2, B_max >= ", a.B, ", Hkv=", a.Hkv, ", S, D=", a.D,
            "] with a contiguous last dim, got ", kv.sizes(), " strides ", kv.strides());
  check_same_device(like, kv, "q", "kv");
  check_dtype(slots, at::kLong, "slots");
  OSD_CHECK(slots.dim() == 2 && slots.size(0) == a.B && slots.size(1) == a.T, "slots must be [B=",
            a.B, ", T=", a.T, "], got ", slots.sizes());
  check_same_device(like, slots, "q", "slots");
  OSD_CHECK(cos.has_value() == sin.has_value(), "cos and sin are both given or both None");
  a.R = 0;
  if (cos.has_value()) {
    const at::Tensor& c = *cos;
    const at::Tensor& s = *sin;
    check_dtype(c, at::kFloat, "cos");
    check_dtype(s, at::kFloat, "sin");
    a.R = c.dim() == 3 ? c.size(2) : -1;
    OSD_CHECK(c.dim() == 3 && c.size(0) == a.B && c.size(1) == a.T && s.sizes() == c.sizes() &&
                  a.R % 2 == 0 && a.R > 0 && a.R <= a.D,
              "cos and sin must be [B=", a.B, ", T=", a.T, ", R] with R even, 0 < R <= ", a.D,
              ", got ", c.sizes(), ", ", s.sizes());
    OSD_CHECK(c.stride(2) == 1 && s.stride(2) == 1, "cos and sin need a contiguous last dim");
    check_same_device(like, c, "q", "cos");
    check_same_device(like, s, "q", "sin");
    a.cos = c.data_ptr<float>();
    a.sin = s.data_ptr<float>();
    a.cb = c.stride(0);
    a.ct = c.stride(1);
    a.sb = s.stride(0);
    a.st = s.stride(1);
  }
  const int64_t S = kv.size(3);
  a.slots = slots.data_ptr<int64_t>();
  a.slots_sb = slots.stride(0);
  a.slots_st = slots.stride(1);
  for (int64_t b = 0; b < a.B; ++b) {
    for (int64_t t = 0; t < a.T; ++t) {
      const int64_t s = a.slots[b * a.slots_sb + t * a.slots_st];
      OSD_CHECK(s >= 0 && s < S, "slots[", b, ", ", t, "] = ", s, " is outside the cache's ", S,
                " slots");
    }
  }
  a.kv = kv.data_ptr();
  a.half_kv = kv.scalar_type() == at::kHalf;
  a.kv_s0 = kv.stride(0);
  a.kv_sb = kv.stride(1);
  a.kv_sh = kv.stride(2);
  a.kv_ss = kv.stride(3);
  at::Tensor out = at::empty({a.B, a.T, a.Hq, a.D}, like.options());
  a.out = out.data_ptr<float>();
  const int64_t n = a.B * a.T;
  if (n == 0 || a.D == 0) return out;
#if defined(__x86_64__)
  const bool hw = use_avx2_fma();
#else
  const bool hw = false;
#endif
  // Each token writes its own slots (distinct within a row), so tokens split freely.
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
#if defined(__x86_64__)
    if (hw) {
      rope_kv_avx2(a, begin, end);
      return;
    }
#endif
    rope_kv_portable(a, begin, end);
  });
  return out;
}

void check_heads(const at::Tensor& t, const char* name) {
  check_dtype(t, at::kFloat, name);
  OSD_CHECK(t.stride(3) == 1 || t.size(3) <= 1, name,
            " must have a contiguous last dim, got strides ", t.strides());
}

at::Tensor rope_kv_write_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const std::optional<at::Tensor>& cos,
                             const std::optional<at::Tensor>& sin, at::Tensor kv,
                             const at::Tensor& slots) {
  OSD_CHECK(q.device().is_cpu(), "rope_kv_write CPU kernel got a ", q.device(), " tensor");
  OSD_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes() && q.size(0) == k.size(0) &&
                q.size(1) == k.size(1) && q.size(3) == k.size(3),
            "q must be [B, T, Hq, D] and k, v [B, T, Hkv, D], got ", q.sizes(), ", ", k.sizes(),
            ", ", v.sizes());
  check_heads(q, "q");
  check_heads(k, "k");
  check_heads(v, "v");
  check_same_device(q, k, "q", "k");
  check_same_device(q, v, "q", "v");
  RopeArgs a;
  a.q = heads_of(q);
  a.k = heads_of(k);
  a.v = heads_of(v);
  a.B = q.size(0);
  a.T = q.size(1);
  a.Hq = q.size(2);
  a.Hkv = k.size(2);
  a.D = q.size(3);
  return rope_kv_run(a, q, cos, sin, kv, slots);
}

// rope_kv_write on the qkv projection: qkv [B, T, (Hq + 2 Hkv) D] or, with B * T rows in
// the order (b, t), [B * T, (Hq + 2 Hkv) D]; B and T are those of slots, Hkv and D those of
// kv. The queries are its first Hq heads, then the keys, then the values.
at::Tensor rope_kv_write_qkv_cpu(const at::Tensor& qkv, int64_t num_heads,
                                 const std::optional<at::Tensor>& cos,
                                 const std::optional<at::Tensor>& sin, at::Tensor kv,
                                 const at::Tensor& slots) {
  OSD_CHECK(qkv.device().is_cpu(), "rope_kv_write_qkv CPU kernel got a ", qkv.device(),
            " tensor");
  check_dtype(qkv, at::kFloat, "qkv");
  OSD_CHECK(kv.dim() == 5 && slots.dim() == 2, "kv must be [2, B_max, Hkv, S, D] and slots ",
            "[B, T], got ", kv.sizes(), ", ", slots.sizes());
  RopeArgs a;
  a.B = slots.size(0);
  a.T = slots.size(1);
  a.Hq = num_heads;
  a.Hkv = kv.size(2);
  a.D = kv.size(4);
  const int64_t width = (a.Hq + 2 * a.Hkv) * a.D;
  const bool rows = qkv.dim() == 2 && qkv.size(0) == a.B * a.T;
  OSD_CHECK(num_heads > 0 && (rows || (qkv.dim() == 3 && qkv.size(0) == a.B &&
                                       qkv.size(1) == a.T)) &&
                qkv.size(-1) == width && (qkv.stride(-1) == 1 || width <= 1),
            "qkv must be [B=", a.B, ", T=", a.T, ", (Hq + 2 Hkv) D=", width, "] or [B * T, ",
            width, "] with a contiguous last dim (Hq=", num_heads, "), got ", qkv.sizes(),
            " strides ", qkv.strides());
  const int64_t st = qkv.stride(-2);
  const int64_t sb = rows ? st * a.T : qkv.stride(0);
  const float* p = qkv.data_ptr<float>();
  a.q = {p, sb, st, a.D};
  a.k = {p + a.Hq * a.D, sb, st, a.D};
  a.v = {p + (a.Hq + a.Hkv) * a.D, sb, st, a.D};
  return rope_kv_run(a, qkv, cos, sin, kv, slots);
}

// ---------------------------------------------------------------------------------------
// silu_mul

OSD_INLINE float silu_scalar(float x) { return x / (1.0f + std::exp(-x)); }

void silu_mul_row_portable(const float* g, const float* u, float* o, int64_t I) {
  for (int64_t i = 0; i < I; ++i) o[i] = silu_scalar(g[i]) * u[i];
}

#if defined(__x86_64__)
OSD_AVX512 void silu_mul_row_avx512(const float* g, const float* u, float* o, int64_t I) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 sign = _mm512_set1_ps(-0.0f);
  int64_t i = 0;
  const int64_t vec_end = I / 32 * 32;  // ATen's vector loop covers blocks of two vectors
  for (; i < vec_end; i += 16) {
    const __m512 x = _mm512_loadu_ps(g + i);
    const __m512 e = Sleef_expf16_u10avx512f(_mm512_xor_ps(x, sign));
    const __m512 s = _mm512_div_ps(x, _mm512_add_ps(one, e));
    _mm512_storeu_ps(o + i, _mm512_mul_ps(s, _mm512_loadu_ps(u + i)));
  }
  for (; i < I; ++i) o[i] = silu_scalar(g[i]) * u[i];
}

OSD_AVX2 void silu_mul_row_avx2(const float* g, const float* u, float* o, int64_t I) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  int64_t i = 0;
  const int64_t vec_end = I / 16 * 16;  // ATen's vector loop covers blocks of two vectors
  for (; i < vec_end; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    const __m256 e = Sleef_expf8_u10avx2(_mm256_xor_ps(x, sign));
    const __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, e));
    _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
  }
  for (; i < I; ++i) o[i] = silu_scalar(g[i]) * u[i];
}
#endif

at::Tensor silu_mul_cpu(const at::Tensor& gate_up) {
  OSD_CHECK(gate_up.device().is_cpu(), "silu_mul CPU kernel got a ", gate_up.device(),
            " tensor");
  check_dtype(gate_up, at::kFloat, "gate_up");
  OSD_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0, "gate_up must be [..., 2 I], got ",
            gate_up.sizes());
  const int64_t I = gate_up.size(-1) / 2;
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() = I;
  at::Tensor out = at::empty(shape, gate_up.options());
  const int64_t M = I == 0 ? 0 : gate_up.numel() / (2 * I);
  if (M == 0) return out;
  const at::Tensor rows = as_rows(gate_up);
  const int64_t ld = rows.stride(0);
  const float* g = rows.data_ptr<float>();
  float* o = out.data_ptr<float>();
#if defined(__x86_64__)
  const int isa = use_avx512() ? 2 : (use_avx2_fma() ? 1 : 0);
#else
  const int isa = 0;
#endif
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / I), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* gr = g + m * ld;
#if defined(__x86_64__)
      if (isa == 2) {
        silu_mul_row_avx512(gr, gr + I, o + m * I, I);
        continue;
      }
      if (isa == 1) {
        silu_mul_row_avx2(gr, gr + I, o + m * I, I);
        continue;
      }
#endif
      silu_mul_row_portable(gr, gr + I, o + m * I, I);
    }
  });
  return out;
}

}  // namespace
}  // namespace osd

TORCH_LIBRARY_IMPL(osd, CPU, m) {
  m.impl("add_rms_norm", &osd::add_rms_norm_cpu);
  m.impl("rope_kv_write", &osd::rope_kv_write_cpu);
  m.impl("rope_kv_write_qkv", &osd::rope_kv_write_qkv_cpu);
  m.impl("silu_mul", &osd::silu_mul_cpu);
}
