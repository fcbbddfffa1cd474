// The CPU decode step's decoder layer in one call: RMSNorm, the q/k/v projection, (q/k norm), RoPE,
// the K/V write into the paged cache, attention over the cache read in place, o_proj and the
// residual, RMSNorm, gate/up, SiLU * up, down_proj and the residual, for M token rows, each at its
// own position attending over its own context (decode, verification and prefill rows). Built with
// cpu_quant.cpp into one library (llmopt/kernels/cpu_quant.py) and held by
// llmopt/worker/cpu_decode.py as torch.classes.llmopt_cpu.DecodeLayer, one per layer.
//
// Why: at batch 1 the Python layer costs ~100 small ops (~13 ms of a 23 ms int8 step on this CPU);
// here the layer is one call, its linears are the tiles and panels of cpu_quant_tiles.h and
// cpu_idot_tiles.h (float32, bfloat16, float16, int8, int4, 5- and 6-bit, fp8 weights decoded in the loop;
// bfloat16 ones by AMX or AVX-512 BF16 for many rows, cpu_bf16_panels.h; see `linear` for which runs
// when) and the elementwise work runs in place on small buffers.
//
// Arithmetic follows llmopt/models/llama.py in float32 (sums in another order: results agree within
// float32 rounding, as tests/engine/test_cpu_decode.py checks against the Python path).
// Cache layout: [num_blocks, block_size, num_kv_heads, head_dim], slot = block * bs + offset; float32,
// bfloat16 or float16 (read widened, written rounded to nearest even), fp8 e4m3fn / e5m2 (one scale a
// tensor), int8 (a scale per slot and head) or int4 (q4_0 blocks: a head's row is head_dim / 32 blocks of
// 18 bytes), written as llmopt/kernels/reference.py quantizes. kivi2: a float residual cache as above
// (written as one), its block size the group size G, and 2-bit pages a row reads for its first
// quant_blocks blocks (llmopt/kernels/kivi.py; the pages are written in Python, not here).
#include <torch/custom_class.h>
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <cmath>
#include <type_traits>
#include <vector>

#include "cpu_quant_tiles.h"

namespace llmopt_cpu_tiles {   // cpu_quant.cpp
bool is_zero_code(const at::Tensor& sz);
float zero_code(const at::Tensor& sz);
KScales k_scales(const at::Tensor& t, int64_t N, int64_t G, const char* what);
}
#define LLMOPT_IDOT_NS avx2
#include "cpu_idot_tiles.h"
#undef LLMOPT_IDOT_NS
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")
#define LLMOPT_IDOT_NS vnni
#define LLMOPT_IDOT_VNNI
#include "cpu_idot_tiles.h"
#undef LLMOPT_IDOT_VNNI
#undef LLMOPT_IDOT_NS
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")
#include "cpu_bf16_panels.h"
#pragma GCC pop_options

namespace {

using namespace llmopt_cpu_tiles;

enum Kind : int64_t { KF32 = 0, KW8 = 1, KW4 = 2, KF8 = 3, KBF16 = 4, KF16 = 5, KW5 = 6, KW6 = 7,
                      KE2M1 = 8, KNF4 = 9, KFP4B = 10 };   // the last three: 4-bit codes into a table (N4)

// grouped integer codes (int8, int4, 5- and 6-bit: cpu_quant.cpp's layouts) and their bits (E2M1
// codes: E2M1_BITS, the integer kernels' name for them)
inline bool is_grouped(int64_t kind) { return kind == KW8 || kind == KW4 || kind == KW5 || kind == KW6; }
inline int code_bits(int64_t kind) {
    return kind == KW4 ? 4 : kind == KW5 ? 5 : kind == KW6 ? 6 : kind == KE2M1 ? E2M1_BITS : 8;
}

// 4-bit float codes (FP4 E2M1, NF4, bitsandbytes' FP4) in the int4 layout, a float32 scale a block
inline bool is_fp4(int64_t kind) { return kind == KE2M1 || kind == KNF4 || kind == KFP4B; }

// float weights: float32, or 16-bit ones widened in the loop (scale 1, one group, no zero)
inline bool is_float(int64_t kind) { return kind == KF32 || kind == KBF16 || kind == KF16; }
const float ONE = 1.f;

// e^x for 8 floats (range reduction by ln 2, degree-6 polynomial on [-ln2/2, ln2/2]; ~1 ulp)
inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline float dot(const float* a, const float* b, int64_t n) {
    __m256 s = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s);
    float t = hsum(s);
    for (; i < n; ++i) t += a[i] * b[i];
    return t;
}

// out = w * (x * rsqrt(mean(x^2) + eps)), row by row
void rms_norm(const float* x, const float* w, int64_t M, int64_t H, float eps, float* out) {
#pragma omp parallel for schedule(static) if (M >= 16)
    for (int64_t m = 0; m < M; ++m) {
        const float* xr = x + m * H;
        float r = 1.f / std::sqrt(dot(xr, xr, H) / (float)H + eps);
        for (int64_t i = 0; i < H; ++i) out[m * H + i] = w[i] * (xr[i] * r);
    }
}

// rotate-half RoPE of `heads` heads of size D in place, cos/sin [D]
void rope(float* x, int64_t heads, int64_t D, const float* c, const float* s) {
    const int64_t h = D / 2;
    float t[512];
    for (int64_t j = 0; j < heads; ++j) {
        float* v = x + j * D;
        for (int64_t i = 0; i < D; ++i) t[i] = v[i] * c[i] + (i < h ? -v[i + h] : v[i - h]) * s[i];
        for (int64_t i = 0; i < D; ++i) v[i] = t[i];
    }
}

bool cpu_has_vnni() {
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw");
}

bool cpu_has_bf16() {
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw");
}

// the linears' kernel choices, set from llmopt/defaults.py when the library loads (tiles_config)
bool use_vnni = cpu_has_vnni();   // the integer kernels: AVX-512 VNNI where the CPU has it
int64_t panel_rows = 5;           // with VNNI, int8-activation linears of this many rows take the panels
int64_t f32_panel_rows = 32;      // float linears of this many rows take the float panels
int64_t f32_bcast_rows = 128;     // ... float32 ones of at most this many, with AVX-512, f32_bcast instead
bool use_bf16dot = false;   // ... and bfloat16 ones AVX-512 BF16 dot products there (tiles_config), or
bool use_amx = false;       // AMX tiles

struct Lin {
    int64_t kind, N, K, gs;
    at::Tensor w, s, sz, bias, perm;
    bool idot;   // integer dot products with int8 activations allowed (cpu_idot_tiles.h)
    float zc;    // an implied zero code (szeros given as one value, Args::zc), else 0
    KScales ks, kz;   // K-quant sub-scales (Args::ks, kz), pointing into s / sz
};

struct Scratch {   // per-call buffers of the linears
    std::vector<float> xp, xsum, d;
    std::vector<int8_t> q;
    std::vector<int32_t> bsum, hsum;
};

// a linear with float activations: the tiles for few rows (their zero-point term needs the per-group
// sums of x, made in xsum), the float panels for many (which decode the zero points into the weight)
void float_linear(Args a, int64_t kind, const uint8_t* w, std::vector<float>& xsum) {
    const bool panels = a.M >= f32_panel_rows;
    if (has_zero(a) && !panels) {
        group_sums(a.x, a.M, a.K, a.gs, xsum);
        a.xsum = xsum.data();
    }
    switch (kind) {
        case KF32:
            if (panels && f32_avx512 && a.M <= f32_bcast_rows && a.K % 8 == 0)
                f32_bcast(a, reinterpret_cast<const float*>(w));
            else if (panels) f32_panels(a, SrcF32{reinterpret_cast<const float*>(w)});
            else if (a.M <= f32_stream_rows) f32_rows<F32>(a, w);
            else run(a, Fn8<F32>{w});
            break;
        case KBF16:
            if (panels && use_bf16dot && a.K % 2 == 0) bf16dot::run(a, w, use_amx);
            else if (panels) f32_panels(a, SrcQ8<BF16>{w});
            else if (a.M <= f32_stream_rows) f32_rows<BF16>(a, w);
            else run(a, Fn8<BF16>{w});
            break;
        case KF16:
            if (panels) f32_panels(a, SrcQ8<F16>{w});
            else if (a.M <= f32_stream_rows) f32_rows<F16>(a, w);
            else run(a, Fn8<F16>{w});
            break;
        case KW8:
            if (panels) f32_panels(a, SrcQ8<I8>{w});
            else run(a, Fn8<I8>{w});
            break;
        case KW4:
            if (panels) f32_panels(a, SrcQ4{w});
            else run(a, Fn4{w});
            break;
        case KW5:
            if (panels) f32_panels(a, SrcQ8<HB<1>>{w});
            else run(a, FnHB<1>{w});
            break;
        case KW6:
            if (panels) f32_panels(a, SrcQ8<HB<2>>{w});
            else run(a, FnHB<2>{w});
            break;
        case KE2M1:
            if (panels) f32_panels(a, SrcQ8<N4<TE2M1>>{w});
            else run(a, Fn8<N4<TE2M1>>{w});
            break;
        case KNF4:
            if (panels) f32_panels(a, SrcQ8<N4<TNF4>>{w});
            else run(a, Fn8<N4<TNF4>>{w});
            break;
        case KFP4B:
            if (panels) f32_panels(a, SrcQ8<N4<TFP4B>>{w});
            else run(a, Fn8<N4<TFP4B>>{w});
            break;
        default:
            if (panels) f32_panels(a, SrcQ8<F8>{w});
            else run(a, Fn8<F8>{w});
            break;
    }
}

