// Integer dot-product tiles for the decode layer (cpu_decode.cpp): the activations quantized to
// int8 per 32 columns (a float scale per block, as llama.cpp's Q8 activations), the weights' int8
// or int4 codes multiplied with them in 8-bit lanes (AVX2 maddubs: 32 products per instruction,
// against 8 for the float tiles of cpu_quant_tiles.h, which decode every code to a float first).
//
// Per 32-column block b of x row m: xq int8, dx = max|x| / 127, so x ~= dx * xq. A row's output is
// sum_g s_g * sum_{b in g} dx_b * (codes . xq)_b - sum_g sz_g * sum_{b in g} dx_b * sum(xq_b):
// the zero-point term uses the quantized x too, so the result is exactly the dot product of the
// quantized x with the weight (its error is x's rounding only, whatever the zero point).
//
// The tiles are included twice by cpu_decode.cpp: in namespace avx2 (u8 x s8 products through
// maddubs + madd, 16 ymm registers) and, under `#pragma GCC target` for AVX-512 VNNI, in namespace
// vnni (one vpdpbusd on ymm, 32 registers), picked at run time. Every int32 sum is exact in both
// (maddubs cannot saturate: |codes| <= 127, |xq| <= 127), so both give the same floats bit for bit.
//
// FP4 E2M1 codes (NVFP4, MXFP4; the int4 layout, `bits` E2M1_BITS) take the same kernels, as
// llama.cpp's MXFP4 dot product does: twice an E2M1 value is an integer in [-12, 12], one vpshufb
// of a code's nibble away (e2m1_twice), and these 2v are signed int8 codes. The caller halves each
// dx (linear() in cpu_decode.cpp: exact, a power of two), so block scale x dx_b x (2v . xq)_b is the
// block's dot product and the sums stay exact int32.
#ifndef LLMOPT_IDOT_PRELUDE
#define LLMOPT_IDOT_PRELUDE
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_quant_tiles.h"

namespace llmopt_cpu_tiles {

constexpr int64_t QB = 32;   // activation block
constexpr int E2M1_BITS = -4;   // run_tiles / run_panels' `bits` for FP4 E2M1 codes (the int4 layout)

// E2M1 code -> 2 x its value as int8 (bit 3 the sign; -0 is 0), the vpshufb table of each 128-bit lane
inline __m256i e2m1_twice() {
    return _mm256_broadcastsi128_si256(_mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12));
}

struct QX {
    const int8_t* q;    // [M, K]
    const float* d;     // [M, K / 32]
    const int32_t* b;   // [M, K / 32]: sum(q) per block
    const int32_t* h = nullptr;   // [M, K / 16]: sum(q) per half block (groups of 16)
};

// x [M, K] (K % 32 == 0) -> q, d, bsum; gsum [M, K / gs] = sum over each group of d_b * sum(q_b).
// q = round(x * (127 / max|x|)), half to even (cvtps under the default rounding mode, as nearbyint).
inline void quantize_x(const float* x, int64_t M, int64_t K, int64_t gs, std::vector<int8_t>& q,
                       std::vector<float>& d, std::vector<int32_t>& bsum, std::vector<float>& gsum,
                       std::vector<int32_t>* hsum = nullptr) {   // hsum: QX::h
    const int64_t nb = K / QB, G = K / gs;
    q.resize(M * K);
    d.resize(M * nb);
    bsum.resize(M * nb);
    gsum.assign(M * G, 0.f);
    if (hsum != nullptr) hsum->resize(M * nb * 2);
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
            bsum[m * nb + b] = _mm_cvtsi128_si32(t);
            if (hsum != nullptr) {   // the first 16 values are iv[0], iv[1]
                __m256i h0 = _mm256_add_epi32(iv[0], iv[1]);
                __m128i u = _mm_add_epi32(_mm256_castsi256_si128(h0), _mm256_extracti128_si256(h0, 1));
                u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0x4E));
                u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0xB1));
                (*hsum)[(m * nb + b) * 2] = _mm_cvtsi128_si32(u);
                (*hsum)[(m * nb + b) * 2 + 1] = _mm_cvtsi128_si32(t) - _mm_cvtsi128_si32(u);
            }
            gsum[m * G + b * QB / gs] += s * (float)_mm_cvtsi128_si32(t);
        }
}

