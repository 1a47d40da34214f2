/* The engine-paired forms in C: the fp32 operations of vLLM-CPU's `vec` kernels, in their order.
 * Attention (rla_compile/sites/attention/vllm_cpu.py): one request at a time. The MoE experts
 * (rla_compile/integrations/experts_vllm_cpu.py, at the end of this file): the expert GEMMs,
 * the gated SiLU and the weighted sum of the fused MoE kernel.
 * Built by rla_compile/native.py with -ffp-contract=off and without
 * -ffast-math, so that every `a * b + c` below is a multiply and an add, each rounded, and
 * fmaf() is the one fused multiply-add; expf() is the C library's, which the kernel's AVX2
 * build calls too. Vectorising the loops (over keys, over the value dimension) keeps each
 * element's operations and their order: the compiler may do that, and nothing else.
 *
 * The Python form in attention_vllm_cpu.py is the reference (tests/test_attention_vllm_cpu.py
 * checks this file against it bit for bit); the comments name its steps. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16
#define LOWEST (-3.4028234663852886e38f) /* the running max's start */
#define MASKED (-1e37f)                  /* an additive mask at or below: -inf */

static float from_bits(uint32_t bits) {
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* The AVX-512 build's exp (DEFINE_FAST_EXP): _fast_expf in the reference. */
static float fast_expf(float x) {
    const float ln_min = from_bits(0xc2aeac50u), ln_max = from_bits(0x42b17218u);
    const float log2e = from_bits(0x3fb8aa3bu), ln2 = from_bits(0x3f317218u);
    /* the reference writes its constants as Python floats rounded to fp32 */
    const float poly[6] = {(float)0.00828929059, (float)0.0418978221, (float)0.166676521,
                           (float)0.499991506, (float)0.999999701, 1.0f};
    float src = fminf(fmaxf(x, ln_min), ln_max);
    float fx = floorf(fmaf(src, log2e, 0.5f));
    float r = fmaf(-fx, ln2, src);
    float res = poly[0];
    for (int i = 1; i < 6; i++) res = fmaf(r, res, poly[i]);
    uint32_t pow2_bits = (uint32_t)(((int32_t)(fx - 1.0f) + 127) << 23);
    res = res * (x < ln_min ? 0.0f : from_bits(pow2_bits));
    return res + res;
}

/* _lane_sum: 16 lanes, each summed in key order from 0, then reduced as the build does. */
static float lane_sum(const float *p, int64_t n, int fused) {
    float a[LANES] = {0};
    for (int64_t j = 0; j < n; j += LANES)
        for (int l = 0; l < LANES; l++) a[l] = a[l] + (j + l < n ? p[j + l] : 0.0f);
    if (!fused) {
        float lo = a[0] + 0.0f, hi = a[8] + 0.0f;
        for (int i = 1; i < 8; i++) {
            lo = lo + a[i];
            hi = hi + a[8 + i];
        }
        return lo + hi;
    }
    float s[8], t[4];
    for (int i = 0; i < 8; i++) s[i] = a[i + 8] + a[i];
    for (int i = 0; i < 4; i++) t[i] = s[i + 4] + s[i];
    return (t[2] + t[0]) + (t[3] + t[1]);
}

#define ROWS 8 /* query rows computed together: each k and v row loaded once for all of them */

/* One request, heads first_head..last_head-1 (callers split the heads over threads): q (scaled),
 * k [heads, tokens, dim], v [heads, tokens, vdim], all contiguous; bias [bias_heads, tokens,
 * tokens] (bias_heads 1 or heads) or NULL (causal); tiles[i] the row's key-block size and
 * limits[i] where its block loop stops (the reference's loop bound); out [heads, tokens, vdim].
 * Returns 0, or -1 when out of memory.
 *
 * Rows are taken ROWS at a time where their tiles and limits agree; each row's every value is
 * still the reference's chain in the reference's order (only independent chains interleave).
 * Causal, a row computes no key after its own: the reference's scores there are -inf, whose
 * p = exp(-inf - m) is +0, and +0 leaves every max, lane sum, total and (for finite v)
 * accumulator as it was, bit for bit; so are whole blocks past the row's own keys skipped. */
int rla_vllm_cpu_vec_attention(const float *q, const float *k, const float *v, const float *bias,
                               int64_t bias_heads, int64_t heads, int64_t tokens, int64_t dim,
                               int64_t vdim, const int64_t *tiles, const int64_t *limits, int fused,
                               float *out, int64_t first_head, int64_t last_head) {
    (void)heads;
    float *kt = malloc(sizeof(float) * dim * tokens);
    float *s = malloc(sizeof(float) * ROWS * tokens);
    float *p = malloc(sizeof(float) * ROWS * tokens);
    float *acc = malloc(sizeof(float) * ROWS * vdim);
    if (!kt || !s || !p || !acc) {
        free(kt), free(s), free(p), free(acc);
        return -1;
    }
    for (int64_t h = first_head; h < last_head; h++) {
        const float *qh = q + h * tokens * dim, *kh = k + h * tokens * dim, *vh = v + h * tokens * vdim;
        const float *bh = bias ? bias + (bias_heads == 1 ? 0 : h) * tokens * tokens : NULL;
        for (int64_t j = 0; j < tokens; j++)
            for (int64_t d = 0; d < dim; d++) kt[d * tokens + j] = kh[j * dim + d];
        for (int64_t i0 = 0; i0 < tokens;) {
            int64_t rows = 1;
            while (rows < ROWS && i0 + rows < tokens && tiles[i0 + rows] == tiles[i0] && limits[i0 + rows] == limits[i0])
                rows++;
            int64_t ends[ROWS], n[ROWS]; /* keys a row scores; of them, in the current block */
            float m[ROWS], total[ROWS];
            for (int64_t r = 0; r < rows; r++) ends[r] = bh ? tokens : i0 + r + 1;
            /* scores: each a chain over the head dimension from 0 (the loops over keys inside) */
            for (int64_t r = 0; r < rows; r++)
                for (int64_t j = 0; j < ends[r]; j++) s[r * tokens + j] = 0.0f;
            for (int64_t d = 0; d < dim; d++) {
                const float *kd = kt + d * tokens;
                for (int64_t r = 0; r < rows; r++) {
                    const float qd = qh[(i0 + r) * dim + d];
                    float *sr = s + r * tokens;
                    const int64_t end = ends[r];
                    if (fused)
                        for (int64_t j = 0; j < end; j++) sr[j] = fmaf(qd, kd[j], sr[j]);
                    else
                        for (int64_t j = 0; j < end; j++) sr[j] = sr[j] + qd * kd[j];
                }
            }
            if (bh)
                for (int64_t r = 0; r < rows; r++) {
                    const float *bi = bh + (i0 + r) * tokens;
                    float *sr = s + r * tokens;
                    for (int64_t j = 0; j < tokens; j++) sr[j] = bi[j] <= MASKED ? -INFINITY : sr[j] + bi[j];
                }
            /* online softmax over blocks of tiles[i] keys, P · V key by key */
            const int64_t tile = tiles[i0], limit = limits[i0];
            for (int64_t r = 0; r < rows; r++) {
                m[r] = LOWEST, total[r] = 0.0f;
                for (int64_t e = 0; e < vdim; e++) acc[r * vdim + e] = 0.0f;
            }
            for (int64_t c0 = 0; c0 < limit; c0 += tile) {
                const int64_t c1 = c0 + tile < tokens ? c0 + tile : tokens;
                int64_t widest = 0;
                for (int64_t r = 0; r < rows; r++) {
                    n[r] = (c1 < ends[r] ? c1 : ends[r]) - c0;
                    if (n[r] <= 0) { /* the block holds none of the row's keys */
                        n[r] = 0;
                        continue;
                    }
                    widest = n[r] > widest ? n[r] : widest;
                    const float *sr = s + r * tokens + c0;
                    float *pr = p + r * tokens, block_max = -INFINITY;
                    for (int64_t j = 0; j < n[r]; j++) block_max = sr[j] > block_max ? sr[j] : block_max;
                    const float m_new = m[r] > block_max ? m[r] : block_max, diff = m[r] - m_new;
                    const int grows = diff < -8.0f;
                    if (grows) m[r] = m_new;
                    for (int64_t j = 0; j < n[r]; j++) pr[j] = fused ? fast_expf(sr[j] - m[r]) : expf(sr[j] - m[r]);
                    const float block_sum = lane_sum(pr, n[r], fused), alpha = expf(diff);
                    if (grows) {
                        total[r] = fused ? fmaf(total[r], alpha, block_sum) : block_sum + alpha * total[r];
                        for (int64_t e = 0; e < vdim; e++) acc[r * vdim + e] = acc[r * vdim + e] * alpha;
                    } else {
                        total[r] = block_sum + total[r];
                    }
                }
                for (int64_t j = 0; j < widest; j++) {
                    const float *vj = vh + (c0 + j) * vdim;
                    for (int64_t r = 0; r < rows; r++) {
                        if (j >= n[r]) continue;
                        const float pj = p[r * tokens + j];
                        float *ar = acc + r * vdim;
                        if (fused)
                            for (int64_t e = 0; e < vdim; e++) ar[e] = fmaf(pj, vj[e], ar[e]);
                        else
                            for (int64_t e = 0; e < vdim; e++) ar[e] = ar[e] + pj * vj[e];
                    }
                }
            }
            for (int64_t r = 0; r < rows; r++) {
                const float inv = 1.0f / total[r];
                float *oi = out + (h * tokens + i0 + r) * vdim;
                for (int64_t e = 0; e < vdim; e++) oi[e] = inv * acc[r * vdim + e];
            }
            i0 += rows;
        }
    }
    free(kt), free(s), free(p), free(acc);
    return 0;
}

/* ---- MoE experts: cpu_fused_moe.cpp (isa vec), checked against its Python form in
 * experts_vllm_cpu.py and against vLLM's kernel (tests/test_vllm.py) bit for bit ---- */

/* out[m, n] = a[m, :] . w[:, n] with w given transposed, wt [k, n]: each element one chain of
 * fused multiply-adds over k from 0 (the micro GEMM's c = c + a * b, contracted). */
void rla_vllm_cpu_moe_gemm(const float *a, const float *wt, int64_t m, int64_t n, int64_t k, float *out) {
    for (int64_t i = 0; i < m; i++) {
        float *oi = out + i * n;
        for (int64_t j = 0; j < n; j++) oi[j] = 0.0f;
        for (int64_t kk = 0; kk < k; kk++) {
            const float aik = a[i * k + kk], *wk = wt + kk * n;
            for (int64_t j = 0; j < n; j++) oi[j] = fmaf(aik, wk[j], oi[j]);
        }
    }
}

/* silu_and_mul: gate_up [m, 2 * inter] (gate, then up) -> out [m, inter], fp32 (the caller
 * rounds it to the model dtype, as the kernel stores it): up * (gate * 1 / (1 + exp(-gate))). */
void rla_vllm_cpu_moe_silu_mul(const float *gate_up, int64_t m, int64_t inter, float *out) {
    for (int64_t i = 0; i < m; i++) {
        const float *g = gate_up + i * 2 * inter, *u = g + inter;
        for (int64_t j = 0; j < inter; j++) {
            const float sigmoid = 1.0f / (1.0f + fast_expf(-g[j]));
            out[i * inter + j] = u[j] * (g[j] * sigmoid);
        }
    }
}

/* The weighted sum: y [tokens, topk, hidden] (the down GEMM's fp32 outputs, slot order),
 * weights [tokens, topk] -> out [tokens, hidden] fp32 (rounded once by the caller):
 * w0 * y0, then fma(y_j, w_j, acc) for each later slot. */
void rla_vllm_cpu_moe_combine(const float *y, const float *w, int64_t tokens, int64_t topk, int64_t hidden,
                              float *out) {
    for (int64_t t = 0; t < tokens; t++) {
        float *ot = out + t * hidden;
        const float *yt = y + t * topk * hidden, *wt = w + t * topk;
        for (int64_t e = 0; e < hidden; e++) ot[e] = yt[e] * wt[0];
        for (int64_t j = 1; j < topk; j++)
            for (int64_t e = 0; e < hidden; e++) ot[e] = fmaf(yt[j * hidden + e], wt[j], ot[e]);
    }
}