// y[m, 0:N] (row stride ldy) = x[m] @ W^T (+ bias) for M rows of x [M, K]; int8_act: quantized
// int8 / int4 / 5- and 6-bit / E2M1 weights take the integer tiles with x quantized per 32 columns
void linear(const Lin& l, const float* x, int64_t M, float* y, int64_t ldy, bool int8_act, Scratch& t) {
    const float* xp = x;
    if (l.perm.defined()) {   // act-order: the columns sorted by group at load, x gathered to match
        t.xp.resize(M * l.K);
        const int64_t* p = l.perm.data_ptr<int64_t>();
        for (int64_t m = 0; m < M; ++m)
            for (int64_t k = 0; k < l.K; ++k) t.xp[m * l.K + k] = x[m * l.K + p[k]];
        xp = t.xp.data();
    }
    Args a{xp, M, l.K, l.N, l.gs, l.K / l.gs, &ONE, 0, nullptr, nullptr, y, ldy};
    if (!is_float(l.kind)) {   // fp16 scales (a GGUF's): read as fp16 bits, widened where used (Args::half)
        a.half = l.s.scalar_type() == at::kHalf;
        a.s = static_cast<const float*>(l.s.data_ptr());
        a.s_stride = l.s.numel() == 1 ? 0 : a.G;
    }
    const float* sz = l.sz.defined() && l.kz.p == nullptr ? static_cast<const float*>(l.sz.data_ptr()) : nullptr;
    a.zc = l.zc;
    a.ks = l.ks;
    a.kz = l.kz;
    const uint8_t* w = static_cast<const uint8_t*>(l.w.data_ptr());
    // int8 activations: the integer panels (VNNI) or tiles; without VNNI, from f32_panel_rows rows the
    // float panels (float activations) beat the AVX2 integer tiles
    if (int8_act && l.idot && (use_vnni || M < f32_panel_rows)) {
        const bool halves = l.gs == QB / 2;   // half-block sums (the tiles' for 5- and 6-bit codes' zero code)
        quantize_x(xp, M, l.K, l.gs, t.q, t.d, t.bsum, t.xsum, halves ? &t.hsum : nullptr);
        if (l.kind == KE2M1)   // the codes are 2v (cpu_idot_tiles.h): dx / 2, exact
            for (float& d : t.d) d *= 0.5f;
        QX qx{t.q.data(), t.d.data(), t.bsum.data(), halves ? t.hsum.data() : nullptr};
        a.sz = sz;
        if (has_zero(a)) a.xsum = t.xsum.data();
        if (use_vnni && M >= panel_rows) {
            vnni::run_panels(a, qx, w, code_bits(l.kind));
        } else if (use_vnni) {
            vnni::run_tiles(a, qx, w, code_bits(l.kind));
        } else {
            avx2::run_tiles(a, qx, w, code_bits(l.kind));
        }
    } else {
        a.sz = sz;
        float_linear(a, l.kind, w, t.xsum);
    }
    if (l.bias.defined()) {
        const float* b = l.bias.data_ptr<float>();
        for (int64_t m = 0; m < M; ++m)
            for (int64_t n = 0; n < l.N; ++n) y[m * ldy + n] += b[n];
    }
}

int64_t width(const std::vector<Lin>& g) {
    int64_t n = 0;
    for (const Lin& l : g) n += l.N;
    return n;
}

// the linears of one input, their outputs side by side in y [M, width(g)]
void linears(const std::vector<Lin>& g, const float* x, int64_t M, float* y, bool int8_act, Scratch& t) {
    const int64_t ldy = width(g);
    int64_t col = 0;
    for (const Lin& l : g) {
        linear(l, x, M, y + col, ldy, int8_act, t);
        col += l.N;
    }
}

// the cache lines of n rows of `bytes` bytes, `stride` bytes apart
template <_mm_hint HINT>
inline void prefetch_rows(const uint8_t* p, int64_t n, int64_t stride, int64_t bytes) {
    for (int64_t j = 0; j < n; ++j)
        for (int64_t d = 0; d < bytes; d += 64) _mm_prefetch(reinterpret_cast<const char*>(p + j * stride + d), HINT);
}

// The paged cache: float32, bfloat16 or float16 elements read widened to float32 and written rounded
// to nearest even, as torch casts; fp8 (e4m3fn, e5m2) codes of x / scale with one scale per tensor
// (ks, vs); int8 codes of x / s with s = absmax / 127 per (slot, kv head) in ksc / vsc
// [num_blocks * block_size, Hkv]; int4: llama.cpp's q4_0 blocks along the head (uint8 caches)
// (llmopt/kernels/reference.py quantize_kv, bit for bit).
struct Cache {
    uint8_t* k; uint8_t* v; int64_t nb, bs;
    at::ScalarType dt;
    int64_t hb;                     // bytes of one head's row (a slot holds Hkv of them)
    float ks, vs;                   // fp8: per-tensor scales (1 for the other dtypes)
    float* ksc; float* vsc;         // int8: per-(slot, head) scales, else null
    const int32_t* bt; int64_t W;   // block tables [M, W]
    const int32_t* lens;            // context lengths [M], the new token included
    // kivi2 (llmopt/kernels/kivi.py), else null: the caches above are the full-precision residual
    // (float32, bfloat16 or float16; its block size bs is the group size G) and row m's first qb[m]
    // table entries are ids of 2-bit pages, kp [np, Hkv, kpb] (keys) and vp [np, Hkv, vpb] (values)
    const uint8_t* kp = nullptr; const uint8_t* vp = nullptr;
    int64_t kpb = 0, vpb = 0, np = 0;
    const int32_t* qb = nullptr;
};

// float32 magnitude a (finite, at most the format's largest) -> the fp8 code, rounded to nearest even
// as c10 converts: below the smallest normal in subnormal steps (a * 2^-step is exact), else the
// float32 bits rounded to the mantissa's width and rebiased (a carry moves into the exponent)
template <int MB, int BIAS, uint32_t MAXC>
inline uint8_t fp8_code(float x) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    const uint32_t sign = (u >> 24) & 0x80u;
    u &= 0x7FFFFFFFu;
    float a;
    std::memcpy(&a, &u, 4);
    uint32_t code;
    if (a < std::ldexp(1.f, 1 - BIAS))
        code = (uint32_t)std::nearbyint(a * std::ldexp(1.f, BIAS - 1 + MB));
    else
        code = std::min(MAXC, ((u + ((1u << (23 - MB - 1)) - 1) + ((u >> (23 - MB)) & 1u)) >> (23 - MB)) -
                                  (uint32_t(127 - BIAS) << MB));
    return uint8_t(sign | code);
}

struct E4M3 : Bytes<1> {   // float8_e4m3fn: the weights' decoder; one code as an f16 (its bits moved up: value * 2^-8)
    static constexpr float MAX = 448.f;
    static inline __m256 at(const uint8_t* r, int64_t c) { return F8::at(r, c); }
    static inline float one(const uint8_t* r, int64_t c) {
        const uint32_t b = r[c];
        return _cvtsh_ss(uint16_t(((b & 0x80u) << 8) | ((b & 0x7Fu) << 7))) * 256.f;
    }
    static inline uint8_t code(float x) { return fp8_code<3, 7, 0x7E>(x); }
};

struct E5M2 : Bytes<1> {   // float8_e5m2: the high byte of an f16
    static constexpr float MAX = 57344.f;
    static inline __m256 at(const uint8_t* r, int64_t c) {
        __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(r + c)));
        return _mm256_cvtph_ps(_mm_slli_epi16(b, 8));
    }
    static inline float one(const uint8_t* r, int64_t c) { return _cvtsh_ss(uint16_t(uint32_t(r[c]) << 8)); }
    static inline uint8_t code(float x) { return fp8_code<2, 15, 0x7B>(x); }
};

struct I8 : Bytes<1> {   // int8 codes, their scale applied by the caller
    static inline __m256 at(const uint8_t* r, int64_t c) {
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(r + c))));
    }
    static inline float one(const uint8_t* r, int64_t c) { return float(reinterpret_cast<const int8_t*>(r)[c]); }
};

// q4_0 blocks: per 32 values an fp16 d, then 16 bytes with value j's code in byte j's low nibble and
// value j + 16's in its high one; x = (q - 8) * d, exact in float32 (as reference.dequantize_q4)
struct Q4 {
    static inline int64_t rowb(int64_t D) { return D / 32 * 18; }
    static inline float d(const uint8_t* blk) {
        uint16_t h;
        std::memcpy(&h, blk, 2);
        return _cvtsh_ss(h);
    }
    // a block's 32 values q - 8 (before d) as floats: values 0-7, 8-15, 16-23, 24-31
    static inline void codes(const uint8_t* blk, __m256 out[4]) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2)), m = _mm_set1_epi8(0x0F);
        const __m128i e = _mm_set1_epi8(8);
        const __m128i lo = _mm_sub_epi8(_mm_and_si128(b, m), e), hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(b, 4), m), e);
        out[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
        out[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
        out[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
        out[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
    }
    // Hkv heads of D values (D % 32 == 0) -> their blocks, as llama.cpp's quantize_row_q4_0_ref: d = the
    // first value of largest magnitude / -8, codes trunc(x / d + 8.5) in float32 (no fused multiply-add)
    static inline void put(const float* x, uint8_t* o, int64_t n) {
        for (int64_t i = 0; i < n; i += 32, o += 18) {
            const float* xb = x + i;
            int64_t top = 0;
            for (int64_t j = 1; j < 32; ++j)
                if (std::fabs(xb[j]) > std::fabs(xb[top])) top = j;
            const float dv = xb[top] / -8.f, inv = dv != 0.f ? 1.f / dv : 0.f;
            const uint16_t h = _cvtss_sh(dv, _MM_FROUND_TO_NEAREST_INT);
            std::memcpy(o, &h, 2);
            uint8_t q[32];
            for (int j = 0; j < 32; ++j) {
                float t = xb[j] * inv;
                asm volatile("" : "+x"(t));   // rounded to float32 before the add, as the reference
                q[j] = uint8_t(std::min(15, std::max(0, int(t + 8.5f))));
            }
            for (int j = 0; j < 16; ++j) o[2 + j] = uint8_t(q[j] | (q[j + 16] << 4));
        }
    }
};

// dot(q, row) for n elements of a cache row (E: F32, BF16, F16)
template <class E>
inline float dot_row(const float* q, const uint8_t* r, int64_t n) {
    __m256 s = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), E::at(r, i), s);
    float t = hsum(s);
    for (; i < n; ++i) t += q[i] * E::one(r, i);
    return t;
}

// the scores (q . row_j (+ add with ADD)) * kscale (times kf[j * Hkv] when kf: int8 keys' scales) of
// keys j in [j0, j1), row j at first + (j - j0) * rb (element type E: F32, BF16, F16, fp8, int8), into
// pg[j], their max into mx
template <class E, bool ADD = false>
inline void score_rows(const float* qg, const uint8_t* first, int64_t rb, int64_t D, int64_t j0, int64_t j1,
                       float add, float kscale, const float* kf, int64_t Hkv, float* pg, float& mx) {
    int64_t j = j0;
    if (D % 8 == 0)
        for (; j + 4 <= j1; j += 4) {   // 4 keys at once: one 4-way horizontal sum, not four
            const uint8_t* k0 = first + (j - j0) * rb;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t d = 0; d < D; d += 8) {
                const __m256 qv = _mm256_loadu_ps(qg + d);
                a0 = _mm256_fmadd_ps(qv, E::at(k0, d), a0);
                a1 = _mm256_fmadd_ps(qv, E::at(k0 + rb, d), a1);
                a2 = _mm256_fmadd_ps(qv, E::at(k0 + 2 * rb, d), a2);
                a3 = _mm256_fmadd_ps(qv, E::at(k0 + 3 * rb, d), a3);
            }
            const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
            __m128 sc = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
            if constexpr (ADD) sc = _mm_add_ps(sc, _mm_set1_ps(add));
            sc = _mm_mul_ps(sc, _mm_set1_ps(kscale));
            if (kf) sc = _mm_mul_ps(sc, _mm_setr_ps(kf[j * Hkv], kf[(j + 1) * Hkv], kf[(j + 2) * Hkv], kf[(j + 3) * Hkv]));
            _mm_storeu_ps(pg + j, sc);
            mx = std::max(mx, std::max(std::max(pg[j], pg[j + 1]), std::max(pg[j + 2], pg[j + 3])));
        }
    for (; j < j1; ++j) {
        float sc = dot_row<E>(qg, first + (j - j0) * rb, D);
        if constexpr (ADD) sc += add;
        pg[j] = sc * kscale;
        if (kf) pg[j] *= kf[j * Hkv];
        mx = std::max(mx, pg[j]);
    }
}