// 5- and 6-bit codes with an implied zero code (Q5_0's 16, Q6_K's 32: Args::zc, a whole number in
// (0, 2^bits)) have it taken off each block's exact sum (tiles) or their codes (panels): no
// zero-point term (groups of 16 need it so). Otherwise 0: the zero point (if any) its term.
inline int zero_code_off(float zc, int bits) {
    const bool whole = zc > 0.f && zc < float(1 << bits) && zc == std::floor(zc);
    return (bits == 5 || bits == 6) && whole ? int(zc) : 0;
}
// for the integer kernels: that zero code, taken out of a (its zero-point term gone), or 0
inline int take_zero_code(Args& a, int bits) {
    const int off = a.sz == nullptr && a.kz.p == nullptr ? zero_code_off(a.zc, bits) : 0;
    if (off) a.zc = 0.f;
    return off;
}

}  // namespace llmopt_cpu_tiles
#endif  // LLMOPT_IDOT_PRELUDE

namespace llmopt_cpu_tiles {
namespace LLMOPT_IDOT_NS {

// 8 int32 lanes of 4 products each (u8 x s8; exact: no pair of products saturates int16)
inline __m256i dot_lanes(__m256i u, __m256i s) {
#ifdef LLMOPT_IDOT_VNNI
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// the 8 lane vectors v[r] -> their totals over lanes 0-3 (lo: a block's first 16 columns) and 4-7
// (hi: the next 16), lane r of each for v[r] (exact int32)
inline void totals8_halves(const __m256i (&v)[8], __m256i& lo, __m256i& hi) {
    const __m256i h01 = _mm256_hadd_epi32(v[0], v[1]), h23 = _mm256_hadd_epi32(v[2], v[3]);
    const __m256i h45 = _mm256_hadd_epi32(v[4], v[5]), h67 = _mm256_hadd_epi32(v[6], v[7]);
    const __m256i q0 = _mm256_hadd_epi32(h01, h23), q1 = _mm256_hadd_epi32(h45, h67);
    // q0: [t0 t1 t2 t3 | t0' t1' t2' t3'] (low and high 128-bit halves of v0..v3), q1 the same for v4..v7
    lo = _mm256_permute2x128_si256(q0, q1, 0x20);
    hi = _mm256_permute2x128_si256(q0, q1, 0x31);
}

// the 8 lane vectors v[r] -> one vector of their totals, lane r = sum of v[r] (exact int32)
inline __m256i totals8(const __m256i (&v)[8]) {
    __m256i lo, hi;
    totals8_halves(v, lo, hi);
    return _mm256_add_epi32(lo, hi);
}

// The tiles: 8 output rows (one float lane each) for MT (1 or 2) rows of x, straight from the
// weights (no packing, which the panels below pay once per 8 rows). Per 32-column block the 8
// rows' products are summed exactly in int32 (lanes, then totals8), then in float in the panels'
// order: fb = fma(total, dx_b, fb) over a group's blocks, acc = fma(s_g, fb, acc), acc -= sz_g *
// xsum_g (fused). So every output is bit for bit what the panels give it, whatever M, N or the
// path: a verified draft gets plain decoding's logits, and a sequence's logits do not depend on
// how many others share its step. int4: the grouped nibble layout of cpu_quant_tiles.h (per
// 64-column block: low nibbles its first 32 columns, high nibbles the next 32); int8 codes in
// [-127, 127] through the sign trick (|x| x sign(w, x)); 5- and 6-bit codes (P = 1, 2 high bits:
// HB<P>) decoded to bytes per block (hb_codes), unsigned as int4's; their implied zero code `off`
// (then no zero-point term) comes off each block's exact total as off x sum(xq), the same int32
// as the signed codes' sum. P = -1: E2M1 codes in the int4 layout, each nibble made its signed 2v
// (e2m1_twice) and multiplied through the sign trick as int8 codes are.
template <int MT, bool HALVES, int P>   // HALVES: groups of 16 (Q6_K's, NVFP4's; no zero point): each block's
inline void itile(const Args& a, const QX& qx, const uint8_t* w, bool int4, int64_t n0, int64_t nr, int64_t m0,
                  const float* sp, const float* zp, int off) {   // sp, zp: row n0's float32 scales, scaled zeros (or null)
    // halves end a group each (a template argument: the usual path keeps no branch for it)
    constexpr bool halves = HALVES;
    const int64_t K = a.K, nb = K / QB, bpg = halves ? 1 : a.gs / QB;
    int64_t rowb = int4 || P < 0 ? K / 2 : K;
    if constexpr (P > 0) rowb = HB<P>::rowb(K);
    const uint8_t* row[8];
    for (int r = 0; r < 8; ++r) row[r] = w + (n0 + (r < nr ? r : 0)) * rowb;   // past N: row n0 again, not stored
    const __m256i low = _mm256_set1_epi8(0x0F), twice = e2m1_twice();
    const __m256i sidx = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                            _mm256_set1_epi32((int)a.s_stride));
    const __m256i zidx = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)a.G));
    const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)nr),
                                                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
    __m256 acc[MT], fb[MT];
    for (int i = 0; i < MT; ++i) acc[i] = _mm256_setzero_ps();
    for (int i = 0; i < MT; ++i) fb[i] = _mm256_setzero_ps();
    __m256i wv[8];
    for (int64_t b = 0; b < nb; ++b) {
        if constexpr (P > 0) {
            for (int r = 0; r < 8; ++r) {
                if ((b & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(row[r] + 8 * rowb + (b >> 1) * hb_block<P>), _MM_HINT_T0);
                wv[r] = hb_codes<P>(row[r], b, 0);   // (unsigned: `off` comes off the totals)
            }
        } else if (int4 || P < 0) {   // block b: the low (b even) or high (b odd) nibbles of 64-column block b / 2
            if ((b & 1) == 0) {
                for (int r = 0; r < 8; ++r) {
                    _mm_prefetch(reinterpret_cast<const char*>(row[r] + 8 * rowb + 16 * b), _MM_HINT_T0);
                    wv[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row[r] + 16 * b));
                }
            }
        } else {
            for (int r = 0; r < 8; ++r) {
                if ((b & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(row[r] + 8 * rowb + QB * b), _MM_HINT_T0);
                wv[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row[r] + QB * b));
            }
        }
        __m256 s0, s1;   // groups of 16: the block's two scales of the 8 rows, for every x row
        if constexpr (halves) {
            s0 = _mm256_mask_i32gather_ps(_mm256_setzero_ps(), sp + 2 * b, sidx, valid, 4);
            s1 = _mm256_mask_i32gather_ps(_mm256_setzero_ps(), sp + 2 * b + 1, sidx, valid, 4);
        }
        for (int i = 0; i < MT; ++i) {
            const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx.q + (m0 + i) * K + b * QB));
            __m256i lanes[8];
            if (P > 0) {   // 5- or 6-bit codes, unsigned (sum (c - off) x = sum c x - off sum x: below)
                for (int r = 0; r < 8; ++r) lanes[r] = dot_lanes(wv[r], xq);
            } else if (P < 0) {   // E2M1: the nibbles' 2v, signed (|2v| <= 12)
                const __m256i ax = _mm256_sign_epi8(xq, xq);
                for (int r = 0; r < 8; ++r) {
                    const __m256i c = _mm256_and_si256((b & 1) ? _mm256_srli_epi16(wv[r], 4) : wv[r], low);
                    lanes[r] = dot_lanes(ax, _mm256_sign_epi8(_mm256_shuffle_epi8(twice, c), xq));
                }
            } else if (int4) {   // nibbles taken per x row: kept across rows they cost the AVX2 path (16
                                 // registers) 5-10% at 2 and 4 rows, for 2-7% on VNNI
                for (int r = 0; r < 8; ++r)
                    lanes[r] = dot_lanes(_mm256_and_si256((b & 1) ? _mm256_srli_epi16(wv[r], 4) : wv[r], low), xq);
            } else {
                const __m256i ax = _mm256_sign_epi8(xq, xq);
                for (int r = 0; r < 8; ++r) lanes[r] = dot_lanes(ax, _mm256_sign_epi8(wv[r], xq));
            }
            if constexpr (halves) {   // per half: total * dx, then * its group's scale, in that order
                __m256i lo, hi;
                totals8_halves(lanes, lo, hi);
                if (P > 0 && off) {
                    lo = _mm256_sub_epi32(lo, _mm256_set1_epi32(off * qx.h[((m0 + i) * nb + b) * 2]));
                    hi = _mm256_sub_epi32(hi, _mm256_set1_epi32(off * qx.h[((m0 + i) * nb + b) * 2 + 1]));
                }
                const __m256 dx = _mm256_set1_ps(qx.d[(m0 + i) * nb + b]);
                acc[i] = _mm256_fmadd_ps(s0, _mm256_mul_ps(_mm256_cvtepi32_ps(lo), dx), acc[i]);
                acc[i] = _mm256_fmadd_ps(s1, _mm256_mul_ps(_mm256_cvtepi32_ps(hi), dx), acc[i]);
                continue;
            }
            __m256i tot = totals8(lanes);
            if (P > 0 && off) tot = _mm256_sub_epi32(tot, _mm256_set1_epi32(off * qx.b[(m0 + i) * nb + b]));
            fb[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tot), _mm256_set1_ps(qx.d[(m0 + i) * nb + b]), fb[i]);
        }
        if (!halves && (b + 1) % bpg == 0) {   // the group's end
            const int64_t g = b / bpg;
            const __m256 sv = a.s_stride == 0 ? _mm256_set1_ps(sp[0])
                                              : _mm256_mask_i32gather_ps(_mm256_setzero_ps(), sp + g, sidx, valid, 4);
            for (int i = 0; i < MT; ++i) {
                acc[i] = _mm256_fmadd_ps(sv, fb[i], acc[i]);
                fb[i] = _mm256_setzero_ps();
            }
            if (zp != nullptr) {
                const __m256 zv = _mm256_mask_i32gather_ps(_mm256_setzero_ps(), zp + g, zidx, valid, 4);
                for (int i = 0; i < MT; ++i)
                    acc[i] = _mm256_fnmadd_ps(zv, _mm256_set1_ps(a.xsum[(m0 + i) * a.G + g]), acc[i]);
            }
        }
    }
    for (int i = 0; i < MT; ++i) {
        float* y = a.y + (m0 + i) * a.ldy + n0;
        if (nr == 8) {
            _mm256_storeu_ps(y, acc[i]);
        } else {
            alignas(32) float t[8];
            _mm256_store_ps(t, acc[i]);
            for (int64_t r = 0; r < nr; ++r) y[r] = t[r];
        }
    }
}

