/* Many-token products y[t, :] = W x[t, :] on 16-bit activations, for Q4_0, Q4_1, Q8_0, Q4_K and
 * Q5_K rows (qgemm_q16x): each 32-value block of a row of x rounded with scale max|x| / 32767 as
 * qmatvec16.c does, the weight's integer codes times those int16 activations summed exactly in
 * int32 by AVX512-VNNI (vpdpwssd), then scaled per 32 values in float32; a block's min (Q4_1,
 * Q4_K, Q5_K) and Q4_0's -8 offset multiply the float32 block sum of x. The same arithmetic as
 * qmatvec_q16x up to the order of float32 additions, so prefill and decode round alike.
 *
 * Each task decodes the codes of 32 rows once (int16 pairs laid out 16 rows to a 512-bit
 * vector) and multiplies them with every token, 6 tokens x 32 rows at a time. Compiled for
 * AVX-512 (the pragma below): call only where the CPU has avx512f/bw/dq/vl/vnni. */
#include <math.h>
#include <stdlib.h>

#include "gguf_blocks.h"

#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")

#define ROWS 32  /* rows per task: two 16-lane groups */
#define TT 6     /* tokens per micro-tile */

/* 32 unsigned byte codes -> 32 int16 at c */
static inline void widen_u8(__m256i v, int16_t *c) {
    _mm512_storeu_si512(c, _mm512_cvtepu8_epi16(v));
}

/* One row as value j = scale[j / 32] * c[j] + min[j / 32] (c: integer codes). */
static void row_codes(int fmt, const uint8_t *w, int n, int16_t *c, float *scale, float *min) {
    if (fmt == Q4_0 || fmt == Q4_1 || fmt == Q8_0) {
        int stride = fmt == Q4_0 ? 18 : fmt == Q4_1 ? 20 : 34;
        for (int b = 0; b < n / 32; b++, w += stride, c += 32) {
            float d = h2f(w);
            scale[b] = d;
            if (fmt == Q8_0) {
                min[b] = 0.f;
                _mm512_storeu_si512(c, _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + 2))));
                continue;
            }
            min[b] = fmt == Q4_1 ? h2f(w + 2) : -8.f * d;
            widen_u8(nibbles16(w + stride - 16), c);
        }
        return;
    }
    int five = fmt == Q5_K;
    for (int b = 0; b < n / 256; b++, w += five ? 176 : 144) {
        float d = h2f(w), dmin = h2f(w + 2), sc, m;
        for (int j = 0; j < 8; j++) {
            scale_min_k4(j, w + 4, &sc, &m);
            scale[8 * b + j] = d * sc;
            min[8 * b + j] = -dmin * m;
        }
        for (int j = 0; j < 4; j++, c += 64) {
            widen_u8(codes_q45_k(w, five, j, 0), c);
            widen_u8(codes_q45_k(w, five, j, 1), c + 32);
        }
    }
}

typedef struct {
    const part_t *parts; int n_parts, n_tok, n;
    const int16_t *xq; const float *xd, *sx;  /* [n_tok padded to TT] x [n], [.] x [n / 32] */
    float *out; int64_t ldo, rows;
} gemm_job;

/* 16 rows x TT tokens, twice (row groups a and b), over all n values */
static void tile(const gemm_job *j, const int32_t *ca, const int32_t *cb, const float *sa, const float *sb,
                 const float *ma, const float *mb, int t0, __m512 *fa, __m512 *fb) {
    int nb = j->n / 32;
    const int32_t *x[TT];
    const float *xd[TT], *sx[TT];
    for (int i = 0; i < TT; i++) {
        x[i] = (const int32_t *)(j->xq + (int64_t)(t0 + i) * j->n);
        xd[i] = j->xd + (int64_t)(t0 + i) * nb;
        sx[i] = j->sx + (int64_t)(t0 + i) * nb;
        fa[i] = fb[i] = _mm512_setzero_ps();
    }
    for (int k = 0; k < nb; k++) {
        __m512i a[TT], b[TT];
        for (int i = 0; i < TT; i++) a[i] = b[i] = _mm512_setzero_si512();
        const int32_t *pa = ca + (int64_t)k * 16 * 16, *pb = cb + (int64_t)k * 16 * 16;
#pragma GCC unroll 16
        for (int p = 0; p < 16; p++) {
            __m512i wa = _mm512_load_si512(pa + 16 * p), wb = _mm512_load_si512(pb + 16 * p);
            for (int i = 0; i < TT; i++) {
                __m512i xb = _mm512_set1_epi32(x[i][16 * k + p]);
                a[i] = _mm512_dpwssd_epi32(a[i], wa, xb);
                b[i] = _mm512_dpwssd_epi32(b[i], wb, xb);
            }
        }
        __m512 wsa = _mm512_loadu_ps(sa + 16 * k), wsb = _mm512_loadu_ps(sb + 16 * k);
        __m512 wma = _mm512_loadu_ps(ma + 16 * k), wmb = _mm512_loadu_ps(mb + 16 * k);
        for (int i = 0; i < TT; i++) {
            __m512 d = _mm512_set1_ps(xd[i][k]), s = _mm512_set1_ps(sx[i][k]);
            fa[i] = _mm512_fmadd_ps(_mm512_mul_ps(wsa, d), _mm512_cvtepi32_ps(a[i]), _mm512_fmadd_ps(wma, s, fa[i]));
            fb[i] = _mm512_fmadd_ps(_mm512_mul_ps(wsb, d), _mm512_cvtepi32_ps(b[i]), _mm512_fmadd_ps(wmb, s, fb[i]));
        }
    }
}

