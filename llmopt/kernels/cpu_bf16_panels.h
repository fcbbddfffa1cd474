// bfloat16 weights times many rows of x by AVX-512 BF16 dot products (vdpbf16ps: 32 bf16 products
// summed into 16 float32 lanes a instruction, against 8 for a float32 FMA on ymm), for prefill on
// CPUs that have them; included by cpu_decode.cpp under `#pragma GCC target` and picked at run time
// (tiles_config). x is rounded to bfloat16 (to nearest even) first, as llama.cpp does for its BF16
// weights; the sums are float32. Decode rows (fewer than f32_panel_rows) keep the float32 path, whose
// products equal a float32 copy's.
//
// The float panels' scheme (cpu_quant_tiles.h: f32_panels) with pairs of k as the unit: a panel of
// 16 weight rows, a K-chunk at a time, is transposed as 32-bit pairs (pack_f32 moves the bits) into
// wp[j][r] = (W[r, 2j], W[r, 2j + 1]); each x row's pair j is broadcast, and one vdpbf16ps adds its
// two products into each of the 16 outputs. Each output sums its chunks in order: independent of
// M, N and the threads.
#pragma once
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_quant_tiles.h"

namespace llmopt_cpu_tiles {
namespace bf16dot {

constexpr int64_t BN = FN, BK = FK;   // 16 outputs a panel; K-chunks of 256 (128 pairs)
constexpr int64_t MR = 8;              // rows of x a pass (8 accumulators of 16 lanes)

// x [M, K] -> bfloat16 pairs xb [rows, stride] (rounded to nearest even, as BF16::put): row m's K / 2
// pairs at xb[m * stride]; the rest of xb (rows past M, pairs past K / 2) zeros
inline void round_x(const float* x, int64_t M, int64_t K, int64_t rows, int64_t stride, std::vector<uint32_t>& xb) {
    xb.assign(rows * stride, 0);
    for (int64_t m = 0; m < M; ++m) {
        const float* xr = x + m * K;
        uint16_t* o = reinterpret_cast<uint16_t*>(xb.data() + m * stride);
        int64_t k = 0;
        for (; k + 16 <= K; k += 16)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(xr + k)));
        BF16::put(xr + k, reinterpret_cast<uint8_t*>(o + k), K - k);
    }
}

template <int R>
inline void block(const uint32_t* xb, int64_t K2, const uint32_t* wp, int64_t kc2, float* y, int64_t ldy,
                  int64_t nr, bool add) {
    __m512 c[R];
    for (int i = 0; i < R; ++i) c[i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < kc2; ++j) {
        const __m512bh w = (__m512bh)_mm512_loadu_si512(wp + j * BN);
        for (int i = 0; i < R; ++i)
            c[i] = _mm512_dpbf16_ps(c[i], (__m512bh)_mm512_set1_epi32((int)xb[i * K2 + j]), w);
    }
    const __mmask16 mask = nr == BN ? 0xFFFF : (__mmask16)((1u << nr) - 1);
    for (int i = 0; i < R; ++i) {
        float* yr = y + i * ldy;
        const __m512 v = add ? _mm512_add_ps(_mm512_maskz_loadu_ps(mask, yr), c[i]) : c[i];
        _mm512_mask_storeu_ps(yr, mask, v);
    }
}

// y[M, N] (row stride a.ldy) = bf16(a.x) @ W^T for bfloat16 W [N, K], K even
inline void panels(const Args& a, const uint8_t* w) {
    const int64_t M = a.M, K = a.K, N = a.N, K2 = K / 2, P = (N + BN - 1) / BN;
    std::vector<uint32_t> xb;
    round_x(a.x, M, K, M, K2, xb);
    const float* wd = reinterpret_cast<const float*>(w);   // bf16 pairs as 32-bit words [N, K / 2]
#pragma omp parallel
    {
        std::vector<float> wp(BK / 2 * BN);
#pragma omp for schedule(static)
        for (int64_t pi = 0; pi < P; ++pi) {
            const int64_t n0 = pi * BN, nr = std::min<int64_t>(BN, N - n0);
            for (int64_t k0 = 0; k0 < K2; k0 += BK / 2) {
                const int64_t kc = std::min<int64_t>(BK / 2, K2 - k0);
                pack_f32(wd + n0 * K2 + k0, K2, nr, kc, wp.data());
                const uint32_t* wq = reinterpret_cast<const uint32_t*>(wp.data());
                const uint32_t* x = xb.data() + k0;
                float* y = a.y + n0;
                const bool add = k0 > 0;
                int64_t m = 0;
                for (; m + MR <= M; m += MR) block<MR>(x + m * K2, K2, wq, kc, y + m * a.ldy, a.ldy, nr, add);
                switch (M - m) {
                    case 7: block<7>(x + m * K2, K2, wq, kc, y + m * a.ldy, a.ldy, nr, add); break;
                    case 6: block<6>(x + m * K2, K2, wq, kc, y + m * a.ldy, a.ldy, nr, add); break;
                    case 5: block<5>(x + m * K2, K2, wq, kc, y + m * a.ldy, a.ldy, nr, add); break;
                    case 4: block<4>(x + m * K2, K2, wq, kc, y + m * a.ldy, a.ldy, nr, add); break;
                    case 3: block<3>(x + m * K2, K2, wq, kc, y + m * a.ldy, a.ldy, nr, add); break;
                    case 2: block<2>(x + m * K2, K2, wq, kc, y + m * a.ldy, a.ldy, nr, add); break;
                    case 1: block<1>(x + m * K2, K2, wq, kc, y + m * a.ldy, a.ldy, nr, add); break;
                    default: break;
                }
            }
        }
    }
}