// acc[0, D) += sum of pg[j] * row_j over keys j in [j0, j1), row j at first + (j - j0) * rb (element
// type E), 64 columns at a time in registers
template <class E>
inline void accumulate_rows(const float* pg, const uint8_t* first, int64_t rb, int64_t D, int64_t j0, int64_t j1,
                            float* acc) {
    const int64_t D8 = D / 8 * 8;
    for (int64_t d0 = 0; d0 < D8; d0 += 64) {
        const int64_t w8 = std::min<int64_t>(64, D8 - d0) / 8;
        __m256 a[8];
        for (int i = 0; i < w8; ++i) a[i] = _mm256_loadu_ps(acc + d0 + 8 * i);
        for (int64_t j = j0; j < j1; ++j) {
            const __m256 w = _mm256_set1_ps(pg[j]);
            const uint8_t* r = first + (j - j0) * rb;
            if (w8 == 8)
                for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(w, E::at(r, d0 + 8 * i), a[i]);
            else
                for (int i = 0; i < w8; ++i) a[i] = _mm256_fmadd_ps(w, E::at(r, d0 + 8 * i), a[i]);
        }
        for (int i = 0; i < w8; ++i) _mm256_storeu_ps(acc + d0 + 8 * i, a[i]);
    }
    for (int64_t d = D8; d < D; ++d) {   // odd head sizes: the plain loop
        float t = acc[d];
        for (int64_t j = j0; j < j1; ++j) t += pg[j] * E::one(first + (j - j0) * rb, d);
        acc[d] = t;
    }
}

// score_rows for G heads of one GQA group at once (their queries D apart from qg; pg[h] and mx[h] head
// h's): each key row is widened once for the G heads, and each head's sums run in score_rows' order
// and reduction, so its scores are the same bits
template <class E, int G>
inline void score_rows_group(const float* qg, const uint8_t* first, int64_t rb, int64_t D, int64_t j0, int64_t j1,
                             float kscale, const float* kf, int64_t Hkv, float* const* pg, float* mx) {
    int64_t j = j0;
    if (D % 8 == 0)
        for (; j + 4 <= j1; j += 4) {
            const uint8_t* k0 = first + (j - j0) * rb;
            __m256 a[G][4];
            for (int h = 0; h < G; ++h)
                for (int r = 0; r < 4; ++r) a[h][r] = _mm256_setzero_ps();
            for (int64_t d = 0; d < D; d += 8)
                for (int r = 0; r < 4; ++r) {
                    const __m256 kv = E::at(k0 + r * rb, d);
                    for (int h = 0; h < G; ++h) a[h][r] = _mm256_fmadd_ps(_mm256_loadu_ps(qg + h * D + d), kv, a[h][r]);
                }
            const __m128 kfs = kf ? _mm_setr_ps(kf[j * Hkv], kf[(j + 1) * Hkv], kf[(j + 2) * Hkv], kf[(j + 3) * Hkv])
                                  : _mm_set1_ps(1.f);
            for (int h = 0; h < G; ++h) {
                const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a[h][0], a[h][1]), _mm256_hadd_ps(a[h][2], a[h][3]));
                __m128 sc = _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)),
                                       _mm_set1_ps(kscale));
                if (kf) sc = _mm_mul_ps(sc, kfs);
                float* ph = pg[h] + j;
                _mm_storeu_ps(ph, sc);
                mx[h] = std::max(mx[h], std::max(std::max(ph[0], ph[1]), std::max(ph[2], ph[3])));
            }
        }
    if (j < j1)
        for (int h = 0; h < G; ++h)
            score_rows<E>(qg + h * D, first + (j - j0) * rb, rb, D, j, j1, 0.f, kscale, kf, Hkv, pg[h], mx[h]);
}

// out[h][d0, d0 + 8 * W) = (sum over keys j in [lo, L) of w_h(j) * value row j) * inv[h] for G heads of
// one GQA group (W <= 4), w_h(j) = pg[h][j] (times vf[j * Hkv] when vf: int8 values' scales): each value
// row is widened once for the G heads; each column sums the keys in order from zero, as a head alone
// would, so the outputs are the same bits
template <class E, int G, int W>
inline void values_group(const Cache& c, const int32_t* table, int64_t hk, int64_t Hkv, int64_t rb, int64_t hb,
                         int64_t lo, int64_t L, int64_t d0, const float* const* pg, const float* inv,
                         float* const* out) {
    __m256 acc[G][W];
    for (int h = 0; h < G; ++h)
        for (int i = 0; i < W; ++i) acc[h][i] = _mm256_setzero_ps();
    for (int64_t b = lo / c.bs; b * c.bs < L; ++b) {
        const int64_t j0 = std::max(lo, b * c.bs), j1 = std::min(L, (b + 1) * c.bs);
        const uint8_t* vb = c.v + ((int64_t)table[b] * c.bs) * rb + hk * hb;
        const float* vf = c.vsc ? c.vsc + ((int64_t)table[b] * c.bs - b * c.bs) * Hkv + hk : nullptr;
        for (int64_t j = j0; j < j1; ++j) {
            __m256 w[G];
            for (int h = 0; h < G; ++h) w[h] = _mm256_set1_ps(vf ? pg[h][j] * vf[j * Hkv] : pg[h][j]);
            const uint8_t* vv = vb + (j - b * c.bs) * rb;
            for (int i = 0; i < W; ++i) {
                const __m256 x = E::at(vv, d0 + 8 * i);
                for (int h = 0; h < G; ++h) acc[h][i] = _mm256_fmadd_ps(w[h], x, acc[h][i]);
            }
        }
    }
    for (int h = 0; h < G; ++h) {
        const __m256 iv = _mm256_set1_ps(inv[h]);
        for (int i = 0; i < W; ++i) _mm256_storeu_ps(out[h] + d0 + 8 * i, _mm256_mul_ps(acc[h][i], iv));
    }
}

// values_group over all D columns (D % 8 == 0): 32 at a time, then the rest
template <class E, int G>
inline void values_heads(const Cache& c, const int32_t* table, int64_t hk, int64_t Hkv, int64_t rb, int64_t hb,
                         int64_t lo, int64_t L, int64_t D, const float* const* pg, const float* inv, float* const* out) {
    int64_t d0 = 0;
    for (; d0 + 32 <= D; d0 += 32) values_group<E, G, 4>(c, table, hk, Hkv, rb, hb, lo, L, d0, pg, inv, out);
    if (D - d0 == 24) values_group<E, G, 3>(c, table, hk, Hkv, rb, hb, lo, L, d0, pg, inv, out);
    else if (D - d0 == 16) values_group<E, G, 2>(c, table, hk, Hkv, rb, hb, lo, L, d0, pg, inv, out);
    else if (D - d0 == 8) values_group<E, G, 1>(c, table, hk, Hkv, rb, hb, lo, L, d0, pg, inv, out);
}

// kivi2's 2-bit pages (llmopt/kernels/kivi.py): code c of a token's row in bits 2 * (c % 4) of byte
// c / 4. codes16: 16 codes from column c (a multiple of 4) as floats, codes c.. c + 7 in lo, the next 8
// in hi (one 4-byte word broadcast, shifted per lane); codes8: 8 codes; code1: one
inline void codes16(const uint8_t* r, int64_t c, __m256& lo, __m256& hi) {
    int32_t w;
    std::memcpy(&w, r + c / 4, 4);
    const __m256i v = _mm256_set1_epi32(w), three = _mm256_set1_epi32(3);
    lo = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(v, _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)), three));
    hi = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(v, _mm256_setr_epi32(16, 18, 20, 22, 24, 26, 28, 30)),
                                             three));
}

inline __m256 codes8(const uint8_t* r, int64_t c) {
    uint16_t w;
    std::memcpy(&w, r + c / 4, 2);
    const __m256i v = _mm256_srlv_epi32(_mm256_set1_epi32(w), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
    return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(3)));
}

inline float code1(const uint8_t* r, int64_t c) { return float((r[c / 4] >> (2 * (c % 4))) & 3); }

inline float half_at(const uint8_t* p, int64_t i) {
    uint16_t h;
    std::memcpy(&h, p + 2 * i, 2);
    return _cvtsh_ss(h);
}

// The scores of keys [t0, t1) (offsets in the block) of one block's key page (fp16 scale[D], fp16
// zero[D], codes [G][D / 4]: key = code * scale[c] + zero[c]) for the `group` query heads q [group, D]:
// (q * scale) . codes + q . zero, times kscale; the codes decoded once for the group into rows
// ([t1 - t0, D] floats), q * scale and q . zero made once per head. Head g's scores into pb[g * ldp + t].
void page_scores(const uint8_t* page, int64_t D, int64_t t0, int64_t t1, const float* q, int64_t group, float kscale,
                 float* pb, int64_t ldp, float* mx, float* rows, float* sz, float* qs) {
    const uint8_t* cd = page + 4 * D + t0 * D / 4;   // rows t0.. are contiguous: decoded as one run
    const int64_t nc = (t1 - t0) * D;
    int64_t i = 0;
    for (; i + 16 <= nc; i += 16) {
        __m256 lo, hi;
        codes16(cd, i, lo, hi);
        _mm256_storeu_ps(rows + i, lo);
        _mm256_storeu_ps(rows + i + 8, hi);
    }
    for (; i + 8 <= nc; i += 8) _mm256_storeu_ps(rows + i, codes8(cd, i));
    for (; i < nc; ++i) rows[i] = code1(cd, i);
    for (i = 0; i + 8 <= 2 * D; i += 8)   // scale[D], zero[D]
        _mm256_storeu_ps(sz + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(page + 2 * i))));
    for (; i < 2 * D; ++i) sz[i] = half_at(page, i);
    for (int64_t g = 0; g < group; ++g) {
        const float* qg = q + g * D;
        int64_t c = 0;
        for (; c + 8 <= D; c += 8) _mm256_storeu_ps(qs + c, _mm256_mul_ps(_mm256_loadu_ps(qg + c), _mm256_loadu_ps(sz + c)));
        for (; c < D; ++c) qs[c] = qg[c] * sz[c];
        score_rows<F32, true>(qs, reinterpret_cast<const uint8_t*>(rows), 4 * D, D, t0, t1, dot(qg, sz + D, D), kscale,
                              nullptr, 0, pb + g * ldp, mx[g]);
    }
}