/* r[i] (row i of a 16 x 16 int32 matrix) -> r[i] = column i */
static inline void transpose16(__m512i *r) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {  /* u[i + c], 128-bit lane l: column 4l + c of rows i..i+3 */
        u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        __m512i a0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), a1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
        __m512i b0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44), b1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
        r[c] = _mm512_shuffle_i32x4(a0, b0, 0x88);
        r[4 + c] = _mm512_shuffle_i32x4(a0, b0, 0xDD);
        r[8 + c] = _mm512_shuffle_i32x4(a1, b1, 0x88);
        r[12 + c] = _mm512_shuffle_i32x4(a1, b1, 0xDD);
    }
}

static void gemm_task(void *arg, int64_t begin, int64_t end) {
    const gemm_job *j = (const gemm_job *)arg;
    int n = j->n, nb = n / 32;
    /* per 16-row group: codes [n / 2 pairs][16 rows] int32, scales and mins [nb][16]; then the
     * 16 rows' codes in order (int16 [16][n]) and one row's scales and mins */
    size_t code_bytes = (size_t)n / 2 * 16 * 4, f_bytes = (size_t)nb * 16 * 4;
    uint8_t *buf = (uint8_t *)aligned_alloc(64, (2 * (code_bytes + 2 * f_bytes) + (size_t)n * 32 + (size_t)nb * 8 + 127) / 64 * 64);
    int32_t *codes[2] = {(int32_t *)buf, (int32_t *)(buf + code_bytes)};
    float *scales[2] = {(float *)(buf + 2 * code_bytes), (float *)(buf + 2 * code_bytes + f_bytes)};
    float *mins[2] = {scales[1] + nb * 16, scales[1] + 2 * nb * 16};
    int16_t *c = (int16_t *)(mins[1] + nb * 16);
    float *sc = (float *)(c + 16 * (size_t)n), *mn = sc + nb;
    for (int64_t chunk = begin; chunk < end; chunk++) {
        int64_t r0 = chunk * ROWS;
        for (int r = 0; r < ROWS; r++) {
            int g = r / 16, lane = r % 16;
            int64_t row = r0 + r, first = 0;
            const part_t *pt = NULL;
            int16_t *cr = c + (size_t)lane * n;
            for (int p = 0; p < j->n_parts && row < j->rows; first += j->parts[p].rows, p++)
                if (row < first + j->parts[p].rows) { pt = j->parts + p; break; }
            if (pt) row_codes(pt->fmt, pt->data + (row - first) * pt->row_bytes, n, cr, sc, mn);
            else { memset(cr, 0, (size_t)n * 2); memset(sc, 0, nb * 4); memset(mn, 0, nb * 4); }
            for (int b = 0; b < nb; b++) { scales[g][16 * b + lane] = sc[b]; mins[g][16 * b + lane] = mn[b]; }
            if (lane < 15) continue;
            for (int p0 = 0; p0 < n / 2; p0 += 16) {  /* 16 rows x 16 pairs -> [pair][row] */
                __m512i v[16];
                for (int i = 0; i < 16; i++) v[i] = _mm512_loadu_si512(c + (size_t)i * n + 2 * p0);
                transpose16(v);
                for (int i = 0; i < 16; i++) _mm512_store_si512(codes[g] + 16 * (p0 + i), v[i]);
            }
        }
        int64_t left = j->rows - r0;
        __mmask16 ka = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
        __mmask16 kb = left >= 32 ? 0xffff : left <= 16 ? 0 : (__mmask16)((1u << (left - 16)) - 1);
        for (int t0 = 0; t0 < j->n_tok; t0 += TT) {
            __m512 fa[TT], fb[TT];
            tile(j, codes[0], codes[1], scales[0], scales[1], mins[0], mins[1], t0, fa, fb);
            for (int i = 0; i < TT && t0 + i < j->n_tok; i++) {
                float *o = j->out + (int64_t)(t0 + i) * j->ldo + r0;
                _mm512_mask_storeu_ps(o, ka, fa[i]);
                _mm512_mask_storeu_ps(o + 16, kb, fb[i]);
            }
        }
    }
    free(buf);
}

