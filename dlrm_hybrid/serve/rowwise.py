"""Row-wise int8/int4 quantization in fbgemm's inference layout (per row an fp16 scale and an
fp16 bias, then the codes), the codes computed from the fp16 scale and bias they are stored with.

Why not fbgemm's own: `quantize_embs` (fbgemm_gpu 1.8, and upstream's) codes int8 rows with an
fp32 scale and bias and only then rounds both to fp16; below a row range of about 0.0156 the fp16
scale is subnormal and no longer the one the codes were made with (measured, 128 wide: rows at a
40M-row table's initial range, U(+-1/sqrt(40M)), decode with 8.6x the error of an exact scale).
`FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf` (what torchrec's quantized EmbeddingBagCollection
calls) codes from the fp16 scale, but rounds it to the nearest fp16: a scale only a few subnormal
steps wide rounds down and the row's top values clip (28x the exact scale's error at int8 rows
U(+-1e-5)). Here the bias is rounded down and the scale up, so the codes always span the row.
The cost: in torch ops it is ~12x slower than fbgemm's kernel (1.3 s per million 128-wide rows
on one thread), about 4 minutes for MLPerf's 200M rows, once per export.
"""

from __future__ import annotations

from typing import Tuple

import torch

from dlrm_hybrid.errors import UserError

CHUNK_ROWS = 1 << 16  # rows quantized at a time: bounded temporary memory for any table size


def quantize_into(weight: torch.Tensor, bits: int, codes: torch.Tensor,
                  scale_bias: torch.Tensor, table: str) -> None:
    """Quantize `weight` [rows, dim] into fbgemm's `codes` [rows, dim * bits / 8] and
    `scale_bias` [rows, 4] (uint8 views of one table's storage)."""
    for start in range(0, weight.shape[0], CHUNK_ROWS):
        rows = slice(start, start + CHUNK_ROWS)
        chunk_codes, chunk_scale_bias = quantize_rowwise(weight[rows].float(), bits)
        if not torch.isfinite(chunk_scale_bias.view(torch.float16)).all():
            raise UserError(f"--quantize: table {table} has values beyond fp16's range "
                            f"(+-65504), which int{bits} stores its scale and bias in; give it "
                            f"fp32 (--quantize-table {table}=fp32)")
        codes[rows].copy_(chunk_codes)
        scale_bias[rows].copy_(chunk_scale_bias)


def quantize_rowwise(weight: torch.Tensor, bits: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(codes [rows, dim * bits / 8] uint8, two values a byte for int4 with the even element in
    the low nibble; scale and bias [rows, 4] uint8: fp16 scale, fp16 bias). A row decodes as
    code * scale + bias."""
    levels = (1 << bits) - 1
    low, high = torch.aminmax(weight, dim=1)
    bias = _fp16_at_most(low)
    scale = _fp16_at_least((high - bias.float()) / levels)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)  # a constant row: any scale
    codes = torch.round((weight - bias.float()[:, None]) / scale.float()[:, None])
    codes = codes.clamp_(0, levels).to(torch.uint8)
    if bits == 4:
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return codes, torch.stack([scale, bias], dim=1).view(torch.uint8)


def _fp16_at_least(x: torch.Tensor) -> torch.Tensor:
    """The smallest fp16 value >= each of `x` (fp32)."""
    h = x.half()
    return torch.where(h.float() < x, torch.nextafter(h, torch.full_like(h, float("inf"))), h)


def _fp16_at_most(x: torch.Tensor) -> torch.Tensor:
    """The largest fp16 value <= each of `x` (fp32)."""
    h = x.half()
    return torch.where(h.float() > x, torch.nextafter(h, torch.full_like(h, float("-inf"))), h)
