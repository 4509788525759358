"""SASS of a Triton kernel compiled for Hopper on any host (no GPU): registers, spills and instructions per loop.

Triton compiles for a ``GPUTarget`` without a device, and its wheel ships ``cuobjdump``. This compiles the
quantized decode kernel (``sparse_kernels._triton.quantized_decode``) as the launcher would for a Qwen3-8B
layer (8 KV heads, 4 query heads each, head_dim 128) under each scheme's current launch config, and prints
per kernel the registers per thread, the stack (spill) bytes, and per loop (a backward branch and the
instructions it jumps over) the instruction count and the most frequent opcodes. Pointer arguments are
declared 16-byte aligned, as the launcher specializes them: without that hint every load compiles to a
scalar ``LDG`` and the counts mislead (session 16, ``NOTES.md``).

    python packages/sparse-kernels/benchmarks/sass_counts.py [--schemes kivi4,kivi2,fp8,tq3] [--warps 1] [--stages 2]

Divide a loop's count by the tokens one iteration covers and multiply by the warps of a program to get
warp instructions per (token, KV head), the number to hold against what the copy bandwidth allows.
"""

from __future__ import annotations

import argparse
import collections
import inspect
import os
import re
import subprocess
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

from sparse_kernels._triton import quantized_decode_launch as launch
from sparse_kernels._triton.quantized_decode import _quantized_decode_split_kernel
from sparse_kernels._triton.quantized_tiles import SCHEME_IDS

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
ARGS = {  # the runtime arguments' types for a bf16 model (KIVI's statistics fp16, fp8 scales float32)
    "q_ptr": "*bf16",
    "k_tail_ptr": "*bf16",
    "v_tail_ptr": "*bf16",
    "codebook_ptr": "*fp16",
    "indptr_ptr": "*i32",
    "indices_ptr": "*i32",
    "last_len_ptr": "*i32",
    "tail_index_ptr": "*i32",
    "o_part_ptr": "*fp32",
    "lse_part_ptr": "*fp32",
    "logits_ptr": "*fp32",
    "stride_qb": "i32",
    "stride_qh": "i32",
    "stride_lb": "i32",
    "stride_lh": "i32",
    "scale_log2": "fp32",
    "num_splits": "i32",
}
CODES = {"fp8": "*fp8e4nv", "kivi": "*i32", "turboquant": "*i32"}
SCALES = {"fp8": "*fp32", "kivi": "*fp16", "turboquant": "*fp32"}