// AMX-BF16 (tile matrix multiply: one tdpbf16ps multiplies 16 rows of x by 16 outputs over 32 k),
// where the CPU and the kernel allow it (the process asks once for the tile data state). Blocks of
// 32 rows of x by 32 outputs in four accumulator tiles; a panel's weights packed as pairs over the
// whole of K (B tiles read straight from it: row j = pair j of the 16 outputs), x's pairs read in
// place (A tiles: 16 rows of 32 k). K padded with zero pairs to 32, M with zero rows to 32. Each
// output is the same sequence of tile products whatever M, N or the threads.
namespace amx {

struct alignas(64) TileCfg {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// AMX-TILE and AMX-BF16 (CPUID 7.0 EDX bits 24, 22), and the kernel's leave to use the tile data
// state (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA), asked once for the process
inline bool available() {
    static const bool ok = [] {
        unsigned a, b, c, d;
        if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 22))) return false;
        return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
    }();
    return ok;
}

inline void store_tile(const float* c, float* y, int64_t ldy, int64_t mr, int64_t nr) {
    for (int64_t i = 0; i < mr; ++i) std::memcpy(y + i * ldy, c + i * 16, nr * sizeof(float));
}

inline void panels(const Args& a, const uint8_t* w) {
    const int64_t M = a.M, K = a.K, N = a.N, K2 = K / 2, K2p = (K2 + 15) / 16 * 16, Mp = (M + 31) / 32 * 32;
    const int64_t P = (N + 31) / 32;
    std::vector<uint32_t> xb;   // x's pairs, rows and pairs zero-padded
    round_x(a.x, M, K, Mp, K2p, xb);
    const float* wd = reinterpret_cast<const float*>(w);
#pragma omp parallel
    {
        TileCfg cfg;
        for (int t = 0; t < 8; ++t) {
            cfg.colsb[t] = 64;
            cfg.rows[t] = 16;
        }
        _tile_loadconfig(&cfg);
        std::vector<float> wp(2 * K2p * 16);
        alignas(64) float c[16 * 16];
#pragma omp for schedule(static)
        for (int64_t pi = 0; pi < P; ++pi) {
            const int64_t n0 = pi * 32;
            int64_t nr[2];
            for (int h = 0; h < 2; ++h) {   // two panels of 16 outputs (past N: zeros)
                nr[h] = std::max<int64_t>(0, std::min<int64_t>(16, N - n0 - 16 * h));
                float* dst = wp.data() + h * K2p * 16;
                if (nr[h] > 0) pack_f32(wd + (n0 + 16 * h) * K2, K2, nr[h], K2, dst);
                std::fill(dst + (nr[h] > 0 ? K2 * 16 : 0), dst + K2p * 16, 0.f);
            }
            const uint32_t* b0 = reinterpret_cast<const uint32_t*>(wp.data());
            const uint32_t* b1 = b0 + K2p * 16;
            for (int64_t m0 = 0; m0 < Mp; m0 += 32) {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                const uint32_t* a0 = xb.data() + m0 * K2p;
                const uint32_t* a1 = a0 + 16 * K2p;
                for (int64_t j = 0; j < K2p; j += 16) {
                    _tile_loadd(4, a0 + j, K2p * 4);
                    _tile_loadd(5, a1 + j, K2p * 4);
                    _tile_loadd(6, b0 + j * 16, 64);
                    _tile_loadd(7, b1 + j * 16, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
                for (int t = 0; t < 4; ++t) {   // tile t: rows m0 + 16 (t / 2), outputs n0 + 16 (t % 2)
                    const int64_t mr = std::min<int64_t>(16, M - m0 - 16 * (t / 2)), cols = nr[t % 2];
                    if (mr <= 0 || cols <= 0) continue;
                    switch (t) {
                        case 0: _tile_stored(0, c, 64); break;
                        case 1: _tile_stored(1, c, 64); break;
                        case 2: _tile_stored(2, c, 64); break;
                        default: _tile_stored(3, c, 64); break;
                    }
                    store_tile(c, a.y + (m0 + 16 * (t / 2)) * a.ldy + n0 + 16 * (t % 2), a.ldy, mr, cols);
                }
            }
        }
        _tile_release();
    }
}

}  // namespace amx

// y = bf16(a.x) @ W^T for bfloat16 W [N, K], K even: AMX tiles (amx: available()), else vdpbf16ps
inline void run(const Args& a, const uint8_t* w, bool amx) {
    if (amx) amx::panels(a, w);
    else panels(a, w);
}
}  // namespace bf16dot
}  // namespace llmopt_cpu_tiles
