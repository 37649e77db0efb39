"""Block-wise FP8 (e4m3) quantization of a weight, the layout of DeepSeek-V3's and Qwen3's FP8 checkpoints and of
vLLM's ``Fp8LinearMethod`` with ``weight_block_size``.

A 2-D weight of shape [out, in] is cut into blocks of ``block`` = [rows, cols] (the last row and column of
blocks may be partial); each block gets one fp32 scale, its absolute maximum over e4m3's largest finite value
(448), stored as ``weight_scale_inv`` of shape [ceil(out / rows), ceil(in / cols)], the factor that multiplies
the fp8 values back (``dequantize``). An all-zero block gets scale 1 rather than 0, so its inverse is finite.

Invariant: the result depends only on the weight's values and ``block``, not on the device or on how the
weight was assembled, so the trainer's quantized update and the conversion tool's folder agree bit for bit for
the same weights. The arithmetic is fp32 on the weight's own device, one pass over the tensor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

FP8_E4M3_MAX = 448.0
DEFAULT_BLOCK = (128, 128)
SCALE_SUFFIX = "weight_scale_inv"


def scale_shape(shape: tuple[int, ...] | list[int], block: tuple[int, int] = DEFAULT_BLOCK) -> tuple[int, int]:
    """The ``weight_scale_inv`` shape of a weight of ``shape``: one scale per block, partial blocks included."""
    rows, cols = shape
    return (-(-rows // block[0]), -(-cols // block[1]))


def _blocked(weight: "torch.Tensor", block: tuple[int, int]) -> "torch.Tensor":
    """``weight`` (fp32) zero-padded to whole blocks and viewed as [row blocks, rows, col blocks, cols]."""
    import torch

    rows, cols = weight.shape
    nr, nc = scale_shape(weight.shape, block)
    padded = torch.nn.functional.pad(weight, (0, nc * block[1] - cols, 0, nr * block[0] - rows))
    return padded.view(nr, block[0], nc, block[1])


def quantize(weight: "torch.Tensor", block: tuple[int, int] = DEFAULT_BLOCK) -> tuple["torch.Tensor", "torch.Tensor"]:
    """(``float8_e4m3fn`` weight of ``weight``'s shape, fp32 ``weight_scale_inv``) on ``weight``'s device."""
    import torch

    if weight.dim() != 2:
        raise ValueError(f"block FP8 quantizes 2-D weights; got shape {tuple(weight.shape)}")
    rows, cols = weight.shape
    blocks = _blocked(weight.float(), block)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    q = (blocks / scale).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    q = q.view(blocks.shape[0] * block[0], blocks.shape[2] * block[1])[:rows, :cols].contiguous()
    return q, scale.view(blocks.shape[0], blocks.shape[2]).contiguous()


def dequantize(q: "torch.Tensor", scale_inv: "torch.Tensor", block: tuple[int, int] = DEFAULT_BLOCK,
               dtype: "torch.dtype | None" = None) -> "torch.Tensor":
    """The weight ``q`` x its block's scale, in ``dtype`` (default fp32)."""
    import torch

    rows, cols = q.shape
    blocks = _blocked(q.float(), block)
    out = (blocks * scale_inv.float()[:, None, :, None]).view(blocks.shape[0] * block[0], blocks.shape[2] * block[1])
    return out[:rows, :cols].to(dtype or torch.float32)