def compile_sass(
    fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int, maxnreg: int | None = None
) -> tuple[str, str]:
    """``(sass, resource usage)`` of ``fn`` compiled for sm_90 with 16-byte aligned pointers."""
    names = list(signature)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if signature[n].startswith("*")}
    source = triton.compiler.ASTSource(fn=triton.jit(fn), signature=signature, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(
        source,
        target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=num_warps, num_stages=num_stages, **({"maxnreg": maxnreg} if maxnreg else {})),
    )
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        sass = subprocess.run([f"{BIN}/cuobjdump", "-sass", f.name], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([f"{BIN}/cuobjdump", "-res-usage", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    return sass, res


def loops(sass: str) -> list[tuple[int, int, list[str]]]:
    """``(start, end, instructions)`` of every backward branch in ``sass``."""
    instrs = [(int(m[1], 16), m[2].strip()) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    out = []
    for addr, text in instrs:
        target = re.search(r"BRA\s.*?0x([0-9a-f]+)", text)
        if target and int(target[1], 16) < addr:
            start = int(target[1], 16)
            out.append((start, addr, [t for a, t in instrs if start <= a <= addr]))
    return out


def opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def quantized_decode_case(
    scheme: str, bits: int, config: dict, block_g: int = 16, swap: bool = False, pairs: bool = False
) -> tuple[dict, dict]:
    """Signature and constexprs of the quantized decode kernel for one Qwen3-8B layer (one list per request)."""
    cpw = 1 if scheme == "fp8" else 32 // bits
    words = 128 if scheme == "fp8" else -(-128 // cpw)
    const = dict(
        SCHEME=SCHEME_IDS[scheme], BITS=bits, CPW=cpw, WORDS=words, NUM_GROUPS=4 if scheme == "kivi" else 1,
        NUM_KV_HEADS=8, GROUP=4, HEAD_DIM=128, PAGE_SIZE=32 if scheme == "kivi" else 16, HEAD_SPARSE=False,
        LOGITS=False, BLOCK_G=block_g, BLOCK_D=128,
        BLOCK_N=32 if scheme == "kivi" else config["BLOCK_N"],
        UNPACK_WORDS=scheme != "fp8" and cpw & (cpw - 1) == 0 and words * cpw == 128,
        DOT_DTYPE=tl.float16, PRECISION="tf32", USE_GDC=True, SWAP_AB=swap, PAIRS=pairs,
        GROUPED=bool(config.get("GROUPED", False)),
    )  # fmt: skip
    types = dict(ARGS, k_ptr=CODES[scheme], v_ptr=CODES[scheme], k_scale_ptr=SCALES[scheme])
    types.update(v_scale_ptr=SCALES[scheme], k_min_ptr=SCALES[scheme], v_min_ptr=SCALES[scheme])
    params = inspect.signature(_quantized_decode_split_kernel).parameters
    return {p: "constexpr" if p in const else types[p] for p in params}, const


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--schemes", default="kivi4,kivi2,fp8,tq3", help="kivi4, kivi2, fp8, tq4, tq3, tq2")
    parser.add_argument("--warps", type=int, default=None, help="instead of the scheme's launch config")
    parser.add_argument("--stages", type=int, default=None)
    parser.add_argument("--maxnreg", type=int, default=None, help="registers a thread may use (else the config's)")
    parser.add_argument("--block-g", type=int, default=None, help="query rows a program holds (default: as launched)")
    parser.add_argument("--swap-ab", action="store_true", help="transposed dots (SWAP_AB), the group unpadded")
    parser.add_argument("--pairs", action="store_true", help="KIVI codes two per word half-pair in PTX (PAIRS)")
    args = parser.parse_args()
    names = {"kivi": "kivi", "fp": "fp8", "tq": "turboquant"}
    for case in args.schemes.split(","):
        prefix = re.match(r"[a-z]+", case)[0]
        scheme, bits = names[prefix], int(case[len(prefix) :])
        config = launch.KIVI_DECODE_CONFIG if scheme == "kivi" else launch.QUANT_DECODE_CONFIG
        warps = args.warps or config["num_warps"]
        stages = args.stages or config["num_stages"]
        swap = args.swap_ab or bool(config.get("SWAP_AB"))
        block_g = args.block_g or (4 if swap else 16)
        pairs = args.pairs or bool(config.get("PAIRS"))
        signature, const = quantized_decode_case(scheme, bits, config, block_g, swap, pairs)
        maxnreg = args.maxnreg or config.get("maxnreg")
        sass, res = compile_sass(_quantized_decode_split_kernel, signature, const, warps, stages, maxnreg)
        usage = re.search(r"REG:(\d+).*?STACK:(\d+)", res, re.S)
        print(f"{case}: {warps} warps, {stages} stages, {const['BLOCK_N']} tokens a step, {block_g} query rows"
              f"{' (swapped dots)' if swap else ''}; registers "
              f"{usage[1] if usage else '?'}, stack {usage[2] if usage else '?'} bytes")  # fmt: skip
        for start, end, body in loops(sass):
            top = collections.Counter(opcode(t) for t in body).most_common(int(os.environ.get("SASS_TOP", "12")))
            print(f"  loop {start:#x}-{end:#x}: {len(body)} instructions; " + ", ".join(f"{k} {v}" for k, v in top))


if __name__ == "__main__":
    main()
