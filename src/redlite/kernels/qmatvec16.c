/* y = W x with x rounded to 16 bits per 32-value block (scale max|x| / 32767), for GGUF block
 * formats (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K): codes times the int16 activations summed in
 * integers (_mm256_madd_epi16), then scaled in float32; a block's min (Q4_1, Q4_K, Q5_K) and
 * Q4_0's -8 offset multiply the float32 block sum of x, exactly as in qmatvec.c. The only change
 * from the float32 product is the activation rounding, at most 1/65534 of a block's largest
 * |x| per value (256 times finer than llama.cpp's 8 bits); about twice as fast as qmatvec.c
 * where compute-bound. F32 parts go through qmatvec. AVX2 + FMA + F16C; Q4_K and Q6_K rows take
 * an AVX512-VNNI loop where the CPU has it (checked at the first call). */
#include <stdlib.h>

#include "gguf_blocks.h"

/* The activations in the orders in which int16 lanes of packed codes hold them, so codes are
 * widened by shifts and masks (no shuffles). q: in order. qe: per 32 values the even-indexed,
 * then the odd-indexed (Q4_K's nibble pairs, Q8_0/Q6_K's byte pairs). qp: per two 32-value
 * blocks (Q4_0/Q4_1's 16 bytes each, side by side), groups of 8: values 0,2..14 of each
 * block, then 16,18..30, then 1,3..15, then 17,19..31. Per 32 values: scale d, float sum sx. */
typedef struct { const int16_t *q, *qe, *qp, *qk; const float *d, *sx; } x16;

/* qk (Q4_K and Q6_K rows on AVX512-VNNI): per 128 values (sub-blocks s0..s3 of 32), four
 * runs of 32: the even-indexed values of s0 then of s2, the odd-indexed of s0 then of s2, then
 * the same of s1 and s3 (the order of a 512-bit load of two sub-block pairs' packed nibbles). */
static void k4_order(const int16_t *qe, int n, int16_t *qk) {
    for (int g = 0; g < n / 128; g++, qe += 128, qk += 128)
        for (int h = 0; h < 2; h++)          /* s0/s2, then s1/s3 */
            for (int parity = 0; parity < 2; parity++)
                for (int half = 0; half < 2; half++)
                    memcpy(qk + 64 * h + 32 * parity + 16 * half, qe + 32 * (h + 2 * half) + 16 * parity,
                           16 * sizeof(int16_t));
}

static void pair_order(const int16_t *q, int nb, int16_t *qp) {
    static const int first[4] = {0, 16, 1, 17};
    for (int b = 0; b + 1 < nb; b += 2, q += 64, qp += 64)
        for (int g = 0; g < 4; g++)
            for (int half = 0; half < 2; half++)
                for (int l = 0; l < 8; l++) qp[16 * g + 8 * half + l] = q[32 * half + first[g] + 2 * l];
}

/* x (n values) -> q, qe, qp [n] int16, d and sx [n / 32] */
static void quantize_q16(const float *x, int n, int16_t *q, int16_t *qe, int16_t *qp, float *d, float *sx) {
    const int16_t *q0 = q;
    for (int b = 0; b < n / 32; b++, x += 32, q += 32, qe += 32) {
        __m256 v[4], amax = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
        const __m256 sign = _mm256_set1_ps(-0.f);
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(x + 8 * i);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
            sum = _mm256_add_ps(sum, v[i]);
        }
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        float top = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
        d[b] = top / 32767.f;
        sx[b] = hsum(sum);
        __m256 inv = _mm256_set1_ps(top > 0.f ? 32767.f / top : 0.f);
        for (int i = 0; i < 4; i += 2) {
            __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)), c = _mm256_cvtps_epi32(_mm256_mul_ps(v[i + 1], inv));
            _mm256_storeu_si256((__m256i *)(q + 8 * i), _mm256_permute4x64_epi64(_mm256_packs_epi32(a, c), 0xD8));
        }
        for (int i = 0; i < 16; i++) { qe[i] = q[2 * i]; qe[16 + i] = q[2 * i + 1]; }
    }
    pair_order(q0, n / 32, qp);
}

/* 32 signed bytes as int16 lanes: the even bytes and the odd ones, sign-extended; times the
 * even/odd-ordered activations xe */