// Values [t0, t1) of one block's value page (fp16 scale[G][D / V], fp16 zero[G][D / V], codes [G][D / 4],
// V = min(G, D) channels a group: value = code * scale[t][c / V] + zero[t][c / V]) dequantized into rows
// [t1 - t0, D]: once for the group's query heads, which then read them as float32 rows
void page_values(const uint8_t* page, int64_t G, int64_t D, int64_t t0, int64_t t1, float* rows) {
    const int64_t V = std::min(G, D), ng = D / V;
    const uint8_t *sp = page, *zp = page + 2 * G * ng, *cd = page + 4 * G * ng;
    for (int64_t t = t0; t < t1; ++t) {
        const uint8_t* r = cd + t * D / 4;
        float* out = rows + (t - t0) * D;
        for (int64_t k = 0; k < ng; ++k) {
            const float s = half_at(sp, t * ng + k), z = half_at(zp, t * ng + k);
            const __m256 vs = _mm256_set1_ps(s), vz = _mm256_set1_ps(z);
            int64_t c = k * V;
            for (; c + 16 <= (k + 1) * V; c += 16) {
                __m256 lo, hi;
                codes16(r, c, lo, hi);
                _mm256_storeu_ps(out + c, _mm256_fmadd_ps(lo, vs, vz));
                _mm256_storeu_ps(out + c + 8, _mm256_fmadd_ps(hi, vs, vz));
            }
            for (; c + 8 <= (k + 1) * V; c += 8) _mm256_storeu_ps(out + c, _mm256_fmadd_ps(codes8(r, c), vs, vz));
            for (; c < (k + 1) * V; ++c) out[c] = std::fma(code1(r, c), s, z);
        }
    }
}

// kivi2's p @ V for row m and KV head hk: block by block, a page's values dequantized once for the
// group's query heads, residual rows (E) read in place; sums in acc [group, D], out [group, D] = acc * inv.
// p: the softmax numerators, head g's of key j at p[g * ldp + j - lo]
template <class E>
void page_attend_values(const Cache& c, int64_t m, int64_t hk, int64_t Hkv, int64_t D, int64_t lo, int64_t L,
                        const float* p, int64_t ldp, int64_t group, const float* inv, float* out, float* rows,
                        float* acc) {
    const int32_t* table = c.bt + m * c.W;
    const int64_t qbm = c.qb[m], rb = Hkv * c.hb;
    std::fill(acc, acc + group * D, 0.f);
    for (int64_t b = lo / c.bs; b * c.bs < L; ++b) {
        const int64_t j0 = std::max(lo, b * c.bs), j1 = std::min(L, (b + 1) * c.bs);
        if (b < qbm) {
            page_values(c.vp + ((int64_t)table[b] * Hkv + hk) * c.vpb, c.bs, D, j0 - b * c.bs, j1 - b * c.bs, rows);
            for (int64_t g = 0; g < group; ++g)
                accumulate_rows<F32>(p + g * ldp - lo, reinterpret_cast<const uint8_t*>(rows), 4 * D, D, j0, j1,
                                     acc + g * D);
        } else {
            const uint8_t* first = c.v + ((int64_t)table[b] * c.bs + j0 - b * c.bs) * rb + hk * c.hb;
            for (int64_t g = 0; g < group; ++g) accumulate_rows<E>(p + g * ldp - lo, first, rb, D, j0, j1, acc + g * D);
        }
    }
    for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < D; ++d) out[g * D + d] = acc[g * D + d] * inv[g];
}

// o[m, hq] = softmax(q k^T * scale) v over the context of row m (its last token is the query), with
// the keys of the last `window` positions only when window > 0. q rows have stride ldq, o rows Hq * D.
// One task per (row, kv head): its `group` query heads share each K/V row's loads; keys are walked
// block by block (no division per key). E: the cache's element type; its codes' factors (the fp8
// scale, an int8 row's scale) multiply the scores and the softmax weights, not the rows.
// kivi2 (float residual caches with pages, c.kp): a row's first c.qb[m] blocks are read from the 2-bit
// pages (page_scores, page_attend_values), the rest from the residual as a float cache.
template <class E>
void attention_t(const float* q, int64_t ldq, int64_t M, int64_t Hq, int64_t Hkv, int64_t D, const Cache& c,
               float scale, int64_t window, float* o) {
    constexpr bool FLOAT = std::is_same_v<E, F32> || std::is_same_v<E, BF16> || std::is_same_v<E, F16>;
    const int64_t group = Hq / Hkv, hb = E::rowb(D), rb = Hkv * hb;   // bytes of one head's row, between slots
    const float kscale = scale * c.ks, vscale = c.vs;  // (exact for the float caches: ks = vs = 1)
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < M * Hkv; ++t) {
        const int64_t m = t / Hkv, hk = t % Hkv;
        const int64_t L = c.lens[m], lo = window > 0 ? std::max<int64_t>(0, L - window) : 0, n = L - lo;
        const int32_t* table = c.bt + m * c.W;
        const int64_t qbm = c.qb ? c.qb[m] : 0;   // kivi2: blocks b < qbm are pages
        std::vector<float> p(group * (n + 8));
        std::vector<float> rows(c.kp ? c.bs * D + 3 * D : 0), acc(c.kp ? group * D : 0);   // kivi2's scratch
        float mx[64];
        for (int64_t g = 0; g < group; ++g) mx[g] = -INFINITY;
        for (int64_t b = lo / c.bs; b * c.bs < L; ++b) {   // scores, block by block
            const int64_t j0 = std::max(lo, b * c.bs), j1 = std::min(L, (b + 1) * c.bs);
            if constexpr (FLOAT) {
                if (b < qbm) {   // kivi2: a page (the next one's keys into L1, this one's values into L2)
                    const uint8_t* kpg = c.kp + ((int64_t)table[b] * Hkv + hk) * c.kpb;
                    if (b + 1 < qbm)
                        prefetch_rows<_MM_HINT_T0>(c.kp + ((int64_t)table[b + 1] * Hkv + hk) * c.kpb, 1, 0, c.kpb);
                    prefetch_rows<_MM_HINT_T1>(c.vp + ((int64_t)table[b] * Hkv + hk) * c.vpb, 1, 0, c.vpb);
                    float* sz = rows.data() + c.bs * D;
                    page_scores(kpg, D, j0 - b * c.bs, j1 - b * c.bs, q + m * ldq + hk * group * D, group, kscale,
                                p.data() + b * c.bs - lo, n + 8, mx, rows.data(), sz, sz + 2 * D);
                    continue;
                }
            }
            const uint8_t* kb = c.k + ((int64_t)table[b] * c.bs) * rb + hk * hb;
            // the prefetchers do not follow the table: keys two blocks ahead into L1, this block's
            // values into L2 for the p @ V pass (first block: its keys too)
            if (b == std::max(lo / c.bs, qbm)) {
                prefetch_rows<_MM_HINT_T0>(kb, c.bs, rb, hb);
                if ((b + 1) * c.bs < L)
                    prefetch_rows<_MM_HINT_T0>(c.k + ((int64_t)table[b + 1] * c.bs) * rb + hk * hb, c.bs, rb, hb);
            }
            if ((b + 2) * c.bs < L)
                prefetch_rows<_MM_HINT_T0>(c.k + ((int64_t)table[b + 2] * c.bs) * rb + hk * hb, c.bs, rb, hb);
            prefetch_rows<_MM_HINT_T1>(c.v + ((int64_t)table[b] * c.bs) * rb + hk * hb, c.bs, rb, hb);
            const float* kf = c.ksc ? c.ksc + ((int64_t)table[b] * c.bs - b * c.bs) * Hkv + hk : nullptr;  // kf[j * Hkv]
            if constexpr (std::is_same_v<E, Q4>) {   // per block: d * (q . (codes - 8)), one d a block
                for (int64_t g = 0; g < group; ++g) {
                    const float* qg = q + m * ldq + (hk * group + g) * D;
                    float* pg = p.data() + g * (n + 8) - lo;   // pg[j], j in [lo, L)
                    int64_t j = j0;
                    for (; j + 4 <= j1; j += 4) {   // 4 keys at once: one 4-way horizontal sum
                        const uint8_t* k0 = kb + (j - b * c.bs) * rb;
                        __m256 a[4], cv[4];
                        for (int r = 0; r < 4; ++r) a[r] = _mm256_setzero_ps();
                        for (int64_t k = 0; k < D / 32; ++k) {
                            const float* qk = qg + 32 * k;
                            const __m256 q0 = _mm256_loadu_ps(qk), q1 = _mm256_loadu_ps(qk + 8),
                                         q2 = _mm256_loadu_ps(qk + 16), q3 = _mm256_loadu_ps(qk + 24);
                            for (int r = 0; r < 4; ++r) {
                                const uint8_t* blk = k0 + r * rb + 18 * k;
                                Q4::codes(blk, cv);
                                __m256 t = _mm256_mul_ps(q0, cv[0]);
                                t = _mm256_fmadd_ps(q1, cv[1], t);
                                t = _mm256_fmadd_ps(q2, cv[2], t);
                                t = _mm256_fmadd_ps(q3, cv[3], t);
                                a[r] = _mm256_fmadd_ps(_mm256_set1_ps(Q4::d(blk)), t, a[r]);
                            }
                        }
                        const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
                        const __m128 sc = _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)),
                                                     _mm_set1_ps(kscale));
                        _mm_storeu_ps(pg + j, sc);
                        mx[g] = std::max(mx[g], std::max(std::max(pg[j], pg[j + 1]), std::max(pg[j + 2], pg[j + 3])));
                    }
                    for (; j < j1; ++j) {
                        const uint8_t* kr = kb + (j - b * c.bs) * rb;
                        __m256 a = _mm256_setzero_ps(), cv[4];
                        for (int64_t k = 0; k < D / 32; ++k) {
                            const uint8_t* blk = kr + 18 * k;
                            const float* qk = qg + 32 * k;
                            Q4::codes(blk, cv);
                            __m256 t = _mm256_mul_ps(_mm256_loadu_ps(qk), cv[0]);
                            t = _mm256_fmadd_ps(_mm256_loadu_ps(qk + 8), cv[1], t);
                            t = _mm256_fmadd_ps(_mm256_loadu_ps(qk + 16), cv[2], t);
                            t = _mm256_fmadd_ps(_mm256_loadu_ps(qk + 24), cv[3], t);
                            a = _mm256_fmadd_ps(_mm256_set1_ps(Q4::d(blk)), t, a);
                        }
                        pg[j] = hsum(a) * kscale;
                        mx[g] = std::max(mx[g], pg[j]);
                    }
                }
            } else {
                for (int64_t g = 0; g < group; g += 3) {   // the group's heads three at a time
                    const float* qg = q + m * ldq + (hk * group + g) * D;
                    float* pg[3];
                    for (int64_t h = 0; h < 3 && g + h < group; ++h) pg[h] = p.data() + (g + h) * (n + 8) - lo;
                    const uint8_t* first = kb + (j0 - b * c.bs) * rb;
                    if (group - g >= 3) score_rows_group<E, 3>(qg, first, rb, D, j0, j1, kscale, kf, Hkv, pg, mx + g);
                    else if (group - g == 2) score_rows_group<E, 2>(qg, first, rb, D, j0, j1, kscale, kf, Hkv, pg, mx + g);
                    else score_rows<E>(qg, first, rb, D, j0, j1, 0.f, kscale, kf, Hkv, pg[0], mx[g]);
                }
            }
        }
        float inv[64];
        for (int64_t g = 0; g < group; ++g) {   // softmax numerators and their sums
            float* pg = &p[g * (n + 8)];
            __m256 vs = _mm256_setzero_ps(), vm = _mm256_set1_ps(mx[g]);
            int64_t i = 0;
            for (; i + 8 <= n; i += 8) {
                __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(pg + i), vm));
                _mm256_storeu_ps(pg + i, e);
                vs = _mm256_add_ps(vs, e);
            }
            float sum = hsum(vs);
            for (; i < n; ++i) {
                pg[i] = std::exp(pg[i] - mx[g]);
                sum += pg[i];
            }
            inv[g] = 1.f / sum * vscale;
        }
        if constexpr (FLOAT) {
            if (c.kp) {   // kivi2: p @ V block by block
                page_attend_values<E>(c, m, hk, Hkv, D, lo, L, p.data(), n + 8, group, inv, o + (m * Hq + hk * group) * D,
                                      rows.data(), acc.data());
                continue;
            }
        }
        if constexpr (!std::is_same_v<E, Q4>) {
            if (D % 8 == 0) {   // p @ V: up to 32 columns of three heads at a time in registers over all keys
                for (int64_t g = 0; g < group; g += 3) {
                    const float* pg[3];
                    float* out[3];
                    for (int64_t h = 0; h < 3 && g + h < group; ++h) {
                        pg[h] = p.data() + (g + h) * (n + 8) - lo;
                        out[h] = o + (m * Hq + hk * group + g + h) * D;
                    }
                    if (group - g >= 3) values_heads<E, 3>(c, table, hk, Hkv, rb, hb, lo, L, D, pg, inv + g, out);
                    else if (group - g == 2) values_heads<E, 2>(c, table, hk, Hkv, rb, hb, lo, L, D, pg, inv + g, out);
                    else values_heads<E, 1>(c, table, hk, Hkv, rb, hb, lo, L, D, pg, inv + g, out);
                }
                continue;
            }
        }
        for (int64_t g = 0; g < group; ++g) {   // p @ V a head at a time: int4 (64 columns in registers), odd D
            float* out = o + (m * Hq + hk * group + g) * D;
            const float* pg = p.data() + g * (n + 8) - lo;   // pg[j], j in [lo, L)
            if constexpr (std::is_same_v<E, Q4>) {   // per key and block: (w * d) * (codes - 8), one d a block
                for (int64_t d0 = 0; d0 < D; d0 += 64) {
                    const int64_t nb = std::min<int64_t>(64, D - d0) / 32;   // blocks in this chunk: 1 or 2
                    __m256 acc[8], cv[4];
                    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
                    for (int64_t b = lo / c.bs; b * c.bs < L; ++b) {
                        const int64_t j0 = std::max(lo, b * c.bs), j1 = std::min(L, (b + 1) * c.bs);
                        const uint8_t* vb = c.v + ((int64_t)table[b] * c.bs) * rb + hk * hb + d0 / 32 * 18;
                        for (int64_t j = j0; j < j1; ++j) {
                            const uint8_t* vv = vb + (j - b * c.bs) * rb;
                            for (int64_t k = 0; k < nb; ++k) {
                                const __m256 w = _mm256_set1_ps(pg[j] * Q4::d(vv + 18 * k));
                                Q4::codes(vv + 18 * k, cv);
                                for (int i = 0; i < 4; ++i) acc[4 * k + i] = _mm256_fmadd_ps(w, cv[i], acc[4 * k + i]);
                            }
                        }
                    }
                    const __m256 iv = _mm256_set1_ps(inv[g]);
                    for (int i = 0; i < 4 * nb; ++i) _mm256_storeu_ps(out + d0 + 8 * i, _mm256_mul_ps(acc[i], iv));
                }
            } else {   // odd head sizes (D % 8 != 0): the plain loops
                std::fill(out, out + D, 0.f);
                for (int64_t b = lo / c.bs; b * c.bs < L; ++b) {
                    const int64_t j0 = std::max(lo, b * c.bs), j1 = std::min(L, (b + 1) * c.bs);
                    const uint8_t* vb = c.v + ((int64_t)table[b] * c.bs) * rb + hk * hb;
                    const float* vf = c.vsc ? c.vsc + ((int64_t)table[b] * c.bs - b * c.bs) * Hkv + hk : nullptr;
                    for (int64_t j = j0; j < j1; ++j) {
                        const float w = vf ? pg[j] * vf[j * Hkv] : pg[j];
                        for (int64_t d = 0; d < D; ++d) out[d] += w * E::one(vb + (j - b * c.bs) * rb, d);
                    }
                }
                for (int64_t d = 0; d < D; ++d) out[d] *= inv[g];
            }
        }
    }
}

