"""Which keep kinds does the compaction kernel get wrong on the GPU, and do volatile loads fix it?"""
import sys, torch, triton, triton.language as tl
sys.path.insert(0, "packages/sparse-kernels/tests")
from test_compact import _hazard_keep, _run_compact

@triton.jit
def _k(k_ptr, v_ptr, slot_indptr_ptr, slot_ids_ptr, keep_indptr_ptr, keep_ptr, stride_keep_h,
       NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
       VOLATILE: tl.constexpr, TWO_BARRIERS: tl.constexpr):
    r = tl.program_id(0); h = tl.program_id(1)
    slot_lo = tl.load(slot_indptr_ptr + r); keep_lo = tl.load(keep_indptr_ptr + r)
    num_keep = tl.load(keep_indptr_ptr + r + 1) - keep_lo
    offs_d = tl.arange(0, BLOCK_D); mask_d = offs_d < HEAD_DIM
    for i0 in range(0, num_keep, BLOCK):
        offs = i0 + tl.arange(0, BLOCK); mask = offs < num_keep
        src_pos = tl.load(keep_ptr + h * stride_keep_h + keep_lo + offs, mask=mask, other=0)
        src = tl.load(slot_ids_ptr + slot_lo + src_pos, mask=mask, other=0).to(tl.int64)
        dst = tl.load(slot_ids_ptr + slot_lo + offs, mask=mask, other=0).to(tl.int64)
        m2 = mask[:, None] & mask_d[None, :]
        src_off = (src[:, None] * NUM_KV_HEADS + h) * HEAD_DIM + offs_d[None, :]
        dst_off = (dst[:, None] * NUM_KV_HEADS + h) * HEAD_DIM + offs_d[None, :]
        k = tl.load(k_ptr + src_off, mask=m2, volatile=VOLATILE)
        v = tl.load(v_ptr + src_off, mask=m2, volatile=VOLATILE)
        tl.debug_barrier()
        tl.store(k_ptr + dst_off, k, mask=m2)
        tl.store(v_ptr + dst_off, v, mask=m2)
        if TWO_BARRIERS:
            tl.debug_barrier()

def launch(volatile, two, block=64, warps=4):
    def run(k_cache, v_cache, slot_indptr, slot_ids, keep_indptr, keep):
        H, D = k_cache.shape[2], k_cache.shape[3]
        _k[(slot_indptr.numel() - 1, H)](k_cache, v_cache, slot_indptr, slot_ids, keep_indptr, keep, keep.stride(0),
            NUM_KV_HEADS=H, HEAD_DIM=D, BLOCK=block, BLOCK_D=triton.next_power_of_2(D), VOLATILE=volatile,
            TWO_BARRIERS=two, num_warps=warps, num_stages=1)
    return run

gen = torch.Generator().manual_seed(0)
H, D = 8, 128
for kind in ["dense", "drop_one_early", "tail", "jumps", "random"]:
    lengths, kept = [8448] * 6 + [300], [8192] * 6 + [129]
    nblocks = sum(lengths) // 4 + 3
    perm = torch.randperm(nblocks * 4, generator=gen)
    slot_lists, keep, s = [], [], 0
    for n, m in zip(lengths, kept):
        slot_lists.append(perm[s:s + n]); s += n
        keep.append(_hazard_keep(kind, n, m, gen)[None].expand(H, -1).contiguous())
    kc = torch.randn(nblocks, 4, H, D, generator=gen).bfloat16(); vc = torch.randn(nblocks, 4, H, D, generator=gen).bfloat16()
    k_ref, v_ref = _run_compact(kc, vc, slot_lists, keep, "cpu")
    for volatile, two in [(False, False), (True, False), (False, True)]:
        for block, warps in [(64, 4), (128, 8)]:
            k_got, v_got = _run_compact(kc, vc, slot_lists, keep, "cuda", launch(volatile, two, block, warps))
            badk = (k_got != k_ref).flatten(2).any(-1).flatten().nonzero().flatten()
            print(f"{kind:15s} volatile={volatile:d} two_barriers={two:d} block={block} warps={warps}: "
                  f"bad K slots {len(badk)} V equal {torch.equal(v_got, v_ref)} first {badk[:6].tolist()}", flush=True)
    # the committed kernel
    from sparse_kernels._triton.compact import compact_kv_triton
    k_got, v_got = _run_compact(kc, vc, slot_lists, keep, "cuda", compact_kv_triton)
    print(f"{kind:15s} committed kernel: equal {torch.equal(k_got, k_ref) and torch.equal(v_got, v_ref)}", flush=True)