static inline __m256i madd_s8_eo(__m256i c, const int16_t *xe) {
    __m256i even = _mm256_srai_epi16(_mm256_slli_epi16(c, 8), 8), odd = _mm256_srai_epi16(c, 8);
    return _mm256_add_epi32(_mm256_madd_epi16(even, _mm256_loadu_si256((const __m256i *)xe)),
                            _mm256_madd_epi16(odd, _mm256_loadu_si256((const __m256i *)(xe + 16))));
}

/* Q4_0/Q4_1 blocks b (low 128 bits) and b + 1 (high): codes times the pair-ordered xp */
static inline __m256i madd_q4_pair(const uint8_t *qs0, const uint8_t *qs1, const int16_t *xp) {
    const __m256i m = _mm256_set1_epi16(15);
    __m256i r = _mm256_loadu2_m128i((const __m128i *)qs1, (const __m128i *)qs0);
    const __m256i *x = (const __m256i *)xp;
    __m256i a = _mm256_add_epi32(_mm256_madd_epi16(_mm256_and_si256(r, m), _mm256_loadu_si256(x)),
                                 _mm256_madd_epi16(_mm256_and_si256(_mm256_srli_epi16(r, 4), m), _mm256_loadu_si256(x + 1)));
    __m256i b = _mm256_add_epi32(_mm256_madd_epi16(_mm256_and_si256(_mm256_srli_epi16(r, 8), m), _mm256_loadu_si256(x + 2)),
                                 _mm256_madd_epi16(_mm256_srli_epi16(r, 12), _mm256_loadu_si256(x + 3)));
    return _mm256_add_epi32(a, b);
}

/* Q4_K: sub-blocks 2j and 2j+1 share 32 bytes (low, high nibbles); read as 16 int16 lanes, a
 * lane's 4 nibbles are codes 2l and 2l+1 of each sub-block: shifts and masks, no shuffles. */
static inline void q4_k_pair(const uint8_t *raw, const int16_t *xe0, const int16_t *xe1, __m256i *p0, __m256i *p1) {
    const __m256i m = _mm256_set1_epi16(15);
    __m256i r = LD(raw);
    __m256i lo_even = _mm256_and_si256(r, m), hi_even = _mm256_and_si256(_mm256_srli_epi16(r, 4), m);
    __m256i lo_odd = _mm256_and_si256(_mm256_srli_epi16(r, 8), m), hi_odd = _mm256_srli_epi16(r, 12);
    *p0 = _mm256_add_epi32(_mm256_madd_epi16(lo_even, _mm256_loadu_si256((const __m256i *)xe0)),
                           _mm256_madd_epi16(lo_odd, _mm256_loadu_si256((const __m256i *)(xe0 + 16))));
    *p1 = _mm256_add_epi32(_mm256_madd_epi16(hi_even, _mm256_loadu_si256((const __m256i *)xe1)),
                           _mm256_madd_epi16(hi_odd, _mm256_loadu_si256((const __m256i *)(xe1 + 16))));
}

/* The 8 int32 sums of p[0..7]'s lanes, as one vector (lane k: the sum of p[k]) */
static inline __m256i sum8(const __m256i *p) {
    __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
    __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

/* The 8 6-bit scales and mins of a Q4_K/Q5_K block's 12 packed bytes q, as floats */
static inline void scales_mins_k4(const uint8_t *q, __m256 *sc, __m256 *mn) {
    uint32_t u[4];
    memcpy(u, q, 12);
    u[3] = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);
    uint32_t mins_lo = u[1] & 0x3f3f3f3f;
    u[1] = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);
    u[2] = mins_lo;
    u[0] &= 0x3f3f3f3f;
    __m128i v = _mm_loadu_si128((const __m128i *)u);  /* bytes 0-7: scales, 8-15: mins */
    *sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
    *mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)));
}

/* sum over 32 values of codes (as 2 x 16 int16) times x, as 8 int32 lanes */
static inline __m256i madd32(__m256i lo16, __m256i hi16, const int16_t *x) {
    return _mm256_add_epi32(_mm256_madd_epi16(lo16, _mm256_loadu_si256((const __m256i *)x)),
                            _mm256_madd_epi16(hi16, _mm256_loadu_si256((const __m256i *)(x + 16))));
}
static inline __m256i madd_u8(__m256i c, const int16_t *x) {  /* 32 unsigned byte codes */
    return madd32(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(c)), _mm256_cvtepu8_epi16(_mm256_extracti128_si256(c, 1)), x);
}

