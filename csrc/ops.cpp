// The one registration file of the osd op library: every schema, one purpose line each.
// Implementations register per dispatch key: csrc/cpu/<op>.cpp (CPU), csrc/cuda/<op>.cpp
// (CUDA, built only when torch has CUDA); the fake (meta) ones are in osd_kernels/<op>.py.
// Mutated arguments are marked (Tensor(a!)) so torch.compile and CUDA graphs see them.
#include <torch/library.h>

TORCH_LIBRARY(osd, m) {
  // Chain speculative-sampling verification: accepted drafts + one recovered/bonus token.
  m.def(
      "rejection_sample(Tensor target_logits, Tensor draft_token_ids, Tensor? draft_probs, "
      "Tensor num_draft_tokens, Tensor temperature, Tensor top_k, Tensor top_p, Tensor seed, "
      "Tensor offset) -> (Tensor, Tensor)");

  // Token-tree verification: accepted path (node indices), its tokens + one emitted token.
  m.def(
      "tree_rejection_sample(Tensor target_logits, Tensor node_token_ids, Tensor parents, "
      "Tensor? draft_probs, Tensor temperature, Tensor top_k, Tensor top_p, Tensor seed, "
      "Tensor offset, int max_depth, bool without_replacement) -> (Tensor, Tensor, Tensor)");

  // Compact accepted tree slots of every layer's K/V in place and advance the lengths.
  m.def(
      "kv_rollback(Tensor(a!) kv_cache, Tensor(b!) cache_lens, Tensor accepted_slots, "
      "Tensor num_keep) -> ()");

  // Attention of T new queries per row over the cached prefix plus a bitmasked tree (T <= 64)
  // or, without a mask, causally over the new keys (any T).
  m.def(
      "tree_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_lens, "
      "Tensor? tree_mask, float scale) -> Tensor");

  // y = x W^T + b for a few rows (decode and verify); x [M, K], weight [N, K] or packed into
  // panels [N / 16, K, 16] (CPU), bias [N].
  // With norm_weight [K], x is first RMS-normalised: norm_weight * x / sqrt(mean(x^2) + eps).
  m.def("decode_linear(Tensor x, Tensor weight, Tensor? bias, Tensor? norm_weight=None, "
        "float eps=1e-6) -> Tensor");

  // decode_linear with W block-quantized: W[n, k] = q * scales[n, k / 32] + mins[n, k / 32],
  // codes in qweight (uint8 [N, K / 2]: 4-bit, GGUF nibble order; int8 [N, K]: 8-bit); or,
  // with ggml_type != 0, qweight holds GGUF blocks of that type as stored (uint8 [N, bytes a
  // row]; scales and mins unused).
  m.def("quant_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, Tensor? bias, "
        "Tensor? norm_weight=None, float eps=1e-6, int ggml_type=0) -> Tensor");

  // Distillation loss per row (fkl/rkl/jsd/tvd) and its gradient w.r.t. the draft logits.
  m.def(
      "distill_loss_fwd_bwd(Tensor draft_logits, Tensor? target_logits, Tensor? topk_ids, "
      "Tensor? topk_probs, Tensor? mask, str loss, float beta) -> (Tensor, Tensor)");

  // Philox uniforms u(seed[b], offset[b], stream, i) for i < num: [B, num] float32.
  m.def("philox_uniform(Tensor seed, Tensor offset, int stream, int num) -> Tensor");

  // Fused decode-layer glue (osd/models/fused_layers.py; CPU: cpu/fused_layer_ops.cpp).
  // h = residual + scale * x and y = rms_norm(h) * weight: returns (h, y).
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, float scale) "
        "-> (Tensor, Tensor)");
  // RoPE on q and k, k and v written into one layer's cache at [row, slots[b, t]]; returns
  // the rotated q. The _qkv form reads q, k and v from the qkv projection [B(*)T, ...].
  m.def("rope_kv_write(Tensor q, Tensor k, Tensor v, Tensor? cos, Tensor? sin, "
        "Tensor(a!) kv, Tensor slots) -> Tensor");
  m.def("rope_kv_write_qkv(Tensor qkv, int num_heads, Tensor? cos, Tensor? sin, "
        "Tensor(a!) kv, Tensor slots) -> Tensor");
  // silu(gate) * up of gate_up = [gate, up] along the last dim.
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  // The k most probable tokens of softmax(logits) per row: (ids int64, probabilities)
  // [..., min(k, V)], most probable first (online learning's teacher rows; CPU:
  // cpu/topk_probs.cpp).
  m.def("topk_probs(Tensor logits, int k) -> (Tensor, Tensor)");
  // Per row of logits [..., V]: the first index of its largest value (int64) and whether
  // it holds a NaN or an infinity (bool), both [...] (the greedy sampler and the check of
  // the target's logits; CPU: cpu/argmax_finite.cpp).
  m.def("argmax_finite(Tensor logits) -> (Tensor, Tensor)");
  // A stack of dense gated decoder layers of a cached CPU forward, the ops above looped in
  // C++ (flat per-layer arguments: osd_kernels/decoder_layers.py).
  m.def(
      "decoder_layers(Tensor x, Tensor?[] tensors, int[] ints, float[] floats, Tensor(a!) kv, "
      "Tensor cache_lens, Tensor? tree_mask, Tensor slots, Tensor?[] rope, float scale, "
      "int max_kv_len=0) -> Tensor");
}
