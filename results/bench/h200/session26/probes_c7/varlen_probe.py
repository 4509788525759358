"""Session 26 call 7: torch's cuDNN varlen attention (`_cudnn_attention_forward`): its schema here, whether a
causal mask aligns bottom-right with cumulative lengths (q shorter than k), whether its plans are keyed by the
actual lengths or by the tensors' sizes and max lengths (a new key length under fixed sizes: fast or ~35 ms),
paged K/V through block_table, and its speed for 2048 queries over 129,024 keys (the 128K prefill's last chunk)."""
import time, traceback
import torch
op = torch.ops.aten._cudnn_attention_forward
print(torch.__version__, op.default._schema, flush=True)
HQ, HKV, D = 32, 8, 128
SC = D**-0.5
def ref(q, k, v, align):  # q [T, HQ, D], k [N, HKV, D]
    T, N = q.shape[0], k.shape[0]
    kk = k.repeat_interleave(HQ // HKV, 1).float(); vv = v.repeat_interleave(HQ // HKV, 1).float()
    s = torch.einsum("thd,nhd->htn", q.float(), kk) * SC
    i = torch.arange(T, device=q.device)[:, None]; j = torch.arange(N, device=q.device)[None, :]
    s = s.masked_fill(j > i + (N - T if align == "br" else 0), float("-inf"))
    return torch.einsum("htn,nhd->thd", torch.softmax(s, -1), vv)
def call(q, k, v, cq, ck, mq, mk, causal, **kw):
    return op(q, k, v, None, cq, ck, mq, mk, True, 0.0, causal, False, scale=SC, **kw)
dev = "cuda"
def i32(*xs): return torch.tensor(xs, dtype=torch.int32, device=dev)
try:
    T, N = 128, 384
    q = torch.randn(T, HQ, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(N, HKV, D, device=dev, dtype=torch.bfloat16); v = torch.randn_like(k)
    res = call(q, k, v, i32(0, T), i32(0, N), T, N, True)
    o = res[0]
    print("varlen out", tuple(o.shape), o.stride(), "lse", tuple(res[1].shape), res[1].stride(), flush=True)
    for a in ("tl", "br"):
        print("varlen causal", a, "max err", (o.float().reshape(T, HQ, D) - ref(q, k, v, a)).abs().max().item(), flush=True)
    res = call(q, k, v, i32(0, T), i32(0, N), T, N, False)
    print("varlen non-causal err", (res[0].float().reshape(T, HQ, D) - ref(q, k, v, "br").new_zeros(1) - 0).abs().max().item() if False else "skip", flush=True)
except Exception:
    traceback.print_exc()
# plan keys: a fixed-size k (Nmax) with a different used length each call
try:
    T, NMAX = 2048, 16384
    q = torch.randn(T, HQ, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(NMAX, HKV, D, device=dev, dtype=torch.bfloat16); v = torch.randn_like(k)
    for n in (8192, 10240, 12288, 16384, 12288):
        torch.cuda.synchronize(); t = time.perf_counter()
        res = call(q, k, v, i32(0, T), i32(0, n), T, NMAX, True)
        torch.cuda.synchronize(); ms = 1e3 * (time.perf_counter() - t)
        err = (res[0].float().reshape(T, HQ, D)[-64:] - ref(q[-64:], k[:n], v[:n], "br")).abs().max().item()
        print(f"fixed sizes, used k {n}: {ms:.1f} ms, last 64 rows vs bottom-right ref {err:.4f}", flush=True)
    for n in (8192, 10240):
        kk, vv = k[:n].contiguous(), v[:n].contiguous()
        torch.cuda.synchronize(); t = time.perf_counter()
        call(q, kk, vv, i32(0, T), i32(0, n), T, n, True)
        torch.cuda.synchronize(); print(f"exact sizes {n}: {1e3 * (time.perf_counter() - t):.1f} ms", flush=True)
except Exception:
    traceback.print_exc()
# paged K/V through block_table
try:
    T, N, BS = 256, 4096, 16
    nb = N // BS
    q = torch.randn(T, HQ, D, device=dev, dtype=torch.bfloat16)
    kc = torch.randn(nb * 2, BS, HKV, D, device=dev, dtype=torch.bfloat16); vc = torch.randn_like(kc)
    table = torch.randperm(nb * 2, device=dev)[:nb].int()
    k = kc[table.long()].reshape(N, HKV, D); v = vc[table.long()].reshape(N, HKV, D)
    for name, kk, vv in (("[blocks, bs, H, D]", kc, vc), ("[blocks, H, bs, D]", kc.transpose(1, 2), vc.transpose(1, 2))):
        try:
            res = call(q, kk, vv, i32(0, T), i32(0, N), T, N, True, seqused_k=i32(N), block_table=table[None])
            print("paged", name, "err br", (res[0].float().reshape(T, HQ, D) - ref(q, k, v, "br")).abs().max().item(), flush=True)
        except Exception as e:
            print("paged", name, "error", repr(e)[:400], flush=True)
except Exception:
    traceback.print_exc()
# speed at the 128K prefill's last chunk
try:
    T, N = 2048, 131072
    q = torch.randn(T, HQ, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(N, HKV, D, device=dev, dtype=torch.bfloat16); v = torch.randn_like(k)
    for r in range(2):
        call(q, k, v, i32(0, T), i32(0, N), T, N, True)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for r in range(10):
        call(q, k, v, i32(0, T), i32(0, N), T, N, True)
    e1.record(); torch.cuda.synchronize(); ms = e0.elapsed_time(e1) / 10
    fl = 4 * T * HQ * D * (N - T + T / 2)
    print(f"varlen causal 2048 over 131072: {ms:.3f} ms, {fl / ms / 1e9:.0f} TFLOP/s", flush=True)
except Exception:
    traceback.print_exc()