void attention(const float* q, int64_t ldq, int64_t M, int64_t Hq, int64_t Hkv, int64_t D, const Cache& c,
               float scale, int64_t window, float* o) {
    if (c.dt == at::kBFloat16) attention_t<BF16>(q, ldq, M, Hq, Hkv, D, c, scale, window, o);
    else if (c.dt == at::kHalf) attention_t<F16>(q, ldq, M, Hq, Hkv, D, c, scale, window, o);
    else if (c.dt == at::kFloat8_e4m3fn) attention_t<E4M3>(q, ldq, M, Hq, Hkv, D, c, scale, window, o);
    else if (c.dt == at::kFloat8_e5m2) attention_t<E5M2>(q, ldq, M, Hq, Hkv, D, c, scale, window, o);
    else if (c.dt == at::kChar) attention_t<I8>(q, ldq, M, Hq, Hkv, D, c, scale, window, o);
    else if (c.dt == at::kByte) attention_t<Q4>(q, ldq, M, Hq, Hkv, D, c, scale, window, o);
    else attention_t<F32>(q, ldq, M, Hq, Hkv, D, c, scale, window, o);
}

// x / scale clamped to the format's range, as fp8 codes
template <class E>
void put_fp8(const float* x, uint8_t* o, int64_t n, float scale) {
    for (int64_t i = 0; i < n; ++i) o[i] = E::code(std::min(E::MAX, std::max(-E::MAX, x[i] / scale)));
}

// int8 codes of Hkv heads of D values, their scales s = absmax / 127 into sc[0, Hkv)
void put_int8(const float* x, uint8_t* o, float* sc, int64_t Hkv, int64_t D) {
    for (int64_t h = 0; h < Hkv; ++h) {
        const float* xh = x + h * D;
        float amax = 0.f;
        for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(xh[d]));
        const float s = amax / 127.f, div = std::max(s, 1e-30f);
        sc[h] = s;
        for (int64_t d = 0; d < D; ++d)
            o[h * D + d] = uint8_t(int8_t(std::min(127.f, std::max(-127.f, std::nearbyint(xh[d] / div)))));
    }
}

// rows k, v of Hkv heads of D floats into the cache at `slot`, in its element type
void write_slot(const Cache& c, int64_t slot, const float* k, const float* v, int64_t Hkv, int64_t D) {
    const int64_t n = Hkv * D;
    uint8_t *kd = c.k + slot * Hkv * c.hb, *vd = c.v + slot * Hkv * c.hb;
    switch (c.dt) {
        case at::kByte: Q4::put(k, kd, n); Q4::put(v, vd, n); break;
        case at::kBFloat16: BF16::put(k, kd, n); BF16::put(v, vd, n); break;
        case at::kHalf: F16::put(k, kd, n); F16::put(v, vd, n); break;
        case at::kFloat8_e4m3fn: put_fp8<E4M3>(k, kd, n, c.ks); put_fp8<E4M3>(v, vd, n, c.vs); break;
        case at::kFloat8_e5m2: put_fp8<E5M2>(k, kd, n, c.ks); put_fp8<E5M2>(v, vd, n, c.vs); break;
        case at::kChar: put_int8(k, kd, c.ksc + slot * Hkv, Hkv, D); put_int8(v, vd, c.vsc + slot * Hkv, Hkv, D); break;
        default: F32::put(k, kd, n); F32::put(v, vd, n);
    }
}

void check_f32(const at::Tensor& t, const char* what) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu(),
                what, " must be a contiguous float32 CPU tensor");
}

// group scales of grouped codes may be fp16 (a GGUF's, as stored); every other kind's are float32
void check_scales(const at::Tensor& t, int64_t kind, const char* what) {
    if (is_grouped(kind) && t.scalar_type() == at::kHalf) {
        TORCH_CHECK(t.is_contiguous() && t.device().is_cpu(), what, " must be a contiguous CPU tensor");
        return;
    }
    check_f32(t, what);
}

// an optional tensor argument: undefined or empty means none
inline bool given(const at::Tensor& t) { return t.defined() && t.numel() > 0; }

