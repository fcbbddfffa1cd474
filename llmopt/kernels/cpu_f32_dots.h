// Float GEMM for many rows, read straight from the row-major weights: y[M, N] (row stride ldy) =
// x[M, K] @ W[N, K]^T with AVX-512 and no packing; float32 weights, or bfloat16 / float16 ones widened
// as loaded (exact: the same bits as their float32 copy). A tile of MR = 3 rows of x by NR = 8 rows
// of W keeps 24 zmm accumulators, each summing 16 lanes of one dot product (per 16 k: 3 x loads, 8 w
// loads, 24 FMAs); at the end of K each row's 8 accumulators reduce in one tree to 8 adjacent
// outputs (one store). A block of 8 weight rows (contiguous) serves every row of x from L1 while the
// next block is prefetched into L2, a cache line per 16 k.
//
// Why not the float panels (cpu_quant_tiles.h f32_panels, which the quantized weights keep, and which
// float ones take from MAX_ROWS rows): they transpose every chunk of the weights into a buffer as it
// streams from memory, a cost a few dozen rows of x do not repay (below).
//
// Each output's sum order depends on K only (lane l sums k = l, l + 16, ... in order, the tail masked
// into the lanes it fills, then the same tree for every output): independent of M, N and threads.
// Included by cpu_decode.cpp after cpu_quant_tiles.h (Args).
#pragma once
#include <immintrin.h>
#include <algorithm>
#include <cstdint>

namespace llmopt_cpu_tiles {
namespace f32dots {

constexpr int MR = 3, NR = 8;
// Below this many rows of x these kernels beat the panels, whose cost of transposing each weight chunk
// is shared by every row: the linears of a decode step of the default model's float32 weights, one
// process alternating both, ran 1.38x / 1.21x / 1.15x / 1.06x faster here at 32 / 40 / 48 / 56 rows,
// the same at 64 and 0.95x at 80 (0.84x at 256), VNNI, 2026-12-06.
constexpr int64_t MAX_ROWS = 63;

// 16 weights as floats: float32 as they are, bfloat16 and float16 widened (exact)
struct WF32 {
    using T = float;
    __attribute__((target("avx512f"))) static inline __m512 load(const float* p) { return _mm512_loadu_ps(p); }
};
struct WBF16 {
    using T = uint16_t;
    __attribute__((target("avx512f"))) static inline __m512 load(const uint16_t* p) {
        const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
        return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    }
};
struct WF16 {
    using T = uint16_t;
    __attribute__((target("avx512f"))) static inline __m512 load(const uint16_t* p) {
        return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    }
};

template <class L, int R, int C>
__attribute__((target("avx512f"))) inline void tile(const float* x, int64_t K, const typename L::T* w, float* y,
                                                    int64_t ldy, const char*& pf, int64_t& pf_left) {
    __m512 c[R][C];
    for (int i = 0; i < R; ++i)
        for (int j = 0; j < C; ++j) c[i][j] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 xv[R];
        for (int i = 0; i < R; ++i) xv[i] = _mm512_loadu_ps(x + i * K + k);
        for (int j = 0; j < C; ++j) {
            __m512 wv = L::load(w + j * K + k);
            asm("" : "+v"(wv));   // one load a weight vector, not one folded into each FMA
            for (int i = 0; i < R; ++i) c[i][j] = _mm512_fmadd_ps(xv[i], wv, c[i][j]);
        }
        if (pf_left > 0) {
            _mm_prefetch(pf, _MM_HINT_T1);
            pf += 64;
            pf_left -= 64;
        }
    }
    if (k < K) {   // the last K % 16 columns, masked: the lanes past them add zeros
        const __mmask16 m = static_cast<__mmask16>((1u << (K - k)) - 1);
        __m512 xv[R];
        for (int i = 0; i < R; ++i) xv[i] = _mm512_maskz_loadu_ps(m, x + i * K + k);
        for (int j = 0; j < C; ++j) {
            typename L::T t[16] = {};
            std::copy(w + j * K + k, w + j * K + K, t);
            const __m512 wv = L::load(t);
            for (int i = 0; i < R; ++i) c[i][j] = _mm512_fmadd_ps(xv[i], wv, c[i][j]);
        }
    }
    for (int i = 0; i < R; ++i) {   // 8 accumulators -> 8 sums: halves added, then two rounds of pairs
        __m256 h[NR];
        for (int j = 0; j < NR; ++j)
            h[j] = j < C ? _mm256_add_ps(_mm512_castps512_ps256(c[i][j]), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(c[i][j]), 1)))
                         : _mm256_setzero_ps();
        const __m256 a0 = _mm256_hadd_ps(h[0], h[1]), a1 = _mm256_hadd_ps(h[2], h[3]);
        const __m256 a2 = _mm256_hadd_ps(h[4], h[5]), a3 = _mm256_hadd_ps(h[6], h[7]);
        const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);
        const __m256 r = _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
        if constexpr (C == NR) {
            _mm256_storeu_ps(y + i * ldy, r);
        } else {
            float t[NR];
            _mm256_storeu_ps(t, r);
            for (int j = 0; j < C; ++j) y[i * ldy + j] = t[j];
        }
    }
}