// y = quantize_x(x) @ W^T through the tiles: each thread a range of 8-row tiles, x's rows two by two
template <int P>
inline void run_tiles_p(const Args& a0, const QX& qx, const uint8_t* w, bool int4, int off) {
    split_rows(a0.N, [&](int64_t n0, int64_t n1) {
        // fp16 scales (a GGUF's d and m, as stored), K-quant sub-scales and implied zeros: made float32
        // 64 rows at a time into buffers that stay in L1 (Widened)
        constexpr int64_t SUB = 64;
        const bool wide = Widened::needed(a0, true);
        Widened wb;
        Args a = a0;
        for (int64_t n = n0; n < n1; n += 8) {
            const int64_t nr = std::min<int64_t>(8, n1 - n);
            if (wide && (n - n0) % SUB == 0) a = wb.rows(a0, n, std::min<int64_t>(n1, n + SUB));
            const float* sp = a.s_stride == 0 ? a.s : a.s + (n - a.s_row0) * a.s_stride;
            const float* zp = has_zero(a) ? a.sz + (n - a.s_row0) * a.G : nullptr;
            int64_t m = 0;
            if (a.gs == QB / 2) {
                for (; m + 2 <= a.M; m += 2) itile<2, true, P>(a, qx, w, int4, n, nr, m, sp, zp, off);
                if (m < a.M) itile<1, true, P>(a, qx, w, int4, n, nr, m, sp, zp, off);
                continue;
            }
            for (; m + 2 <= a.M; m += 2) itile<2, false, P>(a, qx, w, int4, n, nr, m, sp, zp, off);
            if (m < a.M) itile<1, false, P>(a, qx, w, int4, n, nr, m, sp, zp, off);
        }
    }, 8);
}

