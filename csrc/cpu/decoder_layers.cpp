// decoder_layers: a stack of dense gated decoder layers of a cached CPU forward of few rows,
// looped in C++ (osd/models/fused_layers.py builds the arguments once per model).
//
// Each layer is the fused CPU layer of fused_layers._cpu_layers, op for op: the qkv
// projection (the first layer's input norm fused in; later layers' add_rms_norm of the
// pending MLP output), rope_kv_write_qkv, tree_attention, the output projection and
// add_rms_norm, the gate-up projection, silu_mul and the down projection, whose output
// stays pending until the next layer's add_rms_norm (after the last layer, a plain add).
// Gemma's layers add a norm after attention (on the output projection, before its add) and
// after the MLP (on the down projection), the MLP's own pre-norm in the add_rms_norm, a
// GeGLU (gelu-tanh(gate) * up, the unfused ops) in place of silu_mul, and sliding windows:
// where the call reaches past a layer's window (max_kv_len > window), each query attends
// over its window's slice of the cache in a call of its own, as a decode step at its
// position does (the Python loop's osd.models.attention.windowed_rows).
// The ops are the registered CPU kernels, called through the dispatcher below autograd
// (the forward runs outside it), so the results are the Python loop's bit for bit; what
// this saves is the loop's interpreter time and each op call's Python argument parsing,
// about ten calls a layer.
//
// Arguments, per layer l (a flat list each, so one call carries a whole model):
//   tensors[22 l + 0, 1]: the input and post-attention norm weights [H];
//   tensors[22 l + 2, 3]: the per-head q and k norm weights [D] (None without them);
//   tensors[22 l + 4 + 4 p .. + 3]: projection p (qkv, o, gate-up, down): weight (float32
//     [N, K] or decode_linear's packed panels, or quant_linear's qweight), scales, mins,
//     bias (None where absent);
//   tensors[22 l + 20, 21]: the pre- and post-feedforward norm weights [H] of a layer with
//     norms after attention and the MLP (Gemma: tensors[1] is then the norm after
//     attention), None for a pre-norm layer;
//   ints[10 l + 0 .. 9]: the layer's KV-cache index, query heads, RoPE table (-1 none, 0 or
//     1: rope[2 t], rope[2 t + 1] are its cos, sin), per-head q/k norms (0 none, 1 an
//     RMSNorm over each head's D values, before RoPE: Qwen3, Gemma 3), per projection -1
//     for decode_linear or quant_linear's ggml_type (>= 0), the sliding window (0 none),
//     the gate's activation (0 SiLU, 1 gelu-tanh);
//   floats[6 l + 0 .. 5]: the input norm's eps, the post-attention norm's eps, the
//     layer's residual multiplier, the q/k norms' eps, the pre- and post-feedforward
//     norms' eps.
// x: [B T, H] rows in (b, t) order; kv: the cache [L, 2, B_max, Hkv, S, D], written at
// slots [B, T] of each layer; cache_lens, tree_mask and scale as tree_attention takes
// them; max_kv_len: the caller's upper bound of max(cache_lens[:B]) + T (0: computed here
// exactly), which decides where windows apply. A windowed layer past its window takes no
// tree mask. Returns the last layer's output [B T, H] (before the final norm).
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/add.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/rms_norm.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>
#include <algorithm>
#include <optional>
#include <tuple>
#include <vector>

#include "checks.h"

namespace osd {
namespace {

using OptTensor = std::optional<at::Tensor>;

// The registered ops, looked up once; the signatures are those their CPU kernels
// register (the dispatcher checks them).
struct Ops {
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&,
                                      const OptTensor&, double)>
      decode_linear;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const OptTensor&, const OptTensor&, const OptTensor&,
                                      double, int64_t)>
      quant_linear;
  c10::TypedOperatorHandle<std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, double, double)>
      add_rms_norm;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, int64_t, const OptTensor&,
                                      const OptTensor&, at::Tensor, const at::Tensor&)>
      rope_kv_write_qkv;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const OptTensor&, const OptTensor&, at::Tensor,
                                      const at::Tensor&)>
      rope_kv_write;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&, const OptTensor&, double)>
      tree_attention;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&)> silu_mul;

  static const Ops& get() {
    static const Ops ops = [] {
      auto& d = c10::Dispatcher::singleton();
      auto find = [&](const char* name) { return d.findSchemaOrThrow(name, ""); };
      return Ops{
          find("osd::decode_linear")
              .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&,
                                const OptTensor&, double)>(),
          find("osd::quant_linear")
              .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const OptTensor&, const OptTensor&, const OptTensor&, double,
                                int64_t)>(),
          find("osd::add_rms_norm")
              .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                        const at::Tensor&, double, double)>(),
          find("osd::rope_kv_write_qkv")
              .typed<at::Tensor(const at::Tensor&, int64_t, const OptTensor&, const OptTensor&,
                                at::Tensor, const at::Tensor&)>(),
          find("osd::rope_kv_write")
              .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const OptTensor&, const OptTensor&, at::Tensor,
                                const at::Tensor&)>(),
          find("osd::tree_attention")
              .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const OptTensor&, double)>(),
          find("osd::silu_mul").typed<at::Tensor(const at::Tensor&)>(),
      };
    }();
    return ops;
  }
};

