"""What a decode step must move, and what the device can move: the two sides of the roofline.

``copy_bandwidth`` is the ceiling (a device-to-device copy, bytes read plus bytes written);
``weight_bytes_per_step`` and ``kv_bytes_per_token`` are the floor's bytes. Decode reads every
weight once per step (the input embedding only for the step's rows) and every resident KV slot
once per request and layer.
"""

from __future__ import annotations

import platform
import statistics
import subprocess
import time

import torch
from torch import nn


def weight_bytes_per_step(model: nn.Module) -> int:
    """Parameter bytes a decode step reads: all of them, except an input embedding table that no
    other module shares (a lookup reads a few rows; a tied LM head reads the whole table anyway)."""
    owners: dict[int, list[nn.Module]] = {}
    params: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append(module)
            params[id(p)] = p
    total = 0
    for pid, p in params.items():
        mods = owners[pid]
        embedding = isinstance(mods[0], nn.Embedding) or type(mods[0]).__name__ == "VocabEmbedding"
        lookup_only = len(mods) == 1 and embedding
        if not lookup_only:
            total += p.numel() * p.element_size()
    return total


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V bytes of one token across all layers."""
    return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def copy_bandwidth(device: torch.device, nbytes: int = 4 << 30, iters: int = 20) -> dict:
    """Median device-to-device copy bandwidth of a ``nbytes`` buffer, counting bytes read + written.

    Two buffers of random bf16 (not zeros), many times the L2; ``dst.copy_(src)`` timed with CUDA
    events after warm-up. On CPU the same copy is timed with the host clock (for the tests only).
    """
    n = nbytes // 2
    src = torch.randn(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(iters + 3):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            elapsed = time.perf_counter() - t0
        if i >= 3:
            times.append(elapsed)
    seconds = statistics.median(times)
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "method": f"torch dst.copy_(src), {n * 2 / 2**30:.1f} GiB bf16 random, device to device, "
        f"median of {iters} after 3 warm-ups, bytes = read + written",
        "buffer_bytes": n * 2,
        "seconds": seconds,
        "bytes_per_s": 2 * n * 2 / seconds,
    }


def environment(device: torch.device, commit: str | None) -> dict:
    """Versions, device and commit, for the report."""
    env = {
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "gpu_memory_bytes": torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "commit": commit or git_commit(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    return env


def git_commit() -> str | None:
    """HEAD, with ``-dirty`` when tracked files differ from it; None outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("-dirty" if dirty.stdout.strip() else "")


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