// codes of `bits`: 8 int8 codes [N, K], 4 the int4 layout, 5 and 6 the HB layout (their implied
// zero code, if any, taken off in the decode: take_zero_code), E2M1_BITS E2M1 codes in the int4
// layout (qx's dx halved)
inline void run_tiles(const Args& a0, const QX& qx, const uint8_t* w, int bits) {
    Args a = a0;
    const int off = take_zero_code(a, bits);
    if (bits == 5) run_tiles_p<1>(a, qx, w, false, off);
    else if (bits == 6) run_tiles_p<2>(a, qx, w, false, off);
    else if (bits == E2M1_BITS) run_tiles_p<-1>(a, qx, w, false, 0);
    else run_tiles_p<0>(a, qx, w, bits == 4, 0);
}

#ifdef LLMOPT_IDOT_VNNI
// Panels, for M >= a few rows (the tiles above reduce 8 lanes per 32 columns, output and x row,
// through hadd; here each output's 32-column block sum is one int32 lane already). PR = 8 output
// rows are unpacked and interleaved into a per-thread buffer once, then every x row passes over it:
// buffer[k4] (one ymm) holds columns 4k4..4k4+3 of the 8 rows, so vpdpbusd with x's 4 bytes
// broadcast adds 32 products into the 8 rows' sums. Unsigned codes (int4; 5- and 6-bit with a zero
// point) are the u8 operand, x the s8 one. Signed codes (int8; E2M1's 2v; 5- and 6-bit less their
// zero code) are the s8 operand and x + 128 the u8 one: the extra 128 x (the rows' code sum), a
// weight's alone, is taken off where each block's accumulators start (Panel::c, made at packing:
// nothing per x row; at 64 rows 1.2-1.3x faster for NVFP4, up to 1.15x for int8, than x's sums
// taken off per x row, Ice Lake). Each block sum is exact (vpdpbusd does not saturate); then per block * dx
// (float), per group * the rows' scales, minus the zero-point term, in that order (a row's result
// does not depend on the panel, N or M).
constexpr int64_t PR = 8;