constexpr int64_t kTensors = 22, kInts = 10, kFloats = 6;

at::Tensor required(const c10::List<OptTensor>& t, int64_t i, const char* what, int64_t layer) {
  const OptTensor v = t.get(i);
  OSD_CHECK(v.has_value() && v->defined(), "decoder_layers: layer ", layer, "'s ", what,
            " is None");
  return *v;
}

// projection p of layer l on rows x (norm: the RMSNorm fused in front, or none)
at::Tensor project(const Ops& ops, const c10::List<OptTensor>& t, at::IntArrayRef ints,
                   int64_t l, int p, const at::Tensor& x, const OptTensor& norm, double eps) {
  const int64_t base = kTensors * l + 4 + 4 * p;
  const at::Tensor w = required(t, base, "projection weight", l);
  const OptTensor bias = t.get(base + 3);
  const int64_t kind = ints[kInts * l + 4 + p];
  if (kind < 0) return ops.decode_linear.call(x, w, bias, norm, eps);
  const at::Tensor scales = required(t, base + 1, "projection scales", l);
  return ops.quant_linear.call(x, w, scales, t.get(base + 2), bias, norm, eps, kind);
}

// Causal sliding-window attention of q [B, T, Hq, D] over one layer's cache, one
// tree_attention call per query over its window's slice: query i of row b (position
// p = lens[b] + i) sees slots max(0, p - window + 1) .. p, as a decode step at p does.
at::Tensor windowed_rows(const Ops& ops, const at::Tensor& q, const at::Tensor& k,
                         const at::Tensor& v, const at::Tensor& cache_lens, int64_t window,
                         double scale) {
  const int64_t B = q.size(0), T = q.size(1);
  const at::Tensor lens = cache_lens.to(at::kLong);
  const int64_t* len = lens.data_ptr<int64_t>();
  std::vector<at::Tensor> outs;
  outs.reserve(B * T);
  for (int64_t b = 0; b < B; ++b) {
    const at::Tensor qb = q.narrow(0, b, 1), kb = k.narrow(0, b, 1), vb = v.narrow(0, b, 1);
    for (int64_t i = 0; i < T; ++i) {
      const int64_t p = len[b] + i, start = std::max<int64_t>(0, p - window + 1);
      at::Tensor one = at::empty({1}, at::TensorOptions().dtype(at::kInt));
      one.data_ptr<int32_t>()[0] = static_cast<int32_t>(p - start);
      outs.push_back(ops.tree_attention.call(qb.narrow(1, i, 1), kb.narrow(2, start, p - start + 1),
                                             vb.narrow(2, start, p - start + 1), one,
                                             std::nullopt, scale));
    }
  }
  if (outs.size() == 1) return outs[0];
  return at::cat(outs, 1).view(q.sizes());
}

