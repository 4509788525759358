"""Probe: cached-prefix attention through cuDNN's fused attention (torch's private op, with LSE) on a
gathered contiguous copy of the prefix, queries of a GQA group folded into rows; more Triton tiles.

    python benchmarks/prefill_cascade_probe.py OUT.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from prefill_kernel_probe import cuda_time  # noqa: E402

HQ, HKV, D, BS = 32, 8, 128, 16
G = HQ // HKV


def main() -> None:
    out_path = sys.argv[1]
    dev = torch.device("cuda")
    torch.manual_seed(0)
    n = 131072
    nb = n // BS
    perm = torch.randperm(nb, device=dev)
    k_cache = torch.randn(nb, BS, HKV, D, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    res: dict = {}
    c = 2048
    q = torch.randn(c, HQ, D, device=dev, dtype=torch.bfloat16)
    scale = D**-0.5
    for name in ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention"):
        op = getattr(torch.ops.aten, name)
        res[name] = {"schema": str(op.default._schema)[:500]}
        print(res[name]["schema"], flush=True)
        for p in (8192, 65536, 126976):
            pages = perm[: p // BS]

            def run(pages=pages, p=p, op=op, name=name):
                k = k_cache[pages].view(1, p, HKV, D).transpose(1, 2)
                v = v_cache[pages].view(1, p, HKV, D).transpose(1, 2)
                qf = q.view(c, HKV, G, D).permute(1, 2, 0, 3).reshape(1, HKV, G * c, D)
                if "cudnn" in name:
                    o = op(qf, k, v, None, True, 0.0, False, False, scale=scale)
                else:
                    o = op(qf, k, v, 0.0, False, False, scale=scale)
                return o[0], o[1]

            try:
                o, lse = run()
                k = k_cache[pages].view(p, HKV, D).float()
                v = v_cache[pages].view(p, HKV, D).float()
                kk, vv = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
                s = torch.einsum("qhd,khd->hqk", q[:256].float(), kk) * scale
                ref_lse = torch.logsumexp(s, -1)  # [HQ, 256]
                ref = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vv)
                o_unf = o[0].view(HKV, G, c, D).permute(2, 0, 1, 3).reshape(c, HQ, D)[:256]
                lse_unf = lse[0].view(HKV, G, c).permute(2, 0, 1).reshape(c, HQ)[:256].T
                err = float((o_unf.float() - ref).abs().max())
                lerr = float((lse_unf.float() - ref_lse).abs().max())
                t = cuda_time(run, reps=5)
                fl = 4 * D * HQ * c * p
                res[name][p] = {"seconds": t, "tflops": fl / t / 1e12, "err": err, "lse_err": lerr,
                                "lse_shape": list(lse.shape), "lse_dtype": str(lse.dtype)}  # fmt: skip
                print(name, p, res[name][p], flush=True)
                kg = k_cache[pages]
                tg = cuda_time(lambda pages=pages: k_cache[pages], reps=5)
                res[name][p]["gather_k_seconds"] = tg
                del kg
            except Exception as e:
                res[name][p] = {"error": repr(e)[:400]}
                print(name, p, "error", repr(e)[:400], flush=True)
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