/* A Q4_K row on AVX512-VNNI: one 512-bit load holds two sub-block pairs' nibbles (see
 * q4_k_pair); vpdpwssd sums codes times the qk-ordered activations exactly in int32, 8 lanes
 * per sub-block, then each lane is scaled in float32 as in dot16_row. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
static float q4_k_row_vnni(const uint8_t *w, x16 x, int n) {
    const __m512i m = _mm512_set1_epi16(15);
    const __m512i first = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(1));
    __m512 acc = _mm512_setzero_ps();
    __m256 off = _mm256_setzero_ps();
    for (int b = 0; b < n / 256; b++, w += 144) {
        int k0 = 8 * b;
        __m256 sc, mn;
        scales_mins_k4(w + 4, &sc, &mn);
        __m512 dx = _mm512_castps256_ps512(_mm256_mul_ps(_mm256_mul_ps(sc, _mm256_set1_ps(h2f(w))),
                                                         _mm256_loadu_ps(x.d + k0)));
        off = _mm256_fmadd_ps(_mm256_mul_ps(mn, _mm256_set1_ps(h2f(w + 2))), _mm256_loadu_ps(x.sx + k0), off);
        for (int g = 0; g < 2; g++) {  /* sub-blocks 4g..4g+3 */
            __m512i r = _mm512_loadu_si512(w + 16 + 64 * g);
            const int16_t *xk = x.qk + 32 * (k0 + 4 * g);
            __m512i lo = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_and_si512(r, m), _mm512_loadu_si512(xk));
            lo = _mm512_dpwssd_epi32(lo, _mm512_and_si512(_mm512_srli_epi16(r, 8), m), _mm512_loadu_si512(xk + 32));
            __m512i hi = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_and_si512(_mm512_srli_epi16(r, 4), m),
                                             _mm512_loadu_si512(xk + 64));
            hi = _mm512_dpwssd_epi32(hi, _mm512_srli_epi16(r, 12), _mm512_loadu_si512(xk + 96));
            __m512i base = _mm512_set1_epi32(4 * g);  /* lo: sub-blocks 4g, 4g+2; hi: 4g+1, 4g+3 */
            acc = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_add_epi32(first, base), dx), _mm512_cvtepi32_ps(lo), acc);
            acc = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_add_epi32(second, base), dx), _mm512_cvtepi32_ps(hi), acc);
        }
    }
    return _mm512_reduce_add_ps(acc) - hsum(off);
}

/* A Q6_K row on AVX512-VNNI: sub-blocks 4g and 4g+2 (then 4g+1 and 4g+3) as one 512-bit vector
 * of signed codes, split into even and odd bytes; int32 lane i then sums values 4i..4i+3 of
 * its sub-block, so lanes 0-3/4-7 (8-11/12-15) take that sub-block's two 16-value scales. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
static float q6_k_row_vnni(const uint8_t *w, x16 x, int n) {
    const __m512i pairs = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i lanes = _mm512_set_epi32(5, 5, 5, 5, 4, 4, 4, 4, 1, 1, 1, 1, 0, 0, 0, 0);
    __m512 acc = _mm512_setzero_ps();
    for (int b = 0; b < n / 256; b++, w += 210) {
        int k0 = 8 * b;
        __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + 192))));
        __m512 xd = _mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(_mm256_loadu_ps(x.d + k0)));
        __m512 m = _mm512_mul_ps(_mm512_mul_ps(sc, _mm512_set1_ps(h2f(w + 208))), xd);  /* per 16 values */
        for (int g = 0; g < 2; g++)
            for (int h = 0; h < 2; h++) {  /* sub-blocks 4g+h and 4g+h+2 */
                __m512i c = _mm512_inserti64x4(_mm512_castsi256_si512(codes_q6_k(w, 4 * g + h)),
                                               codes_q6_k(w, 4 * g + h + 2), 1);
                const int16_t *xk = x.qk + 32 * (k0 + 4 * g) + 64 * h;
                __m512i p = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_srai_epi16(_mm512_slli_epi16(c, 8), 8),
                                                _mm512_loadu_si512(xk));
                p = _mm512_dpwssd_epi32(p, _mm512_srai_epi16(c, 8), _mm512_loadu_si512(xk + 32));
                __m512 scale = _mm512_permutexvar_ps(_mm512_add_epi32(lanes, _mm512_set1_epi32(8 * g + 2 * h)), m);
                acc = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(p), acc);
            }
    }
    return _mm512_reduce_add_ps(acc);
}

