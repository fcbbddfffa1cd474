// Integer dot-product tiles for the decode layer (cpu_decode.cpp): the activations quantized to
// int8 per 32 columns (a float scale per block, as llama.cpp's Q8 activations), the weights' int8
// or int4 codes multiplied with them in 8-bit lanes (AVX2 maddubs: 32 products per instruction,
// against 8 for the float tiles of cpu_quant_tiles.h, which decode every code to a float first).
//
// Per 32-column block b of x row m: xq int8, dx = max|x| / 127, so x ~= dx * xq. A row's output is
// sum_g s_g * sum_{b in g} dx_b * (codes . xq)_b - sum_g sz_g * sum_{b in g} dx_b * sum(xq_b):
// the zero-point term uses the quantized x too, so the result is exactly the dot product of the
// quantized x with the weight (its error is x's rounding only, whatever the zero point).
#pragma once
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_quant_tiles.h"

namespace llmopt_cpu_tiles {

constexpr int64_t QB = 32;   // activation block

struct QX {
    const int8_t* q;    // [M, K]
    const float* d;     // [M, K / 32]
};

// x [M, K] (K % 32 == 0) -> q, d; gsum [M, K / gs] = sum over each group of d_b * sum(q_b).
// q = round(x * (127 / max|x|)), half to even (cvtps under the default rounding mode, as nearbyint).
inline void quantize_x(const float* x, int64_t M, int64_t K, int64_t gs, std::vector<int8_t>& q,
                       std::vector<float>& d, std::vector<float>& gsum) {
    const int64_t nb = K / QB, G = K / gs;
    q.resize(M * K);
    d.resize(M * nb);
    gsum.assign(M * G, 0.f);
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);   // undo the packs' lane interleave
    for (int64_t m = 0; m < M; ++m)
        for (int64_t b = 0; b < nb; ++b) {
            const float* xb = x + m * K + b * QB;
            __m256 v[4], mx = _mm256_setzero_ps();
            for (int i = 0; i < 4; ++i) {
                v[i] = _mm256_loadu_ps(xb + 8 * i);
                mx = _mm256_max_ps(mx, _mm256_and_ps(v[i], absmask));
            }
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            h = _mm_max_ss(h, _mm_movehdup_ps(h));
            const float amax = _mm_cvtss_f32(h);
            const float s = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
            __m256i iv[4];
            for (int i = 0; i < 4; ++i) iv[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
            __m256i sum = _mm256_add_epi32(_mm256_add_epi32(iv[0], iv[1]), _mm256_add_epi32(iv[2], iv[3]));
            __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]), _mm256_packs_epi32(iv[2], iv[3]));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(q.data() + m * K + b * QB), _mm256_permutevar8x32_epi32(p, order));
            __m128i t = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
            t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
            t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
            d[m * nb + b] = s;
            gsum[m * G + b * QB / gs] += s * (float)_mm_cvtsi128_si32(t);
        }
}

inline __m256 dot_u8s8(__m256i u, __m256i s) {   // 8 int32 sums of 4 products each, as floats
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}