struct Panel {
    std::vector<uint8_t> w;     // [K / 4][8][4]
    std::vector<float> s, sz;   // [G][8]
    std::vector<int32_t> c;     // signed codes: -128 x the 8 rows' code sums per 16 columns [K / 16][8]
};

// 8 rows of 32 bytes (rows[r]) -> out[j * 32 + 4r .. +3] = bytes 4j..4j+3 of row r (transpose8)
inline void interleave8(const __m256i (&v)[8], uint8_t* out) {
    __m256 r[8];
    for (int i = 0; i < 8; ++i) r[i] = _mm256_castsi256_ps(v[i]);
    transpose8(r);
    for (int j = 0; j < 8; ++j) _mm256_storeu_ps(reinterpret_cast<float*>(out + 32 * j), r[j]);
}

// whether run_panels holds codes of `bits` (5 and 6 less `off`) signed
inline bool signed_codes(int bits, int off) { return bits == 8 || bits == E2M1_BITS || off != 0; }

// rows n0..n0+7 (past N: zeros) of codes of `bits` (run_tiles; 5 and 6 less `off`) into p
inline void pack_panel(const Args& a, const uint8_t* w, int bits, int off, int64_t n0, Panel& p) {
    const bool int4 = bits == 4, e2m1 = bits == E2M1_BITS;
    const int64_t K = a.K, G = a.G;
    const int64_t rowb = bits == 5 ? HB<1>::rowb(K) : bits == 6 ? HB<2>::rowb(K) : int4 || e2m1 ? K / 2 : K;
    p.w.resize(K * PR);
    p.s.assign(G * PR, 0.f);
    p.sz.assign(G * PR, 0.f);
    const __m256i zero = _mm256_setzero_si256(), low = _mm256_set1_epi8(0x0F), twice = e2m1_twice();
    for (int64_t c = 0; c < K; c += 64) {   // 64 columns = two 32-column chunks of 8 rows
        __m256i v0[8], v1[8];
        for (int r = 0; r < PR; ++r) {
            if (n0 + r >= a.N) {
                v0[r] = v1[r] = zero;
                continue;
            }
            const uint8_t* row = w + (n0 + r) * rowb;
            if (bits == 5 || bits == 6) {
                const int64_t b = c / QB;
                v0[r] = bits == 5 ? hb_codes<1>(row, b, off) : hb_codes<2>(row, b, off);
                v1[r] = bits == 5 ? hb_codes<1>(row, b + 1, off) : hb_codes<2>(row, b + 1, off);
            } else if (int4 || e2m1) {
                __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c / 2));
                v0[r] = _mm256_and_si256(v, low);
                v1[r] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                if (e2m1) {
                    v0[r] = _mm256_shuffle_epi8(twice, v0[r]);
                    v1[r] = _mm256_shuffle_epi8(twice, v1[r]);
                }
            } else {
                v0[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c));
                v1[r] = c + 32 < K ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c + 32)) : zero;
            }
        }
        interleave8(v0, p.w.data() + c * PR);
        if (c + 32 < K) interleave8(v1, p.w.data() + (c + 32) * PR);
    }
    if (signed_codes(bits, off)) {   // per 16 columns (4 interleaved vectors): sum of codes, a lane a row
        p.c.resize(K / 16 * PR);
        const __m256i one = _mm256_set1_epi8(1);
        for (int64_t h = 0; h < K / 16; ++h) {
            const uint8_t* wh = p.w.data() + h * 16 * PR;
            __m256i t = zero;
            for (int j = 0; j < 4; ++j)
                t = _mm256_dpbusd_epi32(t, one, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wh + 32 * j)));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(p.c.data() + h * PR),
                                _mm256_sub_epi32(zero, _mm256_slli_epi32(t, 7)));
        }
    }
    for (int r = 0; r < PR && n0 + r < a.N; ++r)
        for (int64_t g = 0; g < G; ++g) {
            p.s[g * PR + r] = scale_at(a, n0 + r, g);
            if (has_zero(a)) p.sz[g * PR + r] = szero_at(a, n0 + r, g);
        }
}