static int vnni512 = -1;  /* the CPU has AVX512-VNNI (checked once) */

static int cpu_vnni512(void) {
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw")
           && __builtin_cpu_supports("avx512vl");
}

/* Tests: on 0 takes the AVX2 rows whatever the CPU; on 1 the VNNI ones where the CPU has them.
 * Returns whether VNNI rows are in use. */
int q16_use_vnni(int on) {
    vnni512 = on && cpu_vnni512();
    return vnni512;
}

static float dot16_row(int fmt, const uint8_t *w, x16 x, int n) {
    __m256 acc = _mm256_setzero_ps();
    float off = 0.f, sc, m;
    switch (fmt) {
    case Q4_0:
    case Q4_1: {
        int stride = fmt == Q4_1 ? 20 : 18, nb = n / 32, b = 0;
        for (; b + 1 < nb; b += 2, w += 2 * stride) {  /* lanes 0-3: block b, 4-7: block b + 1 */
            float d0 = h2f(w), d1 = h2f(w + stride);
            float m0 = fmt == Q4_1 ? h2f(w + 2) : -8.f * d0, m1 = fmt == Q4_1 ? h2f(w + stride + 2) : -8.f * d1;
            __m256i p = madd_q4_pair(w + stride - 16, w + 2 * stride - 16, x.qp + 32 * b);
            __m256 sc2 = _mm256_set_m128(_mm_set1_ps(d1 * x.d[b + 1]), _mm_set1_ps(d0 * x.d[b]));
            acc = _mm256_fmadd_ps(sc2, _mm256_cvtepi32_ps(p), acc);
            off += m0 * x.sx[b] + m1 * x.sx[b + 1];
        }
        if (b < nb) {
            float d = h2f(w), mn = fmt == Q4_1 ? h2f(w + 2) : -8.f * d;
            __m256i p = madd_u8(nibbles16(w + stride - 16), x.q + 32 * b);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d * x.d[b]), _mm256_cvtepi32_ps(p), acc);
            off += mn * x.sx[b];
        }
        break;
    }
    case Q8_0:
        for (int b = 0; b < n / 32; b++, w += 34) {
            __m256i p = madd_s8_eo(LD(w + 2), x.qe + 32 * b);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(h2f(w) * x.d[b]), _mm256_cvtepi32_ps(p), acc);
        }
        break;
    case Q4_K:
        if (vnni512) return q4_k_row_vnni(w, x, n);
        for (int b = 0; b < n / 256; b++, w += 144) {
            int k0 = 8 * b;
            __m256i p[8];
            for (int j = 0; j < 4; j++)
                q4_k_pair(w + 16 + 32 * j, x.qe + 32 * (k0 + 2 * j), x.qe + 32 * (k0 + 2 * j + 1), p + 2 * j, p + 2 * j + 1);
            __m256 sc, mn;
            scales_mins_k4(w + 4, &sc, &mn);
            __m256 dx = _mm256_mul_ps(_mm256_mul_ps(sc, _mm256_set1_ps(h2f(w))), _mm256_loadu_ps(x.d + k0));
            acc = _mm256_fmadd_ps(dx, _mm256_cvtepi32_ps(sum8(p)), acc);
            acc = _mm256_fnmadd_ps(_mm256_mul_ps(mn, _mm256_set1_ps(h2f(w + 2))), _mm256_loadu_ps(x.sx + k0), acc);
        }
        break;
    case Q5_K:
        for (int b = 0; b < n / 256; b++, w += 176) {
            float d = h2f(w), dmin = h2f(w + 2);
            for (int s = 0; s < 8; s++) {
                int k = 8 * b + s;
                scale_min_k4(s, w + 4, &sc, &m);
                __m256i p = madd_u8(codes_q45_k(w, 1, s / 2, s & 1), x.q + 32 * k);
                acc = _mm256_fmadd_ps(_mm256_set1_ps(d * sc * x.d[k]), _mm256_cvtepi32_ps(p), acc);
                off -= dmin * m * x.sx[k];
            }
        }
        break;
    case Q6_K:
        if (vnni512) return q6_k_row_vnni(w, x, n);
        for (int b = 0; b < n / 256; b++, w += 210) {
            const int8_t *scales = (const int8_t *)(w + 192);
            float d = h2f(w + 208);
            for (int s = 0; s < 8; s++) {
                int k = 8 * b + s;
                /* int32 lanes 0-3 hold values 0-15 (scale 2s), lanes 4-7 values 16-31 (2s + 1) */
                __m256i p = madd_s8_eo(codes_q6_k(w, s), x.qe + 32 * k);
                float dk = d * x.d[k];
                __m256 sc2 = _mm256_set_m128(_mm_set1_ps(dk * scales[2 * s + 1]), _mm_set1_ps(dk * scales[2 * s]));
                acc = _mm256_fmadd_ps(sc2, _mm256_cvtepi32_ps(p), acc);
            }
        }
        break;
    }
    return hsum(acc) + off;
}

