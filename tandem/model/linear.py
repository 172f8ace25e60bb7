"""The decoder's linear layers: dense fp32 weights (Linear, with a bmm path for few CPU rows) and GGUF blocks
(QLinear, tandem's native quantized kernels), and the fusing of q/k/v and gate/up rows."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.quant import (INT8_ACT_QTYPES, QuantWeight, gemv_is_gemm, linear_rows, packed_gather, packed_rows,
                             small_m)


ALL_ROWS = 1 << 40   # gemv_packed_q8act_max_rows() of a type whose packed copy takes every row count
SMALL_M = 64        # rows up to which a CPU linear runs as a bmm over row blocks of the weight
ROW_BLOCKS = 8


class Linear:
    """y = x @ w.T (+ b), with a CPU path for few rows.

    MKL's fp32 GEMV/GEMM for a handful of rows runs on one thread on an AMD EPYC machine of this project:
    measured 16 GB/s of weight traffic, 2.5-4x slower than a bmm over 8 row blocks of the weight, which MKL spreads over the cores
    (46 GB/s, the copy bandwidth). At 64 rows the bmm still wins for the wide weights (gate_up, LM head:
    -10 to -15 %); past that the plain GEMM is as fast or faster, so it takes over.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight, self.bias = weight, bias
        out, inp = weight.shape
        self.blocks = (weight.view(ROW_BLOCKS, out // ROW_BLOCKS, inp)
                       if weight.device.type == "cpu" and out % ROW_BLOCKS == 0 else None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        if self.blocks is None or m > SMALL_M:
            return F.linear(x, self.weight, self.bias)
        xb = x.t().unsqueeze(0).expand(ROW_BLOCKS, -1, m)                   # [P, in, M]
        y = torch.bmm(self.blocks, xb).view(self.weight.shape[0], m).t()    # [M, out]
        return y + self.bias if self.bias is not None else y.contiguous()


class QLinear:
    """y = x @ dequant(w).T (+ b) on GGUF blocks, by tandem's native kernel (kernels="native").

    A list of weights is a fused linear whose parts have different types (Q4_K_M files keep attn_v in Q6_K
    beside Q4_K q/k): each part runs on its own blocks and the outputs are concatenated.

    With int8 activations, weights of a type tandem.pack_gemv interleaves (Q4_0 / Q4_1 / Q5_0 / Q8_0, and the
    K-quants Q2_K to Q6_K of the K-quant files) get a repacked copy per part (`packed`) for up to
    packed_rows() rows of x, where tandem.gemv_packed_q8act gives the GEMM's bits 2-2.7x faster than the row layout's
    GEMV (decode and speculative verify steps; csrc/gemv_packed_q8act.cpp). For the 32-weight types the row layout stays
    beside it (as many bytes again) for longer prefill chunks; the K-quants' packed copy takes every row count, so
    release_rows() lets the row layout go and the model holds each weight once (issue 46: a 1.12 GB file took
    1.87 GB)."""

    def __init__(self, weight: "QuantWeight | list[QuantWeight]", bias: torch.Tensor | None = None,
                 int8_act: bool = False) -> None:
        self.parts, self.bias = (weight if isinstance(weight, list) else [weight]), bias
        self.int8_act = int8_act
        # The decode call decided once: the op overload and its arguments (linear_rows's choice for few rows).
        w = self.parts[0]
        q8 = int8_act and w.qtype in INT8_ACT_QTYPES
        self._few = (small_m() if len(self.parts) == 1 else -1,
                     (torch.ops.tandem.linear_rows_q8act if q8 else torch.ops.tandem.linear_rows).default, w.data,
                     w.qtype, w.k)
        # Packed parts run up to the rows every part's type allows (all parts packable, or none packed).
        rows = {packed_rows(p.qtype) if int8_act and p.qtype in INT8_ACT_QTYPES else 0 for p in self.parts}
        self.packed_rows = rows.pop() if len(rows) == 1 else 0
        self.packed_parts = [torch.ops.tandem.pack_gemv(p.data, p.qtype, p.k) if self.packed_rows else None
                             for p in self.parts]
        # Rows past the packed copy's reach: the int8 GEMM at every row count where the GEMV's bits are not its
        # (a row's bits must not follow the step's size: gemv_is_gemm); then no in-kernel GEMV rows.
        self.gemm_always = q8 and self.packed_rows < ALL_ROWS and not all(gemv_is_gemm(p) for p in self.parts)
        if self.gemm_always:
            self._few = (-1, *self._few[1:])
        self.bf16: torch.Tensor | None = None       # the dequantized weight in bf16 (make_bf16), for bulk()

    @property
    def packed(self) -> torch.Tensor | None:
        """The one part's packed copy (None: several parts, or none)."""
        return self.packed_parts[0] if len(self.parts) == 1 else None

    @property
    def holds_rows(self) -> bool:
        """Whether the row layout is still held (release_rows() drops it where the packed copy serves all)."""
        return all(p.data.shape[1] > 0 for p in self.parts)

    def release_rows(self, packed_only: bool = False) -> None:
        """Drop the row layout where the packed copy serves every row count (K-quants): the parts keep their
        type and shape over empty rows. Call it after make_bf16(), which dequantizes the rows. packed_only (an
        expert's linears): the packed copy takes every row count wherever its bits are the GEMM's at every count
        (gemv_is_gemm: MXFP4 / Q4_0 / Q8_0 ... on VNNI), so a 32-weight type is held once too. An expert sees a
        chunk's tokens routed to it, rarely past the 256 rows where AMX's GEMM on the rows would have taken over:
        gpt-oss-20b's MXFP4 experts are 92 % of its bytes, held twice before."""
        if packed_only and self.packed_parts[0] is not None and all(gemv_is_gemm(p) for p in self.parts):
            self.packed_rows = ALL_ROWS
        if self.packed_rows < ALL_ROWS:
            return
        self.parts = [QuantWeight(torch.empty((p.data.shape[0], 0), dtype=torch.uint8), p.qtype, p.k)
                      for p in self.parts]
        w = self.parts[0]
        self._few = (-1, None, w.data, w.qtype, w.k)

    def lookup_rows(self, index: torch.Tensor) -> torch.Tensor:
        """fp32 rows [len(index), K] of the (one-part) weight, an embedding lookup: from the row layout while it
        is held, else from the packed copy (the same bits), so a tied embedding needs no row layout of its own."""
        w = self.parts[0]
        if self.holds_rows:
            return w.rows(index)
        return packed_gather(self.packed_parts[0], w.qtype, w.k, w.data.shape[0], index)

    def make_bf16(self) -> None:
        """Keep a bf16 copy of the dequantized weight (2 bytes a weight) for bulk() (prefill_act="bf16")."""
        self.bf16 = torch.cat([p.dequantize() for p in self.parts]).to(torch.bfloat16).contiguous()

    def bulk(self, x: torch.Tensor) -> torch.Tensor:
        """The rows of a long prefill chunk, x [M, K] fp32 -> [M, N] fp32, by torch's bf16 GEMM (oneDNN: AMX
        tiles where the CPU has them; 4x the int8 GEMM's rate at 924 rows on a Sapphire Rapids core,
        benchmarks/results/prefill_bf16.md). x and the output are rounded to bf16 (8 bits of mantissa; the int8
        path keeps ~7 a 16-element half); sums are fp32 inside oneDNN."""
        y = F.linear(x.to(torch.bfloat16), self.bf16).float()
        return y if self.bias is None else y.add_(self.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows, op, data, qtype, k = self._few
        if x.shape[0] <= self.packed_rows:              # the repacked copy: the same bits as the ops below
            if len(self.parts) == 1:
                return torch.ops.tandem.gemv_packed_q8act.default(x, self.packed_parts[0], qtype, k, data.shape[0],
                                                             self.bias)
            y = torch.cat([torch.ops.tandem.gemv_packed_q8act.default(x, pk, p.qtype, p.k, p.data.shape[0], None)
                           for p, pk in zip(self.parts, self.packed_parts)], dim=-1)
            return y if self.bias is None else y + self.bias
        if x.shape[0] <= rows:                          # one part, in-kernel rows: straight to the op
            return op(x, data, qtype, k, self.bias)
        if self.gemm_always:
            y = torch.cat([torch.ops.tandem.gemm_rows_q8act(x, p.data, p.qtype, p.k, None) for p in self.parts], dim=-1)
            return y if self.bias is None else y + self.bias
        if len(self.parts) == 1:
            return linear_rows(x, self.parts[0], self.bias, self.int8_act)
        y = torch.cat([linear_rows(x, p, None, self.int8_act) for p in self.parts], dim=-1)
        return y if self.bias is None else y + self.bias


def hold_once(lins: list, bf16: bool, experts: bool = False) -> None:
    """The bf16 copies prefill_bf16 asks for, then release_rows(): each weight held once (packed K-quants; with
    experts, every type whose packed copy gives the GEMM's bits)."""
    for lin in lins:
        if isinstance(lin, QLinear):
            if bf16:
                lin.make_bf16()
            lin.release_rows(packed_only=experts)


Table = "torch.Tensor | QuantWeight | QLinear"     # an embedding's lookup table (embedding_rows)


def tied_table(embed: "torch.Tensor | QuantWeight", head: "Linear | QLinear") -> Table:
    """The lookup table of an embedding tied to `head` (made from the same matrix, on this stage or rank): the
    head itself once it has dropped its row layout, whose packed copy then serves the lookups too, so the matrix
    is held once (csrc/packed_gather.cpp: what the second copy cost); else the embedding as it is."""
    if isinstance(head, QLinear) and len(head.parts) == 1 and not head.holds_rows:
        return head
    return embed


def embedding_rows(table: Table, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of an embedding table: dense (F.embedding), GGUF blocks (dequantized rows), or a tied LM head
    (QLinear.lookup_rows)."""
    if isinstance(table, QLinear):
        return table.lookup_rows(ids)
    return table.rows(ids) if isinstance(table, QuantWeight) else F.embedding(ids, table)


def run_rows(lin: "Linear | QLinear", x: torch.Tensor, bulk_from: int) -> torch.Tensor:
    """lin(x), where x's rows from bulk_from on (a long prefill chunk's tokens, after a mixed step's decode rows)
    run lin.bulk() when lin has a bf16 copy; the rows before keep their own path, so a decode row's bits do not
    depend on the long prefill chunk it shares a step with."""
    if getattr(lin, "bf16", None) is None or bulk_from >= x.shape[0]:
        return lin(x)
    if bulk_from == 0:
        return lin.bulk(x)
    return torch.cat([lin(x[:bulk_from]), lin.bulk(x[bulk_from:])])


Weight = "torch.Tensor | QuantWeight | list[QuantWeight]"


def linear(weight: Weight, bias: torch.Tensor | None = None, int8_act: bool = False) -> "Linear | QLinear":
    return Linear(weight, bias) if isinstance(weight, torch.Tensor) else QLinear(weight, bias, int8_act)


def take_rows(w: "torch.Tensor | QuantWeight", index: torch.Tensor) -> "torch.Tensor | QuantWeight":
    """Rows `index` of a weight, in that order (GGUF blocks stay blocks: a row is whole blocks)."""
    if isinstance(w, QuantWeight):
        return QuantWeight(w.data[index].contiguous(), w.qtype, w.k)
    return w[index].contiguous()


def cat_rows(parts: "list[torch.Tensor | QuantWeight]") -> Weight:
    """Stack the rows of several weights (q/k/v, gate/up); blocks of one type stay blocks, blocks of mixed
    types stay a list of blocks (QLinear runs each)."""
    if all(isinstance(p, QuantWeight) for p in parts):
        return QuantWeight.cat(parts) or list(parts)
    return torch.cat([p.dequantize() if isinstance(p, QuantWeight) else p for p in parts])