// every row of x against one block of C weight rows, MR rows at a time (the last 1-2 by smaller tiles)
template <class L, int C>
__attribute__((target("avx512f"))) void block(const float* x, int64_t M, int64_t K, const typename L::T* w, float* y,
                                              int64_t ldy, const char* pf, int64_t pf_left) {
    int64_t m = 0;
    for (; m + MR <= M; m += MR) tile<L, MR, C>(x + m * K, K, w, y + m * ldy, ldy, pf, pf_left);
    if (M - m == 2) tile<L, 2, C>(x + m * K, K, w, y + m * ldy, ldy, pf, pf_left);
    else if (M - m == 1) tile<L, 1, C>(x + m * K, K, w, y + m * ldy, ldy, pf, pf_left);
}

// y = x @ W^T over a.M rows (a.x [M, K] contiguous, a.y, a.ldy), W [N, K] contiguous in L's element type;
// blocks of 8 weight rows split over threads
template <class L>
void run(const Args& a, const uint8_t* wbytes) {
    const int64_t M = a.M, K = a.K, N = a.N, ldy = a.ldy;
    const float* x = a.x;
    float* y = a.y;
    const typename L::T* W = reinterpret_cast<const typename L::T*>(wbytes);
    const int64_t B = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < B; ++b) {
        const int64_t n0 = b * NR, nr = std::min<int64_t>(NR, N - n0);
        const typename L::T* w = W + n0 * K;
        // the next block (rows n0 + 8 on), contiguous after this one
        const char* pf = reinterpret_cast<const char*>(w + nr * K);
        const int64_t pf_left = std::min<int64_t>(NR, std::max<int64_t>(0, N - n0 - NR)) * K * sizeof(typename L::T);
        float* yb = y + n0;
        switch (nr) {
            case 8: block<L, 8>(x, M, K, w, yb, ldy, pf, pf_left); break;
            case 7: block<L, 7>(x, M, K, w, yb, ldy, pf, pf_left); break;
            case 6: block<L, 6>(x, M, K, w, yb, ldy, pf, pf_left); break;
            case 5: block<L, 5>(x, M, K, w, yb, ldy, pf, pf_left); break;
            case 4: block<L, 4>(x, M, K, w, yb, ldy, pf, pf_left); break;
            case 3: block<L, 3>(x, M, K, w, yb, ldy, pf, pf_left); break;
            case 2: block<L, 2>(x, M, K, w, yb, ldy, pf, pf_left); break;
            default: block<L, 1>(x, M, K, w, yb, ldy, pf, pf_left); break;
        }
    }
}

}  // namespace f32dots
}  // namespace llmopt_cpu_tiles
