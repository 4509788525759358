"""int8 codes into fp16 dot operands in registers, exact, by byte permutes (Quest's page summaries, RetroInfer's
centroids). The hardware's int-to-float conversion runs at a quarter of the FMA rate; permuting each code's byte
under the exponent of 1024.0 and subtracting the bias costs five instructions per four codes. GPU only: the
interpreter runs no PTX (its callers convert with ``.to`` there)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def int8_to_fp16(x):
    """int8 codes as fp16, exact: per 4 codes one xor (``code + 128`` as a byte), two byte permutes that
    put ``0x64`` above each byte (the fp16 ``1024 + byte``) and two packed subtractions of 1152."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 u, hi, bias;
        mov.b32 hi, 0x64646464;
        mov.b32 bias, 0x64806480;
        xor.b32 u, $2, 0x80808080;
        prmt.b32 $0, u, hi, 0x4140;
        prmt.b32 $1, u, hi, 0x4342;
        sub.f16x2 $0, $0, bias;
        sub.f16x2 $1, $1, bias;
        }""",
        constraints="=r,=r,r",
        args=[x],
        dtype=tl.float16,
        is_pure=True,
        pack=4,
    )
