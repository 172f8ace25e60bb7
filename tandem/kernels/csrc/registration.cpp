// Every op's schema, in one place: torch.ops.tandem.<name>. `isa` = -1 picks the best body this CPU runs
// (capped by TANDEM_ISA); 0 scalar, 1 AVX2, 2 AVX-512 force one (capped by what the CPU has), for tests;
// gemm_rows_q8act also takes 3, its AMX body where the CPU has AMX-INT8 (else its AVX-512 one).
//
// The quantized linears are named by what they do: shape, weight layout, then _q8act where x is rounded to int8.
//   op                  shape                    weights                        x
//   linear_rows         any rows of x (M)        rows: GGUF blocks, a row per   fp32
//                                                output (QuantWeight.data)
//   linear_rows_q8act   any M (GEMV bodies,      rows                           int8 halves of 16 (the decode
//                       then tiles)                                             default, kernels_act="int8")
//   gemv_rows_q8act     few M (GEMV)             rows                           int8, the GEMM's bits
//   gemm_rows_q8act     many M (GEMM)            rows                           int8
//   gemv_packed_q8act   GEMV (any M on AVX2)     packed at load (pack_gemv)     int8, the GEMM's bits
// Helpers: <op>_max_rows, the rows of x up to which that GEMV runs here (0: not this type or CPU);
// gemm_rows_q8act_body, the GEMM's body here; gemv_packed_k_q8act (C++ only), the packed GEMV's K-quant half;
// int8_peak, the int8 multiply-adds per second the CPU's own instructions reach (the tiles' yardstick).
#include <torch/library.h>

#include "ops.h"
#include "vec.h"

namespace tandem {
static int64_t isa_op(int64_t requested) { return resolve_isa(requested); }
}  // namespace tandem