// ia += the 32 products of x's 4 bytes at xb (SGN: x + 128, u8) with the packed codes wv
template <bool SGN>
inline __m256i dot4(__m256i ia, __m256i wv, const void* xb) {
    int32_t xv;
    std::memcpy(&xv, xb, 4);
    return SGN ? _mm256_dpbusd_epi32(ia, _mm256_set1_epi32(xv), wv) : _mm256_dpbusd_epi32(ia, wv, _mm256_set1_epi32(xv));
}

// y[m0 + i, n0..n0+nr) for MT x rows over the packed panel; SGN: signed codes, x read from xu (x + 128).
// Not inlined: inlined into run_panels' loop, the unsigned codes' pass ran 1.3x slower (Ice Lake).
template <int MT, bool SGN>
[[gnu::noinline]] inline void panel_pass(const Args& a, const QX& qx, const uint8_t* xu, const Panel& p, int64_t n0,
                                         int64_t nr, int64_t m0) {
    const int64_t K = a.K, nb = K / QB, bpg = a.gs / QB;
    const uint8_t* xs = SGN ? xu : reinterpret_cast<const uint8_t*>(qx.q);
    __m256 acc[MT];
    for (int i = 0; i < MT; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; SGN && a.gs == QB / 2 && b < nb; ++b) {   // groups of 16 (signed codes, no zero
        const uint8_t* wb = p.w.data() + b * QB * PR;            // point): as the tiles, each half's total * dx * its scale
        for (int h = 0; h < 2; ++h) {
            const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.c.data() + (2 * b + h) * PR));
            __m256i ia[MT];
            for (int i = 0; i < MT; ++i) ia[i] = c;
            for (int j = 4 * h; j < 4 * h + 4; ++j) {
                const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * j));
                for (int i = 0; i < MT; ++i) ia[i] = dot4<SGN>(ia[i], wv, xs + (m0 + i) * K + b * QB + 4 * j);
            }
            const __m256 sv = _mm256_loadu_ps(p.s.data() + (2 * b + h) * PR);
            for (int i = 0; i < MT; ++i)
                acc[i] = _mm256_fmadd_ps(sv, _mm256_mul_ps(_mm256_cvtepi32_ps(ia[i]), _mm256_set1_ps(qx.d[(m0 + i) * nb + b])),
                                         acc[i]);
        }
    }
    for (int64_t g = 0; a.gs != QB / 2 && g < a.G; ++g) {
        __m256 fb[MT];
        for (int i = 0; i < MT; ++i) fb[i] = _mm256_setzero_ps();
        for (int64_t b = g * bpg; b < (g + 1) * bpg; ++b) {
            __m256i c = _mm256_setzero_si256();
            if (SGN)
                c = _mm256_add_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.c.data() + 2 * b * PR)),
                                     _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.c.data() + (2 * b + 1) * PR)));
            __m256i ia[MT];
            for (int i = 0; i < MT; ++i) ia[i] = c;
            const uint8_t* wb = p.w.data() + b * QB * PR;
            for (int j = 0; j < QB / 4; ++j) {
                const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * j));
                for (int i = 0; i < MT; ++i) ia[i] = dot4<SGN>(ia[i], wv, xs + (m0 + i) * K + b * QB + 4 * j);
            }
            for (int i = 0; i < MT; ++i)
                fb[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[i]), _mm256_set1_ps(qx.d[(m0 + i) * nb + b]), fb[i]);
        }
        const __m256 sv = _mm256_loadu_ps(p.s.data() + g * PR);
        for (int i = 0; i < MT; ++i) acc[i] = _mm256_fmadd_ps(sv, fb[i], acc[i]);
        if (has_zero(a)) {
            const __m256 zv = _mm256_loadu_ps(p.sz.data() + g * PR);
            for (int i = 0; i < MT; ++i) acc[i] = _mm256_fnmadd_ps(zv, _mm256_set1_ps(a.xsum[(m0 + i) * a.G + g]), acc[i]);
        }
    }
    for (int i = 0; i < MT; ++i) {
        float* y = a.y + (m0 + i) * a.ldy + n0;
        if (nr == PR) {
            _mm256_storeu_ps(y, acc[i]);
        } else {
            alignas(32) float t[PR];
            _mm256_store_ps(t, acc[i]);
            for (int64_t r = 0; r < nr; ++r) y[r] = t[r];
        }
    }
}

