"""The GGML block types llmopt's CPU kernels multiply as stored, and what the engine holds for each
(torch-free: kv-estimate counts a GGUF's weights with it; llmopt.layers.formats.ggml decodes them)."""

from __future__ import annotations

RUN_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
BITS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6}
GROUP = {t: 16 if t == "Q6_K" else 32 for t in RUN_TYPES}
FLOAT16_TYPES = ("F16", "BF16")   # matrices of these run as stored too (llmopt.layers.modules16)
# the block types whose group scale and scaled zero are exact in fp16 (d, m, 8d, 16d: held as stored);
# a K-quant's d x 6-bit sub-scale is not, and stays float32
HALF_SCALE_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


def held_bytes(type_name: str, shape: tuple[int, ...], float_bytes: int = 4) -> int:
    """The bytes the CPU engine holds for a GGUF tensor (GGMLLinear's buffers): 4-bit codes packed
    two a byte where the width is a multiple of 64, else a byte a code, and a scale and scaled zero
    per group (none for Q8_0), fp16 for HALF_SCALE_TYPES, else float32; an F16 / BF16 matrix as
    stored; a tensor of another type, or not 2-D, dequantized to `float_bytes` an element."""
    numel = 1
    for d in shape:
        numel *= d
    if type_name in FLOAT16_TYPES and len(shape) == 2:
        return numel * 2
    if type_name not in RUN_TYPES or len(shape) != 2:
        return numel * float_bytes
    rows, cols = shape
    codes = numel // 2 if BITS[type_name] == 4 and cols % 64 == 0 else numel
    per_group = (1 if type_name == "Q8_0" else 2) * (2 if type_name in HALF_SCALE_TYPES else 4)
    return codes + rows * (cols // GROUP[type_name]) * per_group
