// The C++ entry points of every op (each .cpp defines its own), for registration.cpp, which gives them
// their schemas, and for ops made of other ops (decode_layer.cpp).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <vector>

#include "steal.h"

namespace tandem {
// An index tensor as contiguous int64 (the attention ops' kv_index, seq_lens, ...): no dispatch when it already is
// (the engine's case).
inline at::Tensor as_long(const at::Tensor& t) {
  return t.scalar_type() == at::kLong && t.is_contiguous() ? t : t.to(at::kLong).contiguous();
}
// An op's fp32 [rows, features] input whose rows are contiguous (the row ops: norms, RoPE).
inline void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kFloat && t.stride(1) == 1,
              "tandem: ", name, " must be fp32 [rows, features] with contiguous rows");
}
// A linear's tensors as its bodies read them (linear_rows, linear_rows_q8act, gemm_rows_q8act, gemv_rows_q8act,
// gemv_packed_q8act): x and the bias contiguous (bias undefined: none), y = fp32 [M, N] for the output, not yet
// written.
struct LinearIo {
  at::Tensor x, bias, y;
};
inline LinearIo linear_io(const at::Tensor& x, const std::optional<at::Tensor>& bias, int64_t N) {
  LinearIo io{x.contiguous(), bias.has_value() ? bias->contiguous() : at::Tensor(), at::Tensor()};
  io.y = at::empty({io.x.size(0), N}, io.x.options());
  return io;
}
at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t K,
                       const std::optional<at::Tensor>& bias, int64_t isa);
at::Tensor linear_rows_q8act(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t K,
                             const std::optional<at::Tensor>& bias, int64_t isa);
at::Tensor gemm_rows_q8act(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t K,
                           const std::optional<at::Tensor>& bias, int64_t isa);
at::Tensor gemv_rows_q8act(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t K,
                           const std::optional<at::Tensor>& bias, int64_t isa);
// Rows up to which linear_rows_q8act runs gemv_rows_q8act for this type (past them gemm_rows_q8act, the same bits); 0:
// its own bodies (other types, or a CPU without AVX2). _isa: for an ISA request as linear_rows_q8act's.
int64_t gemv_rows_q8act_max_rows(int64_t qtype);
int64_t gemv_rows_q8act_max_rows_isa(int64_t qtype, int64_t isa);
// The int8 GEMV on weights repacked at load: the layout (pack_gemv.cpp), the op (gemv_packed_q8act.cpp), and the
// rows of x up to which a model runs it where it holds the packed copy (0: not this type or CPU).
at::Tensor pack_gemv(const at::Tensor& w, int64_t qtype, int64_t K);
at::Tensor gemv_packed_q8act(const at::Tensor& x, const at::Tensor& packed, int64_t qtype, int64_t K, int64_t N,
                             const std::optional<at::Tensor>& bias, int64_t isa);
int64_t gemv_packed_q8act_max_rows(int64_t qtype);
// Rows `index` of an N-row weight out of its packed copy, fp32 [len(index), K]: dequantize's values on the row
// layout (packed_gather.cpp), for a tied embedding's lookup in the LM head's copy.
at::Tensor packed_gather(const at::Tensor& packed, int64_t qtype, int64_t K, int64_t N, const at::Tensor& index,
                         int64_t isa);
// Rows of x rounded to int8 halves (quantize_act_row) for the packed GEMVs, in thread-local buffers:
// q [M][K], dx / sxh [M][K / 16], off [M][K / 16] = unit * sum of the half's quants.
struct PackedX { const int8_t* q; const float *dx, *sxh; const int32_t* off; };
PackedX quantize_packed_x(const at::Tensor& x, int32_t unit);
// Q4_K / Q5_K / Q6_K's rows of x (the K8 contract, k8_spec.cpp): int8 per 256-element super-block as llama.cpp's Q8_K,
// d = max |x| / 127 of the super-block, q = nearbyint(x / d); bs [M][K / 256][16] the super-block's sums of quants:
// per16 (Q6_K) its 16 halves', else its 8 sub-blocks' of 32 (entries 8-15 zero). In thread-local buffers.
struct K8X { const int8_t* q; const float* d; const int16_t* bs; int64_t K, ns; };
K8X quantize_k8_x(const at::Tensor& x, bool per16);
constexpr bool k8_type(int64_t qtype) { return qtype == 12 || qtype == 13 || qtype == 14; }   // Q4_K, Q5_K, Q6_K
// A Q6_K super-block (the GGUF's 210 bytes) as its 256 values q + 32 in element order (gemv_packed_k_q8act.cpp).
void q6k_values(const uint8_t* blk, uint8_t* v);
// The K8 contract's specification on the row layout (k8_spec.cpp): what every body of the three types computes.
at::Tensor k8_rows_spec(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t K,
                        const std::optional<at::Tensor>& bias);
