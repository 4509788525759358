"""KIVI decode over half-word-interleaved codes: slices instead of reshapes (probe)."""
import triton
import triton.language as tl


@triton.jit
def _half(codes16):
    # int16 codes in [0, 1024) -> fp16 exactly
    return (codes16 | 0x6400).to(tl.float16, bitcast=True) - 1024.0


@triton.jit
def kivi_v2_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, indptr_ptr, indices_ptr, last_len_ptr,
    o_part_ptr, lse_part_ptr, stride_qb, stride_qh, scale_log2, num_splits,
    BITS: tl.constexpr, NH: tl.constexpr, CPH: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, VGROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    KFMA: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    page_lo = tl.load(indptr_ptr + b)
    page_hi = tl.load(indptr_ptr + b + 1)
    kv_len = (page_hi - page_lo - 1) * PAGE + tl.load(last_len_ptr + b)
    chunk = tl.cdiv(tl.cdiv(kv_len, num_splits), PAGE) * PAGE
    lo = split * chunk
    if lo < kv_len:
        hi = tl.minimum(lo + chunk, kv_len)
        full = (kv_len // PAGE) * PAGE
        offs_g = tl.arange(0, BLOCK_G)
        offs_u = tl.arange(0, NH)
        offs_t = tl.arange(0, PAGE)
        mask_g = offs_g < GROUP
        heads = h * GROUP + offs_g
        qrow = q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_u[None, :]
        MASK: tl.constexpr = (1 << BITS) - 1
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc0 = tl.zeros([BLOCK_G, NH], tl.float32)
        acc1 = tl.zeros([BLOCK_G, NH], tl.float32)
        acc2 = tl.zeros([BLOCK_G, NH], tl.float32)
        acc3 = tl.zeros([BLOCK_G, NH], tl.float32)
        acc4 = tl.zeros([BLOCK_G, NH], tl.float32)
        acc5 = tl.zeros([BLOCK_G, NH], tl.float32)
        acc6 = tl.zeros([BLOCK_G, NH], tl.float32)
        acc7 = tl.zeros([BLOCK_G, NH], tl.float32)
        for start in range(lo, tl.minimum(hi, full), PAGE):
            block = tl.load(indices_ptr + page_lo + start // PAGE).to(tl.int64)
            rows = (block * PAGE + offs_t) * NUM_KV_HEADS + h  # [PAGE]
            kw = tl.load(k_ptr + rows[None, :] * NH + offs_u[:, None])  # [NH, PAGE] int16
            vw = tl.load(v_ptr + rows[:, None] * NH + offs_u[None, :])  # [PAGE, NH] int16
            stat = (block * NUM_KV_HEADS + h) * HEAD_DIM
            s = tl.zeros([BLOCK_G, PAGE], tl.float32)
            zsum = tl.zeros([BLOCK_G, NH], tl.float32)
            for j in tl.static_range(CPH):
                qj = tl.load(qrow + j * NH, mask=mask_g[:, None], other=0.0).to(tl.float32) * scale_log2
                ksj = tl.load(ks_ptr + stat + j * NH + offs_u).to(tl.float32)
                kzj = tl.load(kz_ptr + stat + j * NH + offs_u).to(tl.float32)
                cj = _half((kw >> (j * BITS)) & MASK)  # [NH, PAGE]
                s = tl.dot((qj * ksj[None, :]).to(tl.float16), cj, s)
                zsum += qj * kzj[None, :]
            s = s + tl.sum(zsum, 1)[:, None]
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
            p16 = p.to(tl.float16)
            vrow = rows * (HEAD_DIM // VGROUP)
            for j in tl.static_range(CPH):
                grp = j * NH // VGROUP
                vsj = tl.load(vs_ptr + vrow + grp)  # [PAGE] fp16 (VGROUP % NH == 0)
                vzj = tl.load(vz_ptr + vrow + grp)
                cj = ((vw >> (j * BITS)) & MASK | 0x6400).to(tl.float16, bitcast=True)  # 1024 + c
                vj = cj * vsj[:, None] + (vzj - 1024.0 * vsj)[:, None]
                pv = tl.dot(p16, vj.to(tl.float16))
                if j == 0:
                    acc0 = acc0 * alpha[:, None] + pv
                elif j == 1:
                    acc1 = acc1 * alpha[:, None] + pv
                elif j == 2:
                    acc2 = acc2 * alpha[:, None] + pv
                elif j == 3:
                    acc3 = acc3 * alpha[:, None] + pv
                elif j == 4:
                    acc4 = acc4 * alpha[:, None] + pv
                elif j == 5:
                    acc5 = acc5 * alpha[:, None] + pv
                elif j == 6:
                    acc6 = acc6 * alpha[:, None] + pv
                else:
                    acc7 = acc7 * alpha[:, None] + pv
        row = (b * (NUM_KV_HEADS * GROUP) + heads) * num_splits + split
        out = o_part_ptr + row[:, None] * HEAD_DIM + offs_u[None, :]
        inv = 1.0 / l_i[:, None]
        mg = mask_g[:, None]
        tl.store(out, acc0 * inv, mask=mg)
        tl.store(out + NH, acc1 * inv, mask=mg)
        if CPH > 2:
            tl.store(out + 2 * NH, acc2 * inv, mask=mg)
            tl.store(out + 3 * NH, acc3 * inv, mask=mg)
        if CPH > 4:
            tl.store(out + 4 * NH, acc4 * inv, mask=mg)
            tl.store(out + 5 * NH, acc5 * inv, mask=mg)
            tl.store(out + 6 * NH, acc6 * inv, mask=mg)
            tl.store(out + 7 * NH, acc7 * inv, mask=mg)
        tl.store(lse_part_ptr + row, m_i + tl.log2(l_i), mask=mask_g)
