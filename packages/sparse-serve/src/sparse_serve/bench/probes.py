"""What a decode step must move, and what the device can move: the two sides of the roofline.

``copy_bandwidth`` is the ceiling (a device-to-device copy, bytes read plus bytes written);
``weight_bytes_per_step`` and ``kv_bytes_per_token`` are the floor's bytes. Decode reads every
weight once per step (the input embedding only for the step's rows) and every resident KV slot
once per request and layer.
"""

from __future__ import annotations

import math
import platform
import statistics
import subprocess
import time
from collections.abc import Callable

import torch
from torch import nn

from sparse_kernels import launch_settings


def weight_bytes_per_step(model: nn.Module, batch_size: int | None = None) -> int:
    """Parameter bytes a decode step reads: all of them, except an input embedding table that no
    other module shares (a lookup reads a few rows; a tied LM head reads the whole table anyway).

    Given ``batch_size``, a module that says what share of its weights a step of that many tokens
    reads (``bytes_read(num_tokens)``: routed experts, whose unchosen experts stay unread) counts
    that: the expected number of distinct experts under uniform routing, ``E * (1 - (1 - k/E)^B)``,
    not a measured one. Without it every weight counts.
    """
    owners: dict[int, list[nn.Module]] = {}
    params: dict[int, torch.Tensor] = {}
    partial = 0.0
    skip: set[int] = set()
    for module in model.modules():
        if batch_size is not None and callable(getattr(module, "bytes_read", None)):
            partial += module.bytes_read(batch_size)
            skip.update(id(p) for p in module.parameters())
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append(module)
            params[id(p)] = p
    total = round(partial)
    for pid, p in params.items():
        mods = owners[pid]
        embedding = isinstance(mods[0], nn.Embedding) or type(mods[0]).__name__ == "VocabEmbedding"
        lookup_only = len(mods) == 1 and embedding
        if not lookup_only and pid not in skip:
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
    env["kernels"] = launch_settings()
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


def profile_device(step: Callable[[], object], steps: int, more: Callable[[], bool] = lambda: True) -> dict:
    """Run ``step`` up to ``steps`` times under the profiler; device busy ms per step and top kernels.

    Busy time is the union of the device's kernel and copy intervals, so step time minus it is time
    the device sat idle waiting for the host (Python, metadata, launches). Empty when profiling fails:
    it is a diagnostic, the run's numbers do not depend on it.
    """
    out = profile_events(step, steps, more, cuda=True)
    if not out:
        return {}
    return {
        "gpu_kernel_ms_per_step": out["busy_ms_per_step"],
        "profiled_steps": out["profiled_steps"],
        "gpu_kernels_top": out["top"],
    }


def profile_events(
    step: Callable[[], object], steps: int, more: Callable[[], bool] = lambda: True, *, cuda: bool, top: int = 24
) -> dict:
    """``step`` up to ``steps`` times under torch.profiler: busy ms per step and the ``top`` names by time.

    cuda: the device's kernels and copies (busy = the union of their intervals); otherwise the CPU's
    operators, ranked by self time (they nest, so their own time is what adds up). Empty on failure.
    """
    try:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        done = 0
        activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
        with profile(activities=activities) as prof:
            while done < steps and more():
                step()
                done += 1
        kind = DeviceType.CUDA if cuda else DeviceType.CPU
        events = [e for e in prof.events() if e.device_type == kind]
    except Exception:  # noqa: BLE001
        return {}
    if not done or not events:
        return {}
    busy, end = 0.0, -math.inf
    for s, e in sorted((e.time_range.start, e.time_range.end) for e in events):
        if e > end:
            busy += e - max(s, end)
            end = e
    by_name: dict[str, list[float]] = {}
    for e in events:
        own = e.time_range.end - e.time_range.start if cuda else e.self_cpu_time_total
        by_name.setdefault(e.name, []).append(own)
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {
        "busy_ms_per_step": busy / 1e3 / done,
        "profiled_steps": done,
        "top": [
            {"name": name[:120], "ms_per_step": sum(t) / 1e3 / done, "calls_per_step": len(t) / done}
            for name, t in ranked
        ],
    }