// Its K-quant bodies (gemv_packed_k_q8act.cpp: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K); body 2 AVX-512 VNNI, 1 AVX2.
bool packable_k(int64_t qtype);
at::Tensor pack_gemv_k(const at::Tensor& w, int64_t qtype, int64_t K);
at::Tensor gemv_packed_k_q8act(const at::Tensor& x, const at::Tensor& packed, int64_t qtype, int64_t K, int64_t N,
                               const at::Tensor& bias, at::Tensor y, int body);
// Several packed GEMVs of one type in one thread split (an MoE row's chosen experts, moe_experts.cpp): job j
// multiplies row j / rep of x (fp32 [J / rep, K]) by stacked[ids[j]] (stacked: pack_gemv's copies of E [N, K]
// weights, uint8 [E, groups, bytes]) into row j of y (fp32 [J, N]). Each output is the tile gemv_packed_q8act
// computes for that row and weight alone (the same x rounding, the same groups), so the same bits; one parallel
// region for all the jobs instead of one a job.
void gemv_packed_q8act_jobs(const at::Tensor& x, const at::Tensor& stacked, const std::vector<int64_t>& ids,
                            int64_t rep, int64_t qtype, int64_t K, int64_t N, float* y, int64_t isa);
void gemv_packed_k_q8act_jobs(const at::Tensor& x, const at::Tensor& stacked, const std::vector<int64_t>& ids,
                              int64_t rep, int64_t qtype, int64_t K, int64_t N, float* y, int body);
// Their check of the stacked copies ([E, NG, gbytes]) and the ids (each in [0, E)); returns the first copy.
inline const uint8_t* stacked_copies(const at::Tensor& stacked, const std::vector<int64_t>& ids, int64_t NG,
                                     int64_t gbytes, int64_t N) {
  TORCH_CHECK(stacked.dim() == 3 && stacked.scalar_type() == at::kByte && stacked.is_contiguous() &&
              stacked.size(1) == NG && stacked.size(2) == gbytes, "tandem.gemv_packed_q8act: stacked must be pack_gemv's "
              "copies, uint8 [E, ", NG, ", ", gbytes, "] for N = ", N);
  for (const int64_t e : ids)
    TORCH_CHECK(e >= 0 && e < stacked.size(0), "tandem.gemv_packed_q8act: expert id ", e, " out of [0, ",
                stacked.size(0), ")");
  return stacked.data_ptr<uint8_t>();
}
// Their thread split: J jobs of NG groups each, in chunks of `per` groups; fn(j, g0, g1) for each job's part of
// a piece of the chunks (stealing_for: a thread walks its contiguous share, whole jobs one after another, then
// takes chunks from the back of another's).
template <class F>
void split_jobs(int64_t J, int64_t NG, int64_t per, const F& fn) {
  const int64_t cpj = (NG + per - 1) / per;                     // chunks a job
  stealing_for(J * cpj, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1;) {
      const int64_t j = c / cpj, end = std::min(c1, (j + 1) * cpj);
      fn(j, per * (c - j * cpj), std::min(per * (end - j * cpj), NG));
      c = end;
    }
  });
}
// The SIMD body gemm_rows_q8act runs for a type here: 2 AVX-512 VNNI, 1 AVX2, 0 none (the scalar specification).
int64_t gemm_rows_q8act_body(int64_t qtype, int64_t isa);
// The int8 multiply-adds per second of the body `isa` picks over every thread (int8_peak.cpp), for the benchmarks.
double int8_peak(int64_t iters, int64_t isa);
// The int8 ops' argument checks (a supported type, K whole blocks, shapes, dtypes, bias [N]): TORCH_CHECKs
// naming `op`.
void check_int8_args(const char* op, const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t K,
                     const std::optional<at::Tensor>& bias);