// int8 codes in [-127, 127] (no -128: |code| must fit the sign trick), group size a multiple of 32
template <int NR, int MT>
inline void itile8(const Args& a, const QX& qx, const int8_t* w, int64_t n0, int64_t m0) {
    const int64_t K = a.K, nb = K / QB;
    const int8_t* row[NR];
    for (int r = 0; r < NR; ++r) row[r] = w + (n0 + r) * K;
    __m256 acc[NR][MT];
    zero(acc);
    for (int64_t g = 0, c0 = 0; c0 < K; ++g, c0 += a.gs) {
        __m256 gacc[NR][MT];
        zero(gacc);
        for (int64_t c = c0; c < c0 + a.gs; c += QB) {
            if ((c & 63) == 0)
                for (int r = 0; r < NR; ++r) _mm_prefetch(reinterpret_cast<const char*>(row[r] + PF * NR * K + c), _MM_HINT_T0);
            __m256i xq[MT], ax[MT];
            __m256 dx[MT];
            for (int i = 0; i < MT; ++i) {
                xq[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx.q + (m0 + i) * K + c));
                ax[i] = _mm256_sign_epi8(xq[i], xq[i]);
                dx[i] = _mm256_broadcast_ss(qx.d + (m0 + i) * nb + c / QB);
            }
            for (int r = 0; r < NR; ++r) {
                __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row[r] + c));
                for (int i = 0; i < MT; ++i)
                    gacc[r][i] = _mm256_fmadd_ps(dot_u8s8(ax[i], _mm256_sign_epi8(wv, xq[i])), dx[i], gacc[r][i]);
            }
        }
        for (int r = 0; r < NR; ++r) {
            __m256 sv = _mm256_set1_ps(a.s[(n0 + r) * a.s_stride + g]);
            for (int i = 0; i < MT; ++i) acc[r][i] = _mm256_fmadd_ps(sv, gacc[r][i], acc[r][i]);
        }
    }
    store<NR, MT>(a, acc, n0, m0);
}

// int4, the grouped nibble layout of cpu_quant_tiles.h (64-column blocks: low nibbles columns
// 64b..64b+31, high nibbles 64b+32..64b+63): one 32-byte load gives both halves' 32 codes
template <int NR, int MT>
inline void itile4(const Args& a, const QX& qx, const uint8_t* w, int64_t n0, int64_t m0) {
    const int64_t K = a.K, B = K / 64, nb = K / QB;
    const uint8_t* row[NR];
    for (int r = 0; r < NR; ++r) row[r] = w + (n0 + r) * (K / 2);
    const __m256i mask = _mm256_set1_epi8(0x0F);
    const bool two = a.gs == 32;
    const int64_t bpg = two ? 1 : a.gs / 64;
    __m256 acc[NR][MT];
    zero(acc);
    for (int64_t b0 = 0; b0 < B; b0 += bpg) {
        __m256 lo[NR][MT], hi[NR][MT];
        zero(lo);
        zero(hi);
        for (int64_t b = b0; b < b0 + bpg; ++b) {
            for (int r = 0; r < NR; ++r)
                _mm_prefetch(reinterpret_cast<const char*>(row[r] + PF * NR * (K / 2) + 32 * b), _MM_HINT_T0);
            __m256i xl[MT], xh[MT];
            __m256 dl[MT], dh[MT];
            for (int i = 0; i < MT; ++i) {
                const int8_t* xr = qx.q + (m0 + i) * K + 64 * b;
                xl[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr));
                xh[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + 32));
                dl[i] = _mm256_broadcast_ss(qx.d + (m0 + i) * nb + 2 * b);
                dh[i] = _mm256_broadcast_ss(qx.d + (m0 + i) * nb + 2 * b + 1);
            }
            for (int r = 0; r < NR; ++r) {
                __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row[r] + 32 * b));
                __m256i ql = _mm256_and_si256(v, mask), qh = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
                for (int i = 0; i < MT; ++i) {
                    lo[r][i] = _mm256_fmadd_ps(dot_u8s8(ql, xl[i]), dl[i], lo[r][i]);
                    hi[r][i] = _mm256_fmadd_ps(dot_u8s8(qh, xh[i]), dh[i], hi[r][i]);
                }
            }
        }
        add_scaled_halves<NR, MT>(a, acc, lo, hi, n0, b0, bpg, two);
    }
    store<NR, MT>(a, acc, n0, m0);
}

struct FnI8 {
    const int8_t* w;
    const QX* qx;
    template <int NR, int MT>
    void operator()(const Args& a, int64_t n, int64_t m) const { itile8<NR, MT>(a, *qx, w, n, m); }
};

struct FnI4 {
    const uint8_t* w;
    const QX* qx;
    template <int NR, int MT>
    void operator()(const Args& a, int64_t n, int64_t m) const { itile4<NR, MT>(a, *qx, w, n, m); }
};

}  // namespace llmopt_cpu_tiles