// every x row over the packed panel, 8 at a time
template <bool SGN>
inline void panel_rows(const Args& a, const QX& qx, const uint8_t* xu, const Panel& p, int64_t n0, int64_t nr) {
    int64_t m = 0;
    for (; m + 8 <= a.M; m += 8) panel_pass<8, SGN>(a, qx, xu, p, n0, nr, m);
    switch (a.M - m) {
        case 7: panel_pass<7, SGN>(a, qx, xu, p, n0, nr, m); break;
        case 6: panel_pass<6, SGN>(a, qx, xu, p, n0, nr, m); break;
        case 5: panel_pass<5, SGN>(a, qx, xu, p, n0, nr, m); break;
        case 4: panel_pass<4, SGN>(a, qx, xu, p, n0, nr, m); break;
        case 3: panel_pass<3, SGN>(a, qx, xu, p, n0, nr, m); break;
        case 2: panel_pass<2, SGN>(a, qx, xu, p, n0, nr, m); break;
        case 1: panel_pass<1, SGN>(a, qx, xu, p, n0, nr, m); break;
        default: break;
    }
}

// y = quantize_x(x) @ W^T for codes of `bits` (run_tiles; int8 ones without -128); gs % 32 == 0, or
// 16 for signed codes without a zero point (int8, E2M1, 5- and 6-bit less their zero code)
inline void run_panels(const Args& a1, const QX& qx, const uint8_t* w, int bits) {
    const int64_t P = (a1.N + PR - 1) / PR;
    Args a0 = a1;
    const int off = take_zero_code(a0, bits);
    const bool sgn = signed_codes(bits, off);
    std::vector<uint8_t> xu(sgn ? a0.M * a0.K : 0);   // x + 128 (signed codes' u8 operand)
    for (size_t i = 0; i < xu.size(); ++i) xu[i] = uint8_t(qx.q[i]) ^ 0x80;
    const bool wide = Widened::needed(a0, false);
#pragma omp parallel
    {
        Panel p;
        Widened wb;
#pragma omp for schedule(static)
        for (int64_t pi = 0; pi < P; ++pi) {
            const int64_t n0 = pi * PR, nr = std::min<int64_t>(PR, a0.N - n0);
            const Args a = wide ? wb.rows(a0, n0, n0 + nr) : a0;   // (K-quant scales, implied zeros)
            pack_panel(a, w, bits, off, n0, p);
            if (sgn) panel_rows<true>(a, qx, xu.data(), p, n0, nr);
            else panel_rows<false>(a, qx, nullptr, p, n0, nr);
        }
    }
}
#endif  // LLMOPT_IDOT_VNNI

}  // namespace LLMOPT_IDOT_NS
}  // namespace llmopt_cpu_tiles