TORCH_LIBRARY(tandem, m) {
  m.def("linear_rows(Tensor x, Tensor w, int qtype, int k, Tensor? bias=None, int isa=-1) -> Tensor");
  m.def("linear_rows_q8act(Tensor x, Tensor w, int qtype, int k, Tensor? bias=None, int isa=-1) -> Tensor");
  m.def("gemm_rows_q8act(Tensor x, Tensor w, int qtype, int k, Tensor? bias=None, int isa=-1) -> Tensor");
  m.def("gemv_rows_q8act(Tensor x, Tensor w, int qtype, int k, Tensor? bias=None, int isa=-1) -> Tensor");
  m.def("gemv_rows_q8act_max_rows(int qtype) -> int", &tandem::gemv_rows_q8act_max_rows);
  m.def("pack_gemv(Tensor w, int qtype, int k) -> Tensor");
  m.def("gemv_packed_q8act(Tensor x, Tensor packed, int qtype, int k, int n, Tensor? bias=None, int isa=-1) -> Tensor");
  m.def("gemv_packed_q8act_max_rows(int qtype) -> int", &tandem::gemv_packed_q8act_max_rows);
  m.def("packed_gather(Tensor packed, int qtype, int k, int n, Tensor index, int isa=-1) -> Tensor");
  m.def("gemm_rows_q8act_body(int qtype, int isa=-1) -> int", &tandem::gemm_rows_q8act_body);
  m.def("int8_peak(int iters, int isa=-1) -> float", &tandem::int8_peak);
  m.def("dequantize(Tensor w, int qtype, int k, int isa=-1) -> Tensor");
  m.def("dequantize_out(Tensor w, int qtype, int k, Tensor(a!) out, int isa=-1) -> ()");
  m.def("decode_attention(Tensor q, Tensor cache, int layer, Tensor kv_index, Tensor seq_lens, float scale, "
        "int isa=-1, int chunk_keys=-1, int window=0, bool bf16_products=False, Tensor? sinks=None) -> Tensor");
  m.def("decode_attention_qkv_(Tensor qkv, Tensor(a!) cache, int layer, Tensor out_cache_loc, Tensor kv_index, "
        "Tensor seq_lens, float scale, int heads, int isa=-1, int chunk_keys=-1, int window=0, "
        "bool bf16_products=False, Tensor? sinks=None) -> Tensor");
  m.def("extend_attention(Tensor q, Tensor cache, int layer, Tensor kv_index, Tensor tok_row, Tensor positions, "
        "float scale, int window=0, int isa=-1, bool bf16_products=False, Tensor? sinks=None) -> Tensor");
  m.def("causal_attention(Tensor q, Tensor cache, int layer, Tensor kv_index, Tensor tok_row, Tensor positions, "
        "float scale, int window=0, int isa=-1, bool bf16_products=False, Tensor? sinks=None) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) x, Tensor delta, Tensor w, float eps) -> Tensor");
  m.def("silu_mul(Tensor gu, int isa=-1) -> Tensor");
  m.def("gelu_tanh_mul(Tensor gu, int isa=-1) -> Tensor");
  m.def("head_rms_norm_(Tensor(a!) qkv, Tensor w, float eps) -> ()");
  m.def("rope_(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor positions, int heads, int head_dim) -> ()");
  m.def("race_argmax(Tensor x, Tensor? t=None, Tensor? seeds=None, int isa=-1) -> Tensor");
  m.def("race_noise(Tensor seeds, int vocab, int isa=-1) -> Tensor");
  m.def("gated_delta_rule_(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) state, Tensor slots, "
        "Tensor starts, Tensor fresh, int isa=-1) -> Tensor");
  m.def("gated_delta_rule_chunked_(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) state, "
        "Tensor slots, Tensor starts, Tensor fresh, int chunk, int isa=-1) -> Tensor");
  m.def("decode_layer_(Tensor(a!) x, Tensor? delta, Tensor attn_norm, Tensor mlp_norm, float eps, Tensor[] w, "
        "int[] qtypes, Tensor[] packed, Tensor? qkv_bias, bool int8, Tensor cos, Tensor sin, Tensor positions, int heads, "
        "int kv_heads, int head_dim, Tensor(b!) cache, int layer, Tensor out_cache_loc, Tensor kv_index, "
        "Tensor seq_lens, float scale, bool bf16_products=False, Tensor? qk_norm=None, bool mlp=True) -> Tensor");
  m.def("moe_route(Tensor x, Tensor router_t, int experts, int top_k, bool renormalize, int isa=-1) -> "
        "(Tensor, Tensor)");
  m.def("moe_experts(Tensor x, Tensor gate_up, int gu_qtype, Tensor down, int down_qtype, int inter, Tensor ids, "
        "Tensor weights, int act, int isa=-1) -> Tensor");
  m.def("isa(int requested=-1) -> int", &tandem::isa_op);
  m.def("shared_prefix_attention(int on=-1) -> int", &tandem::shared_prefix_attention);
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("linear_rows", &tandem::linear_rows);
  m.impl("linear_rows_q8act", &tandem::linear_rows_q8act);
  m.impl("gemm_rows_q8act", &tandem::gemm_rows_q8act);
  m.impl("gemv_rows_q8act", &tandem::gemv_rows_q8act);
  m.impl("pack_gemv", &tandem::pack_gemv);
  m.impl("gemv_packed_q8act", &tandem::gemv_packed_q8act);
  m.impl("packed_gather", &tandem::packed_gather);
  m.impl("dequantize", &tandem::dequantize);
  m.impl("dequantize_out", &tandem::dequantize_out);
  m.impl("decode_attention", &tandem::decode_attention);
  m.impl("decode_attention_qkv_", &tandem::decode_attention_qkv_);
  m.impl("extend_attention", &tandem::extend_attention);
  m.impl("causal_attention", &tandem::causal_attention);
  m.impl("rms_norm", &tandem::rms_norm);
  m.impl("add_rms_norm_", &tandem::add_rms_norm_);
  m.impl("silu_mul", &tandem::silu_mul);
  m.impl("gelu_tanh_mul", &tandem::gelu_tanh_mul);
  m.impl("head_rms_norm_", &tandem::head_rms_norm_);
  m.impl("rope_", &tandem::rope_);
  m.impl("race_argmax", &tandem::race_argmax);
  m.impl("race_noise", &tandem::race_noise);
  m.impl("gated_delta_rule_", &tandem::gated_delta_rule_);
  m.impl("gated_delta_rule_chunked_", &tandem::gated_delta_rule_chunked_);
  m.impl("decode_layer_", &tandem::decode_layer_);
  m.impl("moe_route", &tandem::moe_route);
  m.impl("moe_experts", &tandem::moe_experts);
}
