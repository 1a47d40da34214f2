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

/* One request: q (scaled), k [heads, tokens, dim], v [heads, tokens, vdim], all contiguous;
 * bias [bias_heads, tokens, tokens] (bias_heads 1 or heads) or NULL (causal); tiles[i] the
 * row's key-block size and limits[i] where its block loop stops (the reference's loop bound);
 * out [heads, tokens, vdim]. Returns 0, or -1 when out of memory. */
int rla_vllm_cpu_vec_attention(const float *q, const float *k, const float *v, const float *bias,
                               int64_t bias_heads, int64_t heads, int64_t tokens, int64_t dim,
                               int64_t vdim, const int64_t *tiles, const int64_t *limits, int fused,
                               float *out) {
    float *kt = malloc(sizeof(float) * dim * tokens);
    float *s = malloc(sizeof(float) * tokens);
    float *p = malloc(sizeof(float) * tokens);
    float *acc = malloc(sizeof(float) * vdim);
    if (!kt || !s || !p || !acc) {
        free(kt), free(s), free(p), free(acc);
        return -1;
    }
    for (int64_t h = 0; h < heads; h++) {
        const float *qh = q + h * tokens * dim, *kh = k + h * tokens * dim, *vh = v + h * tokens * vdim;
        const float *bh = bias ? bias + (bias_heads == 1 ? 0 : h) * tokens * tokens : NULL;
        for (int64_t j = 0; j < tokens; j++)
            for (int64_t d = 0; d < dim; d++) kt[d * tokens + j] = kh[j * dim + d];
        for (int64_t i = 0; i < tokens; i++) {
            const float *qi = qh + i * dim;
            /* scores: each a chain over the head dimension from 0 (the loop runs over keys
             * inside, so it vectorises without reordering any chain) */
            for (int64_t j = 0; j < tokens; j++) s[j] = 0.0f;
            for (int64_t d = 0; d < dim; d++) {
                const float qd = qi[d], *kd = kt + d * tokens;
                if (fused)
                    for (int64_t j = 0; j < tokens; j++) s[j] = fmaf(qd, kd[j], s[j]);
                else
                    for (int64_t j = 0; j < tokens; j++) s[j] = s[j] + qd * kd[j];
            }
            if (bh) {
                const float *bi = bh + i * tokens;
                for (int64_t j = 0; j < tokens; j++) s[j] = bi[j] <= MASKED ? -INFINITY : s[j] + bi[j];
            } else {
                for (int64_t j = i + 1; j < tokens; j++) s[j] = -INFINITY;
            }
            /* online softmax over blocks of tiles[i] keys, P · V key by key */
            const int64_t tile = tiles[i];
            float m = LOWEST, total = 0.0f;
            for (int64_t e = 0; e < vdim; e++) acc[e] = 0.0f;
            for (int64_t c0 = 0; c0 < limits[i]; c0 += tile) {
                const int64_t c1 = c0 + tile < tokens ? c0 + tile : tokens, n = c1 - c0;
                float block_max = -INFINITY;
                for (int64_t j = c0; j < c1; j++) block_max = s[j] > block_max ? s[j] : block_max;
                const float m_new = m > block_max ? m : block_max, diff = m - m_new;
                const int grows = diff < -8.0f;
                if (grows) m = m_new;
                for (int64_t j = 0; j < n; j++) p[j] = fused ? fast_expf(s[c0 + j] - m) : expf(s[c0 + j] - m);
                const float block_sum = lane_sum(p, n, fused), alpha = expf(diff);
                if (grows) {
                    total = fused ? fmaf(total, alpha, block_sum) : block_sum + alpha * total;
                    for (int64_t e = 0; e < vdim; e++) acc[e] = acc[e] * alpha;
                } else {
                    total = block_sum + total;
                }
                for (int64_t j = 0; j < n; j++) {
                    const float pj = p[j], *vj = vh + (c0 + j) * vdim;
                    if (fused)
                        for (int64_t e = 0; e < vdim; e++) acc[e] = fmaf(pj, vj[e], acc[e]);
                    else
                        for (int64_t e = 0; e < vdim; e++) acc[e] = acc[e] + pj * vj[e];
                }
            }
            const float inv = 1.0f / total;
            float *oi = out + (h * tokens + i) * vdim;
            for (int64_t e = 0; e < vdim; e++) oi[e] = inv * acc[e];
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