// checks the cache (and its scales), tables and lengths for M decode rows; every block a row reads
// must exist. ks, vs: an fp8 cache's scales; ksc, vsc: an int8 cache's [num_blocks, block_size, Hkv].
// kivi2: kpages, vpages its pages uint8 [num_pages, Hkv, key / value page bytes], qblocks int32 [M] each
// row's page count (undefined or empty: no pages); the caches are then its residual, of block size G
Cache make_cache(const at::Tensor& kc, const at::Tensor& vc, double ks, double vs, const at::Tensor& ksc,
                 const at::Tensor& vsc, const at::Tensor& bt, const at::Tensor& lens, int64_t M, int64_t Hkv,
                 int64_t D, const at::Tensor& kpages = {}, const at::Tensor& vpages = {}, const at::Tensor& qblocks = {}) {
    const auto dt = kc.scalar_type();
    TORCH_CHECK((dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf || dt == at::kFloat8_e4m3fn ||
                 dt == at::kFloat8_e5m2 || dt == at::kChar || dt == at::kByte) && vc.scalar_type() == dt &&
                kc.is_contiguous() && vc.is_contiguous() && kc.device().is_cpu() && vc.device().is_cpu(),
                "key_cache and value_cache must be contiguous CPU tensors of one dtype: float32, bfloat16, float16, "
                "float8_e4m3fn, float8_e5m2, int8 or uint8 (int4's q4_0 blocks)");
    TORCH_CHECK(dt != at::kByte || D % 32 == 0, "an int4 cache needs head_dim % 32 == 0");
    const int64_t width = dt == at::kByte ? Q4::rowb(D) : D;
    TORCH_CHECK(kc.dim() == 4 && kc.sizes() == vc.sizes() && kc.size(2) == Hkv && kc.size(3) == width,
                "caches must be [num_blocks, block_size, ", Hkv, ", ", width, "]");
    TORCH_CHECK(bt.scalar_type() == at::kInt && bt.is_contiguous() && bt.dim() == 2 && bt.size(0) == M,
                "block_tables must be contiguous int32 [", M, ", W]");
    TORCH_CHECK(lens.scalar_type() == at::kInt && lens.is_contiguous() && lens.numel() == M,
                "seq_lens must be contiguous int32 [", M, "]");
    const bool fp8 = dt == at::kFloat8_e4m3fn || dt == at::kFloat8_e5m2;
    TORCH_CHECK(!fp8 || (std::isfinite(ks) && std::isfinite(vs) && ks > 0 && vs > 0), "fp8 scales must be positive");
    float *kp = nullptr, *vp = nullptr;
    if (dt == at::kChar) {
        for (const at::Tensor* t : {&ksc, &vsc})
            TORCH_CHECK(t->defined() && t->scalar_type() == at::kFloat && t->is_contiguous() && t->device().is_cpu() &&
                        t->numel() == kc.size(0) * kc.size(1) * Hkv,
                        "an int8 cache needs float32 scale caches [num_blocks, block_size, ", Hkv, "]");
        kp = ksc.data_ptr<float>();
        vp = vsc.data_ptr<float>();
    }
    Cache c{static_cast<uint8_t*>(kc.data_ptr()), static_cast<uint8_t*>(vc.data_ptr()), kc.size(0), kc.size(1), dt,
            width * kc.element_size(), fp8 ? (float)ks : 1.f, fp8 ? (float)vs : 1.f, kp, vp, bt.data_ptr<int32_t>(), bt.size(1),
            lens.data_ptr<int32_t>()};
    if (given(kpages) || given(vpages) || given(qblocks)) {   // kivi2 (llmopt/cache/kivi.py: the page sizes)
        const int64_t G = c.bs, V = std::min(G, D);
        TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
                    "kivi2's residual caches must be float32, bfloat16 or float16");
        TORCH_CHECK(G % 4 == 0 && D % 4 == 0 && D % V == 0, "kivi2 needs the group size (the residual's block size, ",
                    G, ") and head_dim (", D, ") multiples of 4, and head_dim one of min(group size, head_dim)");
        const int64_t kpb = 4 * D + G * D / 4, vpb = 4 * G * (D / V) + G * D / 4;
        for (const at::Tensor* t : {&kpages, &vpages})
            TORCH_CHECK(t->defined() && t->scalar_type() == at::kByte && t->is_contiguous() && t->device().is_cpu() &&
                        t->dim() == 3 && t->size(0) == kpages.size(0) && t->size(1) == Hkv &&
                        t->size(2) == (t == &kpages ? kpb : vpb),
                        "kivi2 pages must be contiguous uint8 CPU tensors [num_pages, ", Hkv, ", ", kpb,
                        "] (keys) and [num_pages, ", Hkv, ", ", vpb, "] (values)");
        TORCH_CHECK(qblocks.defined() && qblocks.scalar_type() == at::kInt && qblocks.is_contiguous() &&
                    qblocks.device().is_cpu() && qblocks.numel() == M, "quant_blocks must be contiguous int32 [", M, "]");
        c.kp = static_cast<const uint8_t*>(kpages.data_ptr());
        c.vp = static_cast<const uint8_t*>(vpages.data_ptr());
        c.kpb = kpb;
        c.vpb = vpb;
        c.np = kpages.size(0);
        c.qb = qblocks.data_ptr<int32_t>();
    }
    for (int64_t m = 0; m < M; ++m) {
        const int64_t L = c.lens[m], used = (L + c.bs - 1) / c.bs, q = c.qb ? c.qb[m] : 0;
        TORCH_CHECK(L >= 1 && used <= c.W, "sequence ", m, ": length ", L, " does not fit its block table");
        TORCH_CHECK(q >= 0 && q <= used, "sequence ", m, ": quant_blocks ", q, " is not in [0, ", used, "]");
        for (int64_t b = 0; b < q; ++b)
            TORCH_CHECK(c.bt[m * c.W + b] >= 0 && c.bt[m * c.W + b] < c.np, "page id out of range");
        for (int64_t b = q; b < used; ++b)
            TORCH_CHECK(c.bt[m * c.W + b] >= 0 && c.bt[m * c.W + b] < c.nb, "block id out of range");
    }
    return c;
}

// A linear's tensors, checked (kind: Kind; empty tensors = none). scan: look for int8 codes of -128,
// which keep float activations (the sign trick of the integer tiles needs |code| <= 127); without
// it the caller vouches for [-127, 127] (the int8 head's codes).
Lin make_lin(int64_t kind, const at::Tensor& w, const at::Tensor& s, const at::Tensor& sz, const at::Tensor& bias,
             const at::Tensor& perm, int64_t gs, bool scan) {
    TORCH_CHECK(kind >= KF32 && kind <= KFP4B, "bad kind");
    TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.device().is_cpu(), "weight must be a contiguous 2-d CPU tensor");
    const int bits = code_bits(kind);
    const bool hb = kind == KW5 || kind == KW6;   // 8 * bits bytes a 64-column block
    TORCH_CHECK(!hb || w.size(1) % (8 * bits) == 0, "5- and 6-bit codes need K % 64 == 0");
    const int64_t N = w.size(0), K = kind == KW4 || is_fp4(kind) ? w.size(1) * 2 : hb ? w.size(1) / (8 * bits) * 64 : w.size(1);
    const at::ScalarType want[] = {at::kFloat, at::kChar, at::kByte, at::kByte, at::kBFloat16, at::kHalf, at::kByte, at::kByte,
                                   at::kByte, at::kByte, at::kByte};
    TORCH_CHECK(w.scalar_type() == want[kind], "weight dtype does not match its kind");
    if (is_float(kind) || kind == KF8) gs = K;
    TORCH_CHECK(K % 8 == 0 && gs > 0 && gs % 8 == 0 && K % gs == 0, "K must be a multiple of 8 and of the group size");
    TORCH_CHECK(kind != KW4 || (K % 64 == 0 && (gs == 32 || gs % 64 == 0)), "int4 needs K % 64 == 0, group 32 or k*64");
    TORCH_CHECK(!is_fp4(kind) || K % 64 == 0, "4-bit float codes need K % 64 == 0");
    TORCH_CHECK(!is_fp4(kind) || !(sz.defined() && sz.numel()), "4-bit float codes have no zero point");
    Lin l{kind, N, K, gs, w, {}, {}, {}, {}, false, 0.f, {}, {}};

    if (!is_float(kind)) {
        if (is_grouped(kind)) l.ks = k_scales(s, N, K / gs, "scales");
        if (l.ks.p == nullptr) {
            check_scales(s, kind, "scales");
            TORCH_CHECK(s.numel() == N * (K / gs) || (kind != KW4 && !hb && !is_fp4(kind) && s.numel() == 1) ||
                        (kind == KF8 && s.numel() == N), "scales must be [N, K / group_size] (or one)");
        }
        l.s = s;
    }
    if (is_grouped(kind) && sz.defined()) l.kz = k_scales(sz, N, K / gs, "szeros");
    if (l.kz.p != nullptr) {
        l.sz = sz;
    } else if (is_zero_code(sz)) {   // an implied zero code: sz = z * s per group
        TORCH_CHECK(s.numel() == N * (K / gs) || l.ks.p != nullptr, "an implied zero point needs scales [N, K / group_size]");
        l.zc = zero_code(sz);
    } else if (sz.defined() && sz.numel()) {
        check_scales(sz, kind, "szeros");
        TORCH_CHECK(sz.numel() == N * (K / gs) && sz.scalar_type() == s.scalar_type(),
                    "szeros must be [N, K / group_size], of the scales' dtype");
        l.sz = sz;
    }
    // the integer tiles and panels: groups of 32 or more; groups of 16 (Q6_K, NVFP4) on signed codes
    // without a zero point (int8 ones; 5- and 6-bit ones with their zero code taken off; E2M1's 2v:
    // each half of a 32-column block summed apart). NF4 and bitsandbytes' FP4 levels are no integers.
    const bool sgn = (kind == KW8 && l.zc == 0.f) || (hb && zero_code_off(l.zc, bits) != 0) || kind == KE2M1;
    if ((is_grouped(kind) || kind == KE2M1) &&
        (gs % QB == 0 || (gs == QB / 2 && kind != KW4 && sgn && !l.sz.defined() && l.kz.p == nullptr))) {
        l.idot = true;
        if (kind == KW8 && scan) {
            const int8_t* c = w.data_ptr<int8_t>();
            for (int64_t i = 0; i < N * K && l.idot; ++i) l.idot = c[i] != -128;
        }
    }
    if (bias.defined() && bias.numel()) {
        check_f32(bias, "bias");
        TORCH_CHECK(bias.numel() == N, "bias must have ", N, " elements");
        l.bias = bias;
    }
    if (perm.defined() && perm.numel()) {
        TORCH_CHECK(perm.scalar_type() == at::kLong && perm.is_contiguous() && perm.numel() == K,
                    "perm must be int64 [K]");
        const int64_t* p = perm.data_ptr<int64_t>();
        for (int64_t k = 0; k < K; ++k) TORCH_CHECK(p[k] >= 0 && p[k] < K, "perm out of range");
        l.perm = perm;
    }
    return l;
}

// One decoder layer, its weights referenced (not copied) at construction.
struct DecodeLayer : torch::CustomClassHolder {
    int64_t H, Hq, Hkv, D, I, window;
    double eps, scale;
    bool int8_act = false;   // integer dot products for integer and E2M1 weights (set_int8_activations)
    at::Tensor ln1, ln2, qn, kn;
    std::vector<Lin> groups[4];   // q/k/v, o, gate/up, down: each the linears of one input

    DecodeLayer(int64_t H_, int64_t Hq_, int64_t Hkv_, int64_t D_, int64_t I_, int64_t window_, double eps_,
                double scale_, at::Tensor ln1_, at::Tensor ln2_, at::Tensor qn_, at::Tensor kn_)
        : H(H_), Hq(Hq_), Hkv(Hkv_), D(D_), I(I_), window(window_), eps(eps_), scale(scale_), ln1(ln1_), ln2(ln2_) {
        TORCH_CHECK(Hq > 0 && Hkv > 0 && Hq % Hkv == 0 && Hq / Hkv <= 64 && D > 0 && D % 2 == 0 && D <= 512,
                    "bad head shapes");
        check_f32(ln1, "input_layernorm");
        check_f32(ln2, "post_attention_layernorm");
        TORCH_CHECK(ln1.numel() == H && ln2.numel() == H, "norm weights must have ", H, " elements");
        if (qn_.numel()) {
            check_f32(qn_, "q_norm");
            check_f32(kn_, "k_norm");
            TORCH_CHECK(qn_.numel() == D && kn_.numel() == D, "q/k norm weights must have ", D, " elements");
            qn = qn_;
            kn = kn_;
        }
    }

    // role 0 q/k/v, 1 o_proj, 2 gate/up, 3 down_proj (in output order); kind: Kind; empty tensors = none
    void add_linear(int64_t role, int64_t kind, at::Tensor w, at::Tensor s, at::Tensor sz, at::Tensor bias,
                    at::Tensor perm, int64_t gs) {
        TORCH_CHECK(role >= 0 && role < 4, "bad role");
        Lin l = make_lin(kind, w, s, sz, bias, perm, gs, true);
        const int64_t in[] = {H, Hq * D, H, I};
        TORCH_CHECK(l.K == in[role], "linear of role ", role, " must read ", in[role], " inputs, not ", l.K);
        groups[role].push_back(l);
    }

    void set_int8_activations(bool on) { int8_act = on; }