// A row of x rounded to int8 halves of 16 in natural order (linear_rows_q8act's rounding, shared by gemm_rows_q8act):
// q [K], dx / sxh [2 K / 32] per half, sx [K / 32] per block.
void quantize_act_row(const float* x, int64_t K, int8_t* q, float* dx, float* sx, float* sxh);
at::Tensor dequantize(const at::Tensor& w, int64_t qtype, int64_t K, int64_t isa);
void dequantize_out(const at::Tensor& w, int64_t qtype, int64_t K, const at::Tensor& out, int64_t isa);
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& cache, int64_t layer, const at::Tensor& kv_index,
                            const at::Tensor& seq_lens, double scale, int64_t isa, int64_t chunk_keys,
                            int64_t window, bool bf16_products, const std::optional<at::Tensor>& sinks);
int64_t shared_prefix_attention(int64_t on);
at::Tensor extend_attention(const at::Tensor& q, const at::Tensor& cache, int64_t layer, const at::Tensor& kv_index,
                            const at::Tensor& tok_row, const at::Tensor& positions, double scale, int64_t window,
                            int64_t isa, bool bf16_products, const std::optional<at::Tensor>& sinks);
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& cache, int64_t layer, const at::Tensor& kv_index,
                            const at::Tensor& tok_row, const at::Tensor& positions, double scale, int64_t window,
                            int64_t isa, bool bf16_products, const std::optional<at::Tensor>& sinks);
at::Tensor decode_attention_qkv_(const at::Tensor& qkv, const at::Tensor& cache, int64_t layer, const at::Tensor& loc,
                                 const at::Tensor& kv_index, const at::Tensor& seq_lens, double scale, int64_t heads,
                                 int64_t isa, int64_t chunk_keys, int64_t window, bool bf16_products,
                                 const std::optional<at::Tensor>& sinks = std::nullopt);   // sinks: attention_sink.h

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
at::Tensor add_rms_norm_(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& w, double eps);
at::Tensor silu_mul(const at::Tensor& gu, int64_t isa = -1);   // isa: -1 the best here; tests force 0-2
at::Tensor gelu_tanh_mul(const at::Tensor& gu, int64_t isa = -1);
void head_rms_norm_(const at::Tensor& qkv, const at::Tensor& w, double eps);
void rope_(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
           int64_t heads, int64_t D);
at::Tensor race_argmax(const at::Tensor& x, const std::optional<at::Tensor>& t,
                       const std::optional<at::Tensor>& seeds, int64_t isa);
at::Tensor race_noise(const at::Tensor& seeds, int64_t vocab, int64_t isa);
at::Tensor gated_delta_rule_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                             const at::Tensor& beta, const at::Tensor& state, const at::Tensor& slots,
                             const at::Tensor& starts, const at::Tensor& fresh, int64_t isa);
at::Tensor gated_delta_rule_chunked_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const at::Tensor& g, const at::Tensor& beta, const at::Tensor& state,
                                     const at::Tensor& slots, const at::Tensor& starts, const at::Tensor& fresh,
                                     int64_t chunk, int64_t isa);

at::Tensor decode_layer_(const at::Tensor& x, const std::optional<at::Tensor>& delta, const at::Tensor& attn_norm,
                         const at::Tensor& mlp_norm, double eps, at::TensorList w, at::IntArrayRef qtypes,
                         at::TensorList packed, const std::optional<at::Tensor>& qkv_bias, bool int8, const at::Tensor& cos,
                         const at::Tensor& sin, const at::Tensor& positions, int64_t heads, int64_t kv_heads,
                         int64_t head_dim, const at::Tensor& cache, int64_t layer, const at::Tensor& loc,
                         const at::Tensor& kv_index, const at::Tensor& seq_lens, double scale, bool bf16_products,
                         const std::optional<at::Tensor>& qk_norm, bool mlp);
std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& x, const at::Tensor& router_t, int64_t experts,
                                             int64_t top_k, bool renormalize, int64_t isa);
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& gate_up, int64_t gu_qtype, const at::Tensor& down,
                       int64_t down_qtype, int64_t inter, const at::Tensor& ids, const at::Tensor& weights,
                       int64_t act, int64_t isa);
}  // namespace tandem
