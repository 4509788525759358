"""Probe: does torch's private cuDNN attention op take GQA (fewer KV heads) and a causal square chunk,
with its LSE, and how fast is it against the paged Triton kernel on the same chunk?

    python benchmarks/cudnn_gqa_probe.py OUT.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from prefill_kernel_probe import cuda_time  # noqa: E402

HQ, HKV, D = 32, 8, 128


def main() -> None:
    res = {}
    op = torch.ops.aten._scaled_dot_product_cudnn_attention
    for c in (2048, 8192, 32768, 131072):
        q = torch.randn(1, HQ, c, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, HKV, c, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        entry = {}
        try:
            o = op(q, k, v, None, True, 0.0, True, False, scale=D**-0.5)
            if c <= 8192:
                kk, vv = k.repeat_interleave(4, 1).float(), v.repeat_interleave(4, 1).float()
                s = (q.float() @ kk.transpose(-1, -2)) * D**-0.5
                s = s.masked_fill(torch.ones(c, c, device="cuda", dtype=torch.bool).triu(1), float("-inf"))
                ref = torch.softmax(s, -1) @ vv
                entry["err"] = float((o[0].float() - ref).abs().max())
                entry["lse_err"] = float((o[1].view(1, HQ, c).float() - s.logsumexp(-1)).abs().max())
            t = cuda_time(lambda q=q, k=k, v=v: op(q, k, v, None, True, 0.0, True, False, scale=D**-0.5))
            entry["seconds"] = t
            entry["tflops"] = 2 * 2 * D * HQ * c * (c + 1) / 2 / t / 1e12
        except Exception as e:
            entry["error"] = repr(e)[:300]
        res[c] = entry
        print(c, entry, flush=True)
    Path(sys.argv[1]).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