typedef struct { const float *x; int n; int16_t *xq; float *xd, *sx; } quant_job;

/* blocks i .. i + 7 (8 lanes): the sums of their 32 values, each added in order from the first */
static inline __m256 sums8(const float *x) {
    const __m256i at = _mm256_setr_epi32(0, 32, 64, 96, 128, 160, 192, 224);
    __m256 sum = _mm256_setzero_ps();
    for (int l = 0; l < 32; l++) sum = _mm256_add_ps(sum, _mm256_i32gather_ps(x + l, at, 4));
    return sum;
}

/* tokens begin .. end - 1: each 32-value block rounded with scale max|x| / 32767 (to nearest even,
 * as nearbyintf), and its sum (added in order, as a scalar loop would) */
static void quant_task(void *arg, int64_t begin, int64_t end) {
    const quant_job *q = (const quant_job *)arg;
    const __m256 sign = _mm256_set1_ps(-0.f);
    int64_t first = begin * (q->n / 32), last = end * (q->n / 32);
    for (int64_t i = first; i < last; i++) {
        const float *v = q->x + 32 * i;
        __m256 amax = _mm256_setzero_ps();
        for (int k = 0; k < 4; k++) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + 8 * k)));
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        float top = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
        __m256 inv = _mm256_set1_ps(top > 0.f ? 32767.f / top : 0.f);
        q->xd[i] = top / 32767.f;
        for (int k = 0; k < 4; k += 2) {
            __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 8 * k), inv));
            __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 8 * k + 8), inv));
            _mm256_storeu_si256((__m256i *)(q->xq + 32 * i + 8 * k), _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8));
        }
    }
    int64_t i = first;
    for (; i + 8 <= last; i += 8) _mm256_storeu_ps(q->sx + i, sums8(q->x + 32 * i));
    for (; i < last; i++) {
        float sum = 0.f;
        for (int l = 0; l < 32; l++) sum += q->x[32 * i + l];
        q->sx[i] = sum;
    }
}

/* y[t, :] = W x[t, :] for the stacked parts (all Q4_0, Q4_1, Q8_0, Q4_K or Q5_K) on 16-bit
 * activations; n a multiple of 32 (256 for the K formats), out row stride ldo. */
void qgemm_q16x(const part_t *parts, int n_parts, const float *x, int n_tok, int n, float *out, int64_t ldo) {
    int nb = n / 32, padded = (n_tok + TT - 1) / TT * TT;
    int16_t *xq = (int16_t *)aligned_alloc(64, ((size_t)padded * n * 2 + 63) / 64 * 64);
    float *xd = (float *)malloc(sizeof(float) * 2 * (size_t)padded * nb), *sx = xd + (size_t)padded * nb;
    memset(xq + (size_t)n_tok * n, 0, (size_t)(padded - n_tok) * n * 2); /* the padding tokens */
    memset(xd + (size_t)n_tok * nb, 0, sizeof(float) * (size_t)(padded - n_tok) * nb);
    memset(sx + (size_t)n_tok * nb, 0, sizeof(float) * (size_t)(padded - n_tok) * nb);
    quant_job q = {x, n, xq, xd, sx};
    pool_run(quant_task, &q, n_tok, 16);
    int64_t rows = 0;
    for (int p = 0; p < n_parts; p++) rows += parts[p].rows;
    gemm_job job = {parts, n_parts, n_tok, n, xq, xd, sx, out, ldo, rows};
    pool_run(gemm_task, &job, (rows + ROWS - 1) / ROWS, 1);
    free(xq);
    free(xd);
}