    // x [M, H]: the residual stream, updated in place; row m decodes one sequence at cos/sin[m]'s
    // position, its K/V written at slots[m] (negative: not written) before attending.
    // ks, vs: an fp8 cache's scales; ksc, vsc: an int8 cache's scale caches (else empty); kp, vp, qb:
    // kivi2's pages and each row's page count (else empty), kc / vc being its residual (written as a float cache)
    void forward(at::Tensor x, at::Tensor cos, at::Tensor sin, at::Tensor kc, at::Tensor vc, at::Tensor bt,
                 at::Tensor lens, at::Tensor slots, double ks, double vs, at::Tensor ksc, at::Tensor vsc,
                 at::Tensor kp, at::Tensor vp, at::Tensor qb) {
        const int64_t M = x.size(0), NQ = (Hq + 2 * Hkv) * D;
        check_f32(x, "x");
        check_f32(cos, "cos");
        check_f32(sin, "sin");
        TORCH_CHECK(x.dim() == 2 && x.size(1) == H && cos.numel() == M * D && sin.numel() == M * D, "bad x/cos/sin shapes");
        TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == M, "slots must be int64 [M]");
        TORCH_CHECK(width(groups[0]) == NQ && width(groups[1]) == H && width(groups[2]) == 2 * I &&
                    width(groups[3]) == H, "the layer's linears are incomplete");
        Cache c = make_cache(kc, vc, ks, vs, ksc, vsc, bt, lens, M, Hkv, D, kp, vp, qb);
        float* xs = x.data_ptr<float>();
        const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
        const int64_t* sl = slots.data_ptr<int64_t>();
        // the calling thread's buffers, reused and grown uninitialized (vectors zeroed M x 6,720 floats a
        // layer on one core while the other waited)
        static thread_local Grown bh, bq, ba, bg, bd;
        float *h = bh.get(M * std::max(H, I)), *qkv = bq.get(M * NQ), *att = ba.get(M * Hq * D), *gu = bg.get(M * 2 * I);
        static thread_local Scratch t;   // (reused: resizing to the same size zeroes nothing)

        rms_norm(xs, ln1.data_ptr<float>(), M, H, (float)eps, h);
        linears(groups[0], h, M, qkv, int8_act, t);
        for (int64_t m = 0; m < M; ++m)   // checked before the rows run in parallel
            TORCH_CHECK(sl[m] < c.nb * c.bs, "slot out of range");
#pragma omp parallel for schedule(static) if (M >= 16)   // rows write distinct slots
        for (int64_t m = 0; m < M; ++m) {
            float *q = qkv + m * NQ, *k = q + Hq * D, *v = k + Hkv * D;
            if (qn.defined()) {
                rms_norm(q, qn.data_ptr<float>(), Hq, D, (float)eps, q);
                rms_norm(k, kn.data_ptr<float>(), Hkv, D, (float)eps, k);
            }
            rope(q, Hq, D, cp + m * D, sp + m * D);
            rope(k, Hkv, D, cp + m * D, sp + m * D);
            if (sl[m] >= 0) write_slot(c, sl[m], k, v, Hkv, D);
        }
        attention(qkv, NQ, M, Hq, Hkv, D, c, (float)scale, window, att);
        linears(groups[1], att, M, h, int8_act, t);
#pragma omp parallel for schedule(static) if (M >= 16)
        for (int64_t i = 0; i < M * H; ++i) xs[i] += h[i];

        rms_norm(xs, ln2.data_ptr<float>(), M, H, (float)eps, h);
        linears(groups[2], h, M, gu, int8_act, t);
#pragma omp parallel for schedule(static) if (M >= 16)
        for (int64_t m = 0; m < M; ++m) {   // silu(gate) * up, into h [M, I]
            const float *g = gu + m * 2 * I, *u = g + I;
            float* out = h + m * I;
            int64_t i = 0;
            for (; i + 8 <= I; i += 8) {
                __m256 gv = _mm256_loadu_ps(g + i);
                __m256 sg = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
                _mm256_storeu_ps(out + i, _mm256_mul_ps(sg, _mm256_loadu_ps(u + i)));
            }
            for (; i < I; ++i) out[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
        }
        float* d = bd.get(M * H);
        linears(groups[3], h, M, d, int8_act, t);
#pragma omp parallel for schedule(static) if (M >= 16)
        for (int64_t i = 0; i < M * H; ++i) xs[i] += d[i];
    }
};

// Attention alone, for batched decode steps in the Python layer (reference.paged_attention):
// q [M, Hq, D] -> o [M, Hq, D], one query per sequence, over the paged cache (any dtype make_cache takes;
// kivi2: the residual caches with key_pages, value_pages and quant_blocks [M]).
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& bt,
                            const at::Tensor& lens, double scale, int64_t window, double ks, double vs,
                            const std::optional<at::Tensor>& ksc, const std::optional<at::Tensor>& vsc,
                            const std::optional<at::Tensor>& kp, const std::optional<at::Tensor>& vp,
                            const std::optional<at::Tensor>& qb) {
    check_f32(q, "q");
    TORCH_CHECK(q.dim() == 3 && kc.dim() == 4 && q.size(1) % kc.size(2) == 0 && q.size(1) / kc.size(2) <= 64,
                "q must be [M, Hq, D] (at most 64 query heads per KV head)");
    const int64_t M = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = kc.size(2);
    const at::Tensor none;
    Cache c = make_cache(kc, vc, ks, vs, ksc ? *ksc : none, vsc ? *vsc : none, bt, lens, M, Hkv, D, kp ? *kp : none,
                         vp ? *vp : none, qb ? *qb : none);
    at::Tensor o = at::empty({M, Hq, D}, q.options());
    attention(q.data_ptr<float>(), Hq * D, M, Hq, Hkv, D, c, (float)scale, window, o.data_ptr<float>());
    return o;
}

// The decode layer's K/V write alone: k, v [N, Hkv, D] float32 at slots [N] (negative: skipped), as
// forward writes them (tests check it against reference.write_kv, byte for byte)
void write_kv(const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slots, double ks, double vs, const std::optional<at::Tensor>& ksc,
              const std::optional<at::Tensor>& vsc) {
    check_f32(k, "k");
    check_f32(v, "v");
    TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes(), "k and v must be [N, Hkv, D]");
    TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == k.size(0),
                "slots must be int64 [N]");
    const int64_t N = k.size(0), Hkv = k.size(1), D = k.size(2);
    const at::Tensor none, bt = at::empty({0, 0}, slots.options().dtype(at::kInt)), lens = at::empty({0}, bt.options());
    Cache c = make_cache(kc, vc, ks, vs, ksc ? *ksc : none, vsc ? *vsc : none, bt, lens, 0, Hkv, D);
    const int64_t* sl = slots.data_ptr<int64_t>();
    for (int64_t i = 0; i < N; ++i) {
        if (sl[i] < 0) continue;
        TORCH_CHECK(sl[i] < c.nb * c.bs, "slot out of range");
        write_slot(c, sl[i], k.data_ptr<float>() + i * Hkv * D, v.data_ptr<float>() + i * Hkv * D, Hkv, D);
    }
}

// kivi2's conversions (llmopt/kernels/kivi.py quantize_keys / quantize_values, byte for byte): the
// residual blocks res[i] of one layer ([nr, G, Hkv, D], float32, bfloat16 or float16) quantized into
// the pages page[i]. Per group: lo, hi its extremes, scale = fp16((hi - lo) / 3), zero = fp16(lo),
// code = round-half-even((x - zero) / scale) clamped to 0..3 (0 when the scale is 0), in float32.
namespace kivi_put {
inline uint16_t half(float x) { return _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT); }

inline uint8_t code(float x, float s, float z) {
    if (!(s > 0.f)) return 0;
    float t = x - z;
    asm volatile("" : "+x"(t));   // rounded to float32 before the division, as the reference
    return uint8_t(std::min(3.f, std::max(0.f, std::nearbyint(t / s))));
}

template <class E>
void block(const uint8_t* res, int64_t G, int64_t Hkv, int64_t D, uint8_t* kpage, uint8_t* vpage, int64_t kpb,
           int64_t vpb, const uint8_t* vres) {
    const int64_t V = std::min(G, D), ng = D / V, rb = Hkv * D * E::rowb(1);
    std::vector<float> x(G * D);
    for (int64_t h = 0; h < Hkv; ++h) {
        for (int pass = 0; pass < 2; ++pass) {   // keys, then values
            const uint8_t* src = (pass == 0 ? res : vres) + h * D * E::rowb(1);
            for (int64_t t = 0; t < G; ++t)
                for (int64_t c = 0; c < D; ++c) x[t * D + c] = E::one(src + t * rb, c);
            uint8_t* page = (pass == 0 ? kpage : vpage) + h * (pass == 0 ? kpb : vpb);
            const int64_t groups = pass == 0 ? D : G * ng;   // keys: per channel; values: per (token, channel group)
            uint16_t* sc = reinterpret_cast<uint16_t*>(page);
            uint16_t* zc = sc + groups;
            uint8_t* codes = page + 4 * groups;
            std::memset(codes, 0, G * D / 4);
            for (int64_t gi = 0; gi < groups; ++gi) {
                // the group's members: keys' channel gi over the G tokens, values' token gi / ng, channels of group gi % ng
                const int64_t n = pass == 0 ? G : V;
                auto at = [&](int64_t i) -> int64_t { return pass == 0 ? i * D + gi : (gi / ng) * D + (gi % ng) * V + i; };
                float lo = INFINITY, hi = -INFINITY;
                bool nan = false;
                for (int64_t i = 0; i < n; ++i) lo = std::min(lo, x[at(i)]), hi = std::max(hi, x[at(i)]), nan |= std::isnan(x[at(i)]);
                if (nan) lo = hi = NAN;   // as torch's amin / amax: the group's scale and zero NaN, its codes 0
                const uint16_t hs = half((hi - lo) / 3.f), hz = half(lo);
                sc[gi] = hs;
                zc[gi] = hz;
                const float s = _cvtsh_ss(hs), z = _cvtsh_ss(hz);
                for (int64_t i = 0; i < n; ++i) {
                    const int64_t e = at(i);   // token e / D, channel e % D
                    codes[(e / D) * (D / 4) + (e % D) / 4] |= uint8_t(code(x[e], s, z) << (2 * ((e % D) % 4)));
                }
            }
        }
    }
}
}  // namespace kivi_put

