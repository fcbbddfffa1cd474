"""The GGML block types llmopt's CPU kernels multiply as stored, and what the engine holds for each
(torch-free: kv-estimate counts a GGUF's weights with it; llmopt.layers.formats.ggml decodes them)."""

from __future__ import annotations

from llmopt.errors import UserInputError

RUN_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
BITS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6}
GROUP = {t: 16 if t == "Q6_K" else 32 for t in RUN_TYPES}
FLOAT16_TYPES = ("F16", "BF16")   # matrices of these run as stored too (llmopt.layers.modules16)
# the block types whose group scale and zero are the file's fp16 d and m (held as stored); the
# K-quants' are held as their files hold them too: byte sub-scales and an fp16 d per 256
HALF_SCALE_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
# the zero point: a scaled zero per group (m; a K-quant's dmin x min), none (Q8_0), or implied by the
# scale, one zero code for every group as llama.cpp has it (held as one fp16 value a tensor)
IMPLIED_ZERO = {"Q4_0": 8, "Q5_0": 16, "Q6_K": 32}
Q4_0_VALUES, Q4_0_BYTES = 32, 18   # a Q4_0 block: 32 values in an fp16 scale and 16 bytes of nibbles


def kv_int4_head_bytes(head_dim: int) -> int:
    """Bytes of one head's K (or V) row in an int4 KV cache: head_dim / 32 Q4_0 blocks (the engine's
    layout, llmopt/kernels/reference.py; kv-estimate counts the same)."""
    if head_dim % Q4_0_VALUES:
        raise UserInputError(f"--kv-cache-dtype int4 quantizes each head in blocks of {Q4_0_VALUES} values; "
                             f"this model's head_dim is {head_dim}")
    return head_dim // Q4_0_VALUES * Q4_0_BYTES


def held_bytes(type_name: str, shape: tuple[int, ...], float_bytes: int = 4, device: str = "cpu") -> int:
    """The bytes the CPU engine holds for a GGUF tensor (GGMLLinear's buffers): 4-, 5- and 6-bit codes
    at their bits where the width is a multiple of 64, else a byte a code; per group the file's scale
    and scaled zero (fp16 d and m; a K-quant's byte sub-scales with its fp16 d and dmin per super-block
    of 256), the scale alone where the zero is implied (one fp16 zero code a tensor) or none; an F16 /
    BF16 matrix as stored; an MXFP4 matrix as 4-bit codes (nibbles where 64 wide or more) and a
    float32 scale per block of 32 (as a Linear runs it; an MXFP4 token table is counted so too,
    though the engine dequantizes it); a tensor of another type, or not 2-D, dequantized to
    `float_bytes` an element. (A Q4_0, Q4_1, Q5_0, Q5_1 or Q6_K matrix 64 wide or more: the file's bytes, plus 2 where
    the zero is implied; Q4_K and Q5_K: 4 bytes a 256 more than the file.) IMPLIED_ZERO says where the
    scale alone is held.
    On CUDA (`device` not "cpu"): 4-bit codes (Q4_x, Q4_K) or 8-bit ones in int32 words, a float32
    scale and zero point per group; every other tensor in the model's dtype (`float_bytes`)."""
    numel = 1
    for d in shape:
        numel *= d
    if device != "cpu":   # CUDA: the Triton dequantize-GEMM's layout (llmopt.layers.modules_ggml.kernel_layout)
        if type_name not in RUN_TYPES or len(shape) != 2:
            return numel * float_bytes   # dequantized to the model's dtype, F16 / BF16 matrices included
        rows, cols = shape
        return (numel // 2 if BITS[type_name] <= 4 else numel) + rows * (cols // GROUP[type_name]) * 8
    if type_name in FLOAT16_TYPES and len(shape) == 2:
        return numel * 2
    if type_name == "MXFP4" and len(shape) == 2:   # a Linear's (llmopt.layers.modules_fp4.GGUFMxfp4Linear):
        rows, cols = shape                          # 4-bit codes, a float32 scale per 32
        return (numel // 2 if cols % 64 == 0 else numel) + rows * (cols // 32) * 4
    if type_name not in RUN_TYPES or len(shape) != 2:
        return numel * float_bytes
    rows, cols = shape
    bits = BITS[type_name]
    packed = bits <= 6 and cols % 64 == 0
    groups = rows * (cols // GROUP[type_name])
    if type_name in HALF_SCALE_TYPES:   # an fp16 scale a group
        one = groups * 2
    else:                               # a byte a group, an fp16 d a super-block of 256
        one = groups + rows * (cols // 256) * 2
    stored_zero = type_name != "Q8_0" and type_name not in IMPLIED_ZERO
    zero_code = 2 if type_name in IMPLIED_ZERO else 0   # one fp16 value
    return (numel * bits // 8 if packed else numel) + one * (2 if stored_zero else 1) + zero_code