typedef struct { const part_t *parts; int n_parts, n_tok, n; x16 x; float *out; int64_t ldo; } q16_job;

#define PREFETCH_BYTES 2048

static void q16_task(void *arg, int64_t begin, int64_t end) {
    const q16_job *j = (const q16_job *)arg;
    int nb = j->n / 32;
    int64_t first = 0;
    for (int p = 0; p < j->n_parts; p++) {
        const part_t *pt = j->parts + p;
        int64_t lo = begin > first ? begin : first, hi = end < first + pt->rows ? end : first + pt->rows;
        for (int64_t r = lo; r < hi; r++) {
            int64_t at = (r - first) * pt->row_bytes;  /* prefetch PREFETCH_BYTES ahead while computing */
            if (at + PREFETCH_BYTES + pt->row_bytes <= (int64_t)pt->rows * pt->row_bytes)
                for (int64_t b = 0; b < pt->row_bytes; b += 64) _mm_prefetch((const char *)pt->data + at + PREFETCH_BYTES + b, _MM_HINT_T0);
            for (int t = 0; t < j->n_tok; t++) {
                int64_t o = (int64_t)t * j->n;
                x16 xt = {j->x.q + o, j->x.qe + o, j->x.qp + o, j->x.qk + o, j->x.d + t * nb, j->x.sx + t * nb};
                j->out[t * j->ldo + r] = dot16_row(pt->fmt, pt->data + (r - first) * pt->row_bytes, xt, j->n);
            }
        }
        first += pt->rows;
    }
}

/* y[t, :] = W x[t, :] for the stacked parts on 16-bit activations (see the file comment);
 * n a multiple of 32 (256 for the K formats), out row stride ldo. Any F32 part: qmatvec. */
void qmatvec_q16x(const part_t *parts, int n_parts, const float *x, int n_tok, int n, float *out, int64_t ldo) {
    for (int p = 0; p < n_parts; p++)
        if (parts[p].fmt == F32) { qmatvec(parts, n_parts, x, n_tok, n, out, ldo, 0); return; }
    int nb = n / 32;
    size_t q_bytes = ((sizeof(int16_t) * (size_t)n * n_tok + 63) / 64) * 64;
    if (vnni512 < 0) vnni512 = cpu_vnni512();
    int k4 = 0;
    for (int p = 0; p < n_parts; p++) k4 |= parts[p].fmt == Q4_K || parts[p].fmt == Q6_K;
    k4 = k4 && vnni512;
    uint8_t *buf = (uint8_t *)aligned_alloc(64, 4 * q_bytes + 2 * ((sizeof(float) * nb * n_tok + 63) / 64) * 64);
    int16_t *q = (int16_t *)buf, *qe = (int16_t *)(buf + q_bytes), *qp = (int16_t *)(buf + 2 * q_bytes);
    int16_t *qk = (int16_t *)(buf + 3 * q_bytes);
    float *d = (float *)(buf + 4 * q_bytes), *sx = d + nb * n_tok;
    for (int t = 0; t < n_tok; t++) {
        int64_t o = (int64_t)t * n;
        quantize_q16(x + o, n, q + o, qe + o, qp + o, d + t * nb, sx + t * nb);
        if (k4) k4_order(qe + o, n, qk + o);
    }
    int64_t rows = 0;
    for (int p = 0; p < n_parts; p++) rows += parts[p].rows;
    q16_job job = {parts, n_parts, n_tok, n, {q, qe, qp, qk, d, sx}, out, ldo};
    int64_t chunk = rows / (8 * get_threads());
    pool_run(q16_task, &job, rows, chunk < 16 ? 16 : chunk);
    free(buf);
}
