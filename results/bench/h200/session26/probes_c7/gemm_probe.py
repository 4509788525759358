"""Session 26 call 7: the 128K prefill's GEMM shapes (2048-token chunk, Qwen3-8B) under torch's default BLAS and
cuBLASLt: ms per call and TFLOP/s."""
import torch
M = 2048
shapes = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 24576), "down": (12288, 4096)}
def bench(k, n):
    x = torch.randn(M, k, device="cuda", dtype=torch.bfloat16); w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    for _ in range(3): torch.nn.functional.linear(x, w)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(50): torch.nn.functional.linear(x, w)
    e1.record(); torch.cuda.synchronize(); ms = e0.elapsed_time(e1) / 50
    return ms, 2 * M * k * n / ms / 1e9
for lib in ("default", "cublaslt"):
    if lib != "default":
        torch.backends.cuda.preferred_blas_library(lib)
    for name, (k, n) in shapes.items():
        ms, tf = bench(k, n)
        print(f"{lib:9s} {name:8s} {ms:.4f} ms {tf:.0f} TFLOP/s", flush=True)
