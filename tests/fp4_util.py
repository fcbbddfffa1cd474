"""The 4-bit float code sets as their definitions state them, for the kernels' tests (independent of
llmopt/layers/formats/fp4.py's tables, which the tests check against these)."""

from __future__ import annotations


def e2m1(code: int) -> float:
    """OCP MX FP4: bit 3 the sign, bits 2-1 the exponent (bias 1), bit 0 the mantissa; exponent 0 is
    subnormal (0 or 0.5)."""
    sign, e, m = -1.0 if code & 8 else 1.0, (code >> 1) & 3, code & 1
    return sign * (m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2))


# bitsandbytes' NF4 (QLoRA, Dettmers et al. 2023, Appendix E) as printed there, code order
NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
        -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
        0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
        0.7229568362236023, 1.0)


def bnb_fp4(code: int) -> float:
    """bitsandbytes' FP4: bit 3 the sign; the magnitudes of codes 0-7 are (0, 0.0625, 8, 12, 4, 6, 2,
    3) / 12 (exponent bits 2-1 with bias 2 and a subnormal, normalised to a maximum of 1)."""
    mag = (0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0)[code & 7] / 12
    return -mag if code & 8 else mag


DEFINITIONS = {"e2m1": [e2m1(c) for c in range(16)], "nf4": list(NF4), "bnb_fp4": [bnb_fp4(c) for c in range(16)]}