void kivi_convert(const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& kp, const at::Tensor& vp,
                  const at::Tensor& res, const at::Tensor& pages) {
    const auto dt = kc.scalar_type();
    TORCH_CHECK((dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf) && vc.scalar_type() == dt && kc.dim() == 4 &&
                kc.sizes() == vc.sizes() && kc.is_contiguous() && vc.is_contiguous() && kc.device().is_cpu(),
                "the residual must be two contiguous float32, bfloat16 or float16 CPU tensors [n, G, Hkv, D]");
    const int64_t G = kc.size(1), Hkv = kc.size(2), D = kc.size(3), V = std::min(G, D);
    TORCH_CHECK(D % 4 == 0 && D % V == 0, "head_dim must be a multiple of 4 and of min(G, head_dim)");
    const int64_t kpb = 4 * D + G * D / 4, vpb = 4 * G * (D / V) + G * D / 4;
    TORCH_CHECK(kp.scalar_type() == at::kByte && vp.scalar_type() == at::kByte && kp.is_contiguous() && vp.is_contiguous() &&
                kp.dim() == 3 && vp.dim() == 3 && kp.size(0) == vp.size(0) && kp.size(1) == Hkv && vp.size(1) == Hkv &&
                kp.size(2) == kpb && vp.size(2) == vpb, "pages must be contiguous uint8 [n, Hkv, page bytes]");
    TORCH_CHECK(res.scalar_type() == at::kLong && pages.scalar_type() == at::kLong && res.numel() == pages.numel() &&
                res.is_contiguous() && pages.is_contiguous(), "res and pages must be int64 [n]");
    const int64_t n = res.numel(), *ri = res.data_ptr<int64_t>(), *pi = pages.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i)
        TORCH_CHECK(ri[i] >= 0 && ri[i] < kc.size(0) && pi[i] >= 0 && pi[i] < kp.size(0), "block id out of range");
    std::vector<int64_t> sorted(pi, pi + n);   // the blocks run in parallel: one conversion a page
    std::sort(sorted.begin(), sorted.end());
    TORCH_CHECK(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(), "a page converted twice in one call");
    const int64_t rbb = G * Hkv * D * kc.element_size();
    const auto* k = static_cast<const uint8_t*>(kc.data_ptr());
    const auto* v = static_cast<const uint8_t*>(vc.data_ptr());
    auto* kpp = kp.data_ptr<uint8_t>();
    auto* vpp = vp.data_ptr<uint8_t>();
#pragma omp parallel for schedule(static) if (n >= 2)
    for (int64_t i = 0; i < n; ++i) {
        uint8_t *ko = kpp + pi[i] * Hkv * kpb, *vo = vpp + pi[i] * Hkv * vpb;
        const uint8_t *kr = k + ri[i] * rbb, *vr = v + ri[i] * rbb;
        if (dt == at::kFloat) kivi_put::block<F32>(kr, G, Hkv, D, ko, vo, kpb, vpb, vr);
        else if (dt == at::kBFloat16) kivi_put::block<BF16>(kr, G, Hkv, D, ko, vo, kpb, vpb, vr);
        else kivi_put::block<F16>(kr, G, Hkv, D, ko, vo, kpb, vpb, vr);
    }
}

// y = x @ w^T for float32 x [M, K], w [N, K] float32, bfloat16 or float16 (widened in the loop,
// float32 sums): the float LM head of a decode step on both cores (the aten GEMV at M = 1 runs on
// one thread), and the 16-bit linears of llmopt/layers/modules16.py at any M
at::Tensor f32_gemm(const at::Tensor& x, const at::Tensor& w) {
    check_f32(x, "x");
    const auto dt = w.scalar_type();
    TORCH_CHECK((dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf) && w.is_contiguous() && w.device().is_cpu(),
                "w must be a contiguous float32, bfloat16 or float16 CPU tensor");
    TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && w.size(1) % 8 == 0,
                "x [M, K] and w [N, K] with K a multiple of 8");
    const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
    at::Tensor y = at::empty({M, N}, x.options());
    Args a{x.data_ptr<float>(), M, K, N, K, 1, &ONE, 0, nullptr, nullptr, y.data_ptr<float>(), N};
    std::vector<float> none;
    float_linear(a, dt == at::kFloat ? KF32 : dt == at::kBFloat16 ? KBF16 : KF16,
                 static_cast<const uint8_t*>(w.data_ptr()), none);
    return y;
}

// y = x @ W^T for 4-bit float codes: codes uint8 [N, K / 2] in the int4 layout, scales float32 [N, K / gs];
// kind 8 FP4 E2M1, 9 NF4, 10 bitsandbytes' FP4 (the decode layer's linears of those checkpoints)
at::Tensor fp4_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t gs, int64_t kind) {
    check_f32(x, "x");
    TORCH_CHECK(is_fp4(kind), "kind must be 8 (FP4 E2M1), 9 (NF4) or 10 (bitsandbytes FP4)");
    check_f32(scales, "scales");
    const at::Tensor none;
    Lin l = make_lin(kind, codes, scales, none, none, none, gs, false);
    TORCH_CHECK(x.dim() == 2 && x.size(1) == l.K, "x must be [M, ", l.K, "]");
    at::Tensor y = at::empty({x.size(0), l.N}, x.options());
    Scratch t;
    linear(l, x.data_ptr<float>(), x.size(0), y.data_ptr<float>(), l.N, false, t);
    return y;
}

// y = quantize_x(x) @ W^T through the integer tiles: kind 1 int8 codes [N, K] (no -128), kind 2 the
// int4 layout [N, K / 2], 6 and 7 the 5- and 6-bit one (HB), 8 FP4 E2M1 codes in the int4 layout
// (float32 scales [N, K / gs]); what the decode layer's linears compute with int8 activations (tests)
// (checked: the caller knows int8 codes hold no -128, e.g. the int8 LM head; else every call scans them)
at::Tensor idot_gemm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales, const at::Tensor& szeros,
                     int64_t gs, int64_t kind, bool checked) {
    check_f32(x, "x");
    TORCH_CHECK(is_grouped(kind) || kind == KE2M1, "kind must be 1 (int8), 2 (int4), 6 (5-bit), 7 (6-bit) or 8 (E2M1)");
    const at::Tensor none;
    Lin l = make_lin(kind, w, scales, szeros, none, none, gs, !checked);
    TORCH_CHECK(l.idot, "int8 codes must be in [-127, 127] and the group size a multiple of 32 (16 without a zero point)");
    TORCH_CHECK(x.dim() == 2 && x.size(1) == l.K, "x must be [M, ", l.K, "]");
    at::Tensor y = at::empty({x.size(0), l.N}, x.options());
    Scratch t;
    linear(l, x.data_ptr<float>(), x.size(0), y.data_ptr<float>(), l.N, true, t);
    return y;
}

// The linears' kernel choices (llmopt/defaults.py sets them when the library loads; tests switch them).
// isa: the integer tiles' instruction set (and the float panels' blocks'), 0 AVX2, 1 AVX-512 VNNI
// (refused without it), -1 the best this CPU has; panel: with VNNI, int8-activation linears of at least this many rows take the integer
// panels; f32_panel: float linears of at least this many rows take the float panels (0: keep a
// setting); f32_stream: float linears of at most this many rows (8 at most) stream each weight row
// alone (row_f32; 0 = never, -1: keep); bf16: bfloat16 weights' float panels by AMX tiles, else
// AVX-512 BF16 dot products, where the CPU has them (cpu_bf16_panels.h, x rounded to bfloat16), 1,
// or float32 products, 0 (-1: keep); f32_bcast: float32 weights' linears of f32_panel to this many rows
// take f32_bcast where the float panels are AVX-512 (the same bits; 0 = never, -1: keep). Returns
// the instruction set in use.
int64_t tiles_config(int64_t isa, int64_t panel, int64_t f32_panel, int64_t f32_stream, int64_t bf16,
                     int64_t f32_bcast) {
    TORCH_CHECK(panel >= 0 && f32_panel >= 0, "panel and f32_panel must be >= 0");
    TORCH_CHECK(f32_stream >= -1 && f32_stream <= 8, "f32_stream must be -1 (keep) or 0 to 8");
    TORCH_CHECK(bf16 >= -1 && bf16 <= 1, "bf16 must be -1 (keep), 0 or 1");
    TORCH_CHECK(f32_bcast >= -1, "f32_bcast must be -1 (keep) or >= 0");
    if (bf16 >= 0) {
        use_bf16dot = bf16 == 1 && cpu_has_bf16();
        use_amx = use_bf16dot && bf16dot::amx::available();
    }
    if (panel > 0) panel_rows = panel;
    if (f32_panel > 0) f32_panel_rows = f32_panel;
    if (f32_stream >= 0) f32_stream_rows = f32_stream;
    if (f32_bcast >= 0) f32_bcast_rows = f32_bcast;
    const bool has = cpu_has_vnni();
    TORCH_CHECK(isa >= -1 && isa <= 1, "isa must be -1, 0 or 1");
    TORCH_CHECK(isa != 1 || has, "this CPU has no AVX-512 VNNI");
    use_vnni = isa == -1 ? has : isa == 1;
    f32_avx512 = use_vnni;   // the float panels' AVX-512 blocks go with the integer kernels' instruction set
    return use_vnni ? 1 : 0;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmopt_cpu, m) {
    m.def("tiles_config(int isa=-1, int panel=0, int f32_panel=0, int f32_stream=-1, int bf16=-1, "
          "int f32_bcast=-1) -> int",
          TORCH_FN(tiles_config));   // no tensors: a catch-all kernel
    m.def("decode_attention(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_tables, Tensor seq_lens, "
          "float scale, int window, float k_scale=1.0, float v_scale=1.0, Tensor? k_scale_cache=None, "
          "Tensor? v_scale_cache=None, Tensor? key_pages=None, Tensor? value_pages=None, Tensor? quant_blocks=None) -> Tensor");
    m.impl("decode_attention", c10::DispatchKey::CPU, TORCH_FN(decode_attention));
    m.def("write_kv(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor k, Tensor v, Tensor slots, float k_scale=1.0, "
          "float v_scale=1.0, Tensor(c!)? k_scale_cache=None, Tensor(d!)? v_scale_cache=None) -> ()");
    m.impl("write_kv", c10::DispatchKey::CPU, TORCH_FN(write_kv));
    m.def("idot_gemm(Tensor x, Tensor codes, Tensor scales, Tensor szeros, int gs, int kind, bool checked=False) -> Tensor");
    m.impl("idot_gemm", c10::DispatchKey::CPU, TORCH_FN(idot_gemm));
    m.def("kivi_convert(Tensor key_cache, Tensor value_cache, Tensor(a!) key_pages, Tensor(b!) value_pages, "
          "Tensor residual_ids, Tensor page_ids) -> ()");
    m.impl("kivi_convert", c10::DispatchKey::CPU, TORCH_FN(kivi_convert));
    m.def("f32_gemm(Tensor x, Tensor w) -> Tensor");
    m.impl("f32_gemm", c10::DispatchKey::CPU, TORCH_FN(f32_gemm));
    m.def("fp4_gemm(Tensor x, Tensor codes, Tensor scales, int gs, int kind) -> Tensor");
    m.impl("fp4_gemm", c10::DispatchKey::CPU, TORCH_FN(fp4_gemm));
    m.class_<DecodeLayer>("DecodeLayer")
        .def(torch::init<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, double, double, at::Tensor, at::Tensor,
                         at::Tensor, at::Tensor>())
        .def("add_linear", &DecodeLayer::add_linear)
        .def("set_int8_activations", &DecodeLayer::set_int8_activations)
        .def("forward", &DecodeLayer::forward);
}