at::Tensor decoder_layers_cpu(const at::Tensor& x, const c10::List<OptTensor>& tensors,
                              at::IntArrayRef ints, at::ArrayRef<double> floats,
                              const at::Tensor& kv, const at::Tensor& cache_lens,
                              const OptTensor& tree_mask, const at::Tensor& slots,
                              const c10::List<OptTensor>& rope, double scale,
                              int64_t max_kv_len) {
  const int64_t L = static_cast<int64_t>(ints.size()) / kInts;
  OSD_CHECK(static_cast<int64_t>(ints.size()) == kInts * L &&
                static_cast<int64_t>(tensors.size()) == kTensors * L &&
                static_cast<int64_t>(floats.size()) == kFloats * L,
            "decoder_layers takes ", kTensors, " tensors, ", kInts, " ints and ", kFloats,
            " floats a layer, got ", tensors.size(), ", ", ints.size(), " and ", floats.size());
  OSD_CHECK(x.dim() == 2 && slots.dim() == 2 && x.size(0) == slots.size(0) * slots.size(1),
            "decoder_layers: x must be [B T, H] rows for slots [B, T], got ", x.sizes(), " and ",
            slots.sizes());
  OSD_CHECK(kv.dim() == 6, "decoder_layers: kv must be the cache [L, 2, B_max, Hkv, S, D], got ",
            kv.sizes());
  const int64_t B = slots.size(0), T = slots.size(1);
  if (max_kv_len <= 0 && B > 0) max_kv_len = cache_lens.narrow(0, 0, B).max().item<int64_t>() + T;
  // below autograd: the forward runs outside it, and each inner call then goes straight to
  // its CPU kernel
  const c10::impl::ExcludeDispatchKeyGuard below(c10::autograd_dispatch_keyset_with_ADInplaceOrView);
  const Ops& ops = Ops::get();
  at::Tensor residual = x, pending;
  double multiplier = 1.0;
  for (int64_t l = 0; l < L; ++l) {
    const int64_t* in = ints.data() + kInts * l;
    const double* fl = floats.data() + kFloats * l;
    const at::Tensor in_norm = required(tensors, kTensors * l, "input norm weight", l);
    const at::Tensor post_norm = required(tensors, kTensors * l + 1, "post-attention norm", l);
    OSD_CHECK(in[0] >= 0 && in[0] < kv.size(0), "decoder_layers: layer ", l,
              "'s cache index ", in[0], " is outside the cache's ", kv.size(0), " layers");
    at::Tensor qkv;
    if (!pending.defined()) {
      qkv = project(ops, tensors, ints, l, 0, residual, in_norm, fl[0]);
    } else {
      at::Tensor normed;
      std::tie(residual, normed) = ops.add_rms_norm.call(pending, residual, in_norm, fl[0],
                                                         multiplier);
      qkv = project(ops, tensors, ints, l, 0, normed, std::nullopt, 1e-6);
    }
    const at::Tensor layer_kv = kv.select(0, in[0]);
    OptTensor cos, sin;
    if (in[2] >= 0) {
      OSD_CHECK(2 * in[2] + 1 < static_cast<int64_t>(rope.size()), "decoder_layers: layer ", l,
                " reads RoPE table ", in[2], " of ", rope.size() / 2);
      cos = rope.get(2 * in[2]);
      sin = rope.get(2 * in[2] + 1);
    }
    at::Tensor q;
    if (in[3] == 0) {
      q = ops.rope_kv_write_qkv.call(qkv, in[1], cos, sin, layer_kv, slots);
    } else {
      // the per-head norms as the layer's Python computes them (F.rms_norm over each
      // head's D values, queries then keys, concatenated), then RoPE and the K/V write
      OSD_CHECK(in[3] == 1, "decoder_layers: layer ", l, "'s q/k norm kind must be 0 or 1, got ",
                in[3]);
      const int64_t hq = in[1], hkv = kv.size(3), D = kv.size(5);
      const at::Tensor heads = qkv.view({B, T, hq + 2 * hkv, D});
      const at::Tensor qn = required(tensors, kTensors * l + 2, "q norm weight", l);
      const at::Tensor kn = required(tensors, kTensors * l + 3, "k norm weight", l);
      const at::Tensor qk =
          at::cat({at::rms_norm(heads.narrow(2, 0, hq), {D}, qn, fl[3]),
                   at::rms_norm(heads.narrow(2, hq, hkv), {D}, kn, fl[3])},
                  2);
      q = ops.rope_kv_write.call(qk.narrow(2, 0, hq), qk.narrow(2, hq, hkv),
                                 heads.narrow(2, hq + hkv, hkv), cos, sin, layer_kv, slots);
    }
    const int64_t window = in[8];
    at::Tensor out;
    if (window > 0 && max_kv_len > window) {
      OSD_CHECK(!tree_mask.has_value(), "decoder_layers: layer ", l, "'s window of ", window,
                " takes no tree mask past the window (max_kv_len ", max_kv_len, ")");
      out = windowed_rows(ops, q, layer_kv.select(0, 0), layer_kv.select(0, 1), cache_lens,
                          window, scale);
    } else {
      out = ops.tree_attention.call(q, layer_kv.select(0, 0), layer_kv.select(0, 1), cache_lens,
                                    tree_mask, scale);
    }
    multiplier = fl[2];
    at::Tensor o = project(ops, tensors, ints, l, 1, out.view({B * T, -1}), std::nullopt, 1e-6);
    const OptTensor pre_ffw = tensors.get(kTensors * l + 20);
    const bool sandwich = pre_ffw.has_value() && pre_ffw->defined();
    at::Tensor mlp_norm = post_norm;
    double mlp_eps = fl[1];
    if (sandwich) {  // Gemma: x + norm(attn), then the MLP's own pre-norm
      o = at::rms_norm(o, {o.size(1)}, post_norm, fl[1]);
      mlp_norm = *pre_ffw;
      mlp_eps = fl[4];
    }
    at::Tensor normed;
    std::tie(residual, normed) = ops.add_rms_norm.call(o, residual, mlp_norm, mlp_eps, multiplier);
    const at::Tensor gate_up = project(ops, tensors, ints, l, 2, normed, std::nullopt, 1e-6);
    at::Tensor gated;
    if (in[9] == 0) {
      gated = ops.silu_mul.call(gate_up);
    } else {
      OSD_CHECK(in[9] == 1, "decoder_layers: layer ", l, "'s activation must be 0 or 1, got ",
                in[9]);
      const auto halves = gate_up.chunk(2, -1);
      gated = at::mul(at::gelu(halves[0], "tanh"), halves[1]);
    }
    pending = project(ops, tensors, ints, l, 3, gated, std::nullopt, 1e-6);
    if (sandwich) {
      const at::Tensor post_ffw = required(tensors, kTensors * l + 21, "post-feedforward norm", l);
      pending = at::rms_norm(pending, {pending.size(1)}, post_ffw, fl[5]);
    }
  }
  if (!pending.defined()) return residual;
  return multiplier == 1.0 ? at::add(residual, pending)
                           : at::add(residual, at::mul(pending, multiplier));
}

}  // namespace
}  // namespace osd

TORCH_LIBRARY_IMPL(osd, CPU, m) { m.impl("decoder_layers", &osd::decoder_layers_cpu); }
