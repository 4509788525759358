"""Session 26: does torch's cuDNN attention align a causal mask bottom-right when s_q < s_kv (GQA, strided q)?
Is the varlen op there, and what does a fused merge of the cascade cost against torch's chain?"""
import time, torch
op = torch.ops.aten._scaled_dot_product_cudnn_attention
torch.manual_seed(0)
HQ, HKV, D = 32, 8, 128
def ref(q, k, v, align):  # q [1,HQ,T,D], k [1,HKV,N,D]
    T, N = q.shape[2], k.shape[2]
    kk = k.repeat_interleave(HQ // HKV, 1).float(); vv = v.repeat_interleave(HQ // HKV, 1).float()
    s = q.float() @ kk.transpose(-1, -2) * D**-0.5
    i = torch.arange(T, device=q.device)[:, None]; j = torch.arange(N, device=q.device)[None, :]
    mask = j > i + (N - T if align == "br" else 0)
    s = s.masked_fill(mask, float("-inf"))
    return torch.softmax(s, -1) @ vv
for T, N in [(128, 384), (256, 256 + 4096)]:
    qt = torch.randn(T, HQ, D, device="cuda", dtype=torch.bfloat16)
    q = qt.view(1, T, HQ, D).transpose(1, 2)  # strided, no copy
    k = torch.randn(1, N, HKV, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    v = torch.randn_like(k)
    try:
        o = op(q, k, v, None, True, 0.0, True, False, scale=D**-0.5)[0]
        for a in ("tl", "br"):
            print(T, N, a, "max err", (o.float() - ref(q, k, v, a)).abs().max().item(), "out strides", o.stride())
    except Exception as e:
        print(T, N, "error", repr(e)[:300])
print("varlen op:", hasattr(torch.ops.aten, "_cudnn_attention_forward"))
# plan-build cost of a strided (unfolded) q against the folded one, per new s_kv
for N in (8192, 12288):
    q = torch.randn(2048, HQ, D, device="cuda", dtype=torch.bfloat16).view(1, 2048, HQ, D).transpose(1, 2)
    k = torch.randn(1, N, HKV, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2); v = torch.randn_like(k)
    for r in range(3):
        torch.cuda.synchronize(); t = time.perf_counter(); op(q, k, v, None, True, 0.0, False, False, scale=D**-0.5)
        torch.cuda.synchronize(); print("unfolded GQA non-causal", N, "%.2f ms" % (1e3 * (time.perf_counter() - t)))
# speed: 2048 queries over 126976 + 2048 keys, causal bottom-right in one call vs the prefix part alone
for causal, N in ((False, 126976), (True, 126976 + 2048)):
    q = torch.randn(2048, HQ, D, device="cuda", dtype=torch.bfloat16).view(1, 2048, HQ, D).transpose(1, 2)
    k = torch.randn(1, N, HKV, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2); v = torch.randn_like(k)
    for r in range(2):
        op(q, k, v, None, True, 0.0, causal, False, scale=D**-0.5)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for r in range(10):
        op(q, k, v, None, True, 0.0, causal, False, scale=D**-0.5)
    e1.record(); torch.cuda.synchronize()
    ms = e0.elapsed_time(e1) / 10
    fl = 4 * 2048 * HQ * D * (126976 + (1024 if causal else 0))
    print("unfolded", "causal" if causal else "prefix", N, "%.3f ms %.0f TFLOP/s" % (ms, fl / ms / 1e9))
