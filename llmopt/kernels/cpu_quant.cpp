// CPU GEMV/GEMM kernels for quantized weights: y[M, N] = x[M, K] @ dequant(W)[N, K]^T, float32
// activations and accumulation, the weight decoded inside the loop (never materialized in float).
// Built on first use by llmopt/kernels/cpu_quant.py (torch.utils.cpp_extension), registered as
// torch.ops.llmopt_cpu.* so eager code and torch.compile graphs call them the same way.
//
// Weight layouts (prepared once at load by llmopt/layers/modules*.py):
// - w8: int8 codes c [N, K]; W[n, k] = (c - z') * s with per-group s, and sz = s * z' [N, G].
// - w4: uint8 [N, K / 2], 64-column blocks: byte 32b + j holds column 64b + j in its low nibble and
//       column 64b + 32 + j in its high nibble (no interleave to undo); W = (q - z) * s, sz = s * z.
// - w5, w6: 5- or 6-bit codes at their bits [N, K * bits / 8]: per 64-column block the int4 layout's
//       nibbles, then the high bits in 8 (bits - 4) bytes (cpu_quant_tiles.h: HB); W = (q - z) * s.
// szeros (sz) may also be empty (no zero point) or one value z: the same zero code for every group,
// sz = s * z formed where read (llama.cpp's Q4_0 and Q5_0, held as the file holds them: d alone).
// scales and szeros may also come as a K-quant's sub-scales (uint8 / int8 [N, G + 2 G / per]: KScales).
// - f8: float8 e4m3fn bytes [N, K], one scale per row (or one for all); W = f8 * s.
// With groups, sum_k x W = sum_g s_g (sum_{k in g} x_k q_k) - sum_g sz_g (sum_{k in g} x_k): the
// second term uses the per-group sums of x, computed once per call.
//
// Work: one OpenMP region per call, each thread a contiguous range of output rows (a multiple of 4).
// At M = 1 (decode) 4 rows run at once: 4 independent FMA chains share each load of x, so the loop
// is not bound by FMA latency (one chain per row ran at ~7 GB/s of int8 per core, 4 at ~17); M = 2
// takes 2 rows x 2, larger M 1 row x 4 rows of x. Every output element sums in the same order
// whatever the tiling, so a row's result does not depend on N or M (fused q/k/v equal the separate
// projections bit for bit).
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <vector>

#include "cpu_quant_tiles.h"

namespace llmopt_cpu_tiles {
// szeros given as one value z (a 1-d tensor [1]; stored ones are [N, G]): an implied zero point,
// sz = z * s per group (Args::zc)
bool is_zero_code(const at::Tensor& sz) { return sz.defined() && sz.dim() == 1 && sz.numel() == 1; }

float zero_code(const at::Tensor& sz) {
    TORCH_CHECK(is_zero_code(sz) && (sz.scalar_type() == at::kFloat || sz.scalar_type() == at::kHalf) &&
                sz.device().is_cpu(), "an implied zero code must be one float32 or float16 CPU value");
    float z = sz.scalar_type() == at::kHalf ? static_cast<float>(sz.data_ptr<at::Half>()[0]) : sz.data_ptr<float>()[0];
    TORCH_CHECK(z != 0.f, "an implied zero code must not be 0 (give empty szeros for no zero point)");
    return z;
}

// scales or szeros as a K-quant holds them (uint8 sub-scales, int8 where signed: [N, G + 2 G / per],
// per a power of two; KScales): its KScales, or one with p null for any other dtype
KScales k_scales(const at::Tensor& t, int64_t N, int64_t G, const char* what) {
    KScales k;
    if (!t.defined() || (t.scalar_type() != at::kByte && t.scalar_type() != at::kChar)) return k;
    TORCH_CHECK(t.is_contiguous() && t.device().is_cpu() && t.dim() == 2 && t.size(0) == N && t.size(1) > G,
                what, " as K-quant sub-scales must be a contiguous CPU tensor [N, G + 2 G / per]");
    const int64_t S = (t.size(1) - G) / 2;
    TORCH_CHECK(S > 0 && G + 2 * S == t.size(1) && G % S == 0 && G / S >= 8 && ((G / S) & (G / S - 1)) == 0, what,
                ": ", G, " groups a row do not make super-blocks of a power of two (8 or more) groups");
    k.p = static_cast<const uint8_t*>(t.data_ptr());
    k.row = t.size(1);
    k.G = G;
    k.shift = __builtin_ctzll(static_cast<unsigned long long>(G / S));
    k.sgn = t.scalar_type() == at::kChar;
    return k;
}
}  // namespace llmopt_cpu_tiles

namespace {

using namespace llmopt_cpu_tiles;

void check_x(const at::Tensor& x, int64_t K) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) == K,
                "x must be a contiguous float32 [M, K] tensor");
}

Args make_args(const at::Tensor& x, int64_t N, int64_t K, int64_t gs, const at::Tensor& scales,
               const at::Tensor& szeros, std::vector<float>& xsum, at::Tensor& y) {
    check_x(x, K);
    TORCH_CHECK(gs % 8 == 0 && K % gs == 0, "group size must be a multiple of 8 dividing K");
    const auto st = scales.scalar_type();
    int64_t M = x.size(0), G = K / gs;
    const KScales ks = k_scales(scales, N, G, "scales"), kz = k_scales(szeros, N, G, "szeros");
    TORCH_CHECK(ks.p != nullptr || ((st == at::kFloat || st == at::kHalf) && scales.is_contiguous() &&
                scales.numel() == N * G), "scales must be float32 or float16 [N, K / group_size], or K-quant sub-scales");
    const bool implied = is_zero_code(szeros), z = kz.p == nullptr && !implied && szeros.numel() > 0;
    TORCH_CHECK(!z || (ks.p == nullptr && szeros.numel() == scales.numel() && szeros.scalar_type() == st &&
                szeros.is_contiguous()), "szeros must be empty, one zero code, like scales, or K-quant sub-scales");
    const float* xp = x.data_ptr<float>();
    const bool zero = z || implied || kz.p != nullptr;
    if (zero) group_sums(xp, M, K, gs, xsum);
    y = at::empty({M, N}, x.options());
    Args a{xp, M, K, N, gs, G, static_cast<const float*>(scales.data_ptr()), G,
           z ? static_cast<const float*>(szeros.data_ptr()) : nullptr, zero ? xsum.data() : nullptr,
           y.data_ptr<float>(), N, st == at::kHalf, implied ? zero_code(szeros) : 0.f};
    a.ks = ks;
    a.kz = kz;
    return a;
}

// y = x @ ((codes - z') * s)^T; codes int8 [N, K]; scales, szeros float32 or float16 [N, G] (szeros may be
// empty: no zero point, or one value z': the same zero code for every group)
at::Tensor w8_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                   const at::Tensor& szeros, int64_t gs) {
    TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.is_contiguous(),
                "codes must be contiguous int8 [N, K]");
    int64_t N = codes.size(0), K = codes.size(1);
    std::vector<float> xsum;
    at::Tensor y;
    Args a = make_args(x, N, K, gs, scales, szeros, xsum, y);
    run(a, Fn8<I8>{reinterpret_cast<const uint8_t*>(codes.data_ptr<int8_t>())});
    return y;
}

// y = x @ ((q - z) * s)^T; packed uint8 [N, K / 2] in the grouped nibble layout (K % 64 == 0)
at::Tensor w4_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                   const at::Tensor& szeros, int64_t gs) {
    TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                packed.size(1) % 32 == 0, "packed must be contiguous uint8 [N, K / 2] with K a multiple of 64");
    int64_t N = packed.size(0), K = packed.size(1) * 2;
    TORCH_CHECK(gs == 32 || gs % 64 == 0, "int4 group size must be 32 or a multiple of 64");
    std::vector<float> xsum;
    at::Tensor y;
    Args a = make_args(x, N, K, gs, scales, szeros, xsum, y);
    run(a, Fn4{packed.data_ptr<uint8_t>()});
    return y;
}

// y = x @ ((q - z) * s)^T; q: 5- or 6-bit codes (`bits`) in the HB layout [N, K * bits / 8] (K % 64 == 0)
at::Tensor wh_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                   const at::Tensor& szeros, int64_t gs, int64_t bits) {
    TORCH_CHECK(bits == 5 || bits == 6, "bits must be 5 or 6");
    const int64_t blk = 8 * bits;   // bytes a 64-column block
    TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                packed.size(1) % blk == 0, "packed must be contiguous uint8 [N, K * bits / 8] with K a multiple of 64");
    int64_t N = packed.size(0), K = packed.size(1) / blk * 64;
    std::vector<float> xsum;
    at::Tensor y;
    Args a = make_args(x, N, K, gs, scales, szeros, xsum, y);
    if (bits == 5) run(a, FnHB<1>{packed.data_ptr<uint8_t>()});
    else run(a, FnHB<2>{packed.data_ptr<uint8_t>()});
    return y;
}

// y = x @ (f8 * s)^T; codes: e4m3fn bytes viewed as uint8 [N, K]; scales float32 [N] or [1]
at::Tensor f8_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
    TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                codes.size(1) % 8 == 0, "codes must be contiguous uint8 [N, K] with K a multiple of 8");
    int64_t N = codes.size(0), K = codes.size(1);
    TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                (scales.numel() == N || scales.numel() == 1), "scales must be float32 [N] or [1]");
    check_x(x, K);
    at::Tensor y = at::empty({x.size(0), N}, x.options());
    Args a{x.data_ptr<float>(), x.size(0), K, N, K, 1, scales.data_ptr<float>(), scales.numel() == 1 ? 0 : 1,
           nullptr, nullptr, y.data_ptr<float>(), N};
    run(a, Fn8<F8>{codes.data_ptr<uint8_t>()});
    return y;
}

// rows of an int8 table times their scales: the tied embedding's lookup from the int8 head
at::Tensor w8_rows(const at::Tensor& ids, const at::Tensor& codes, const at::Tensor& scales) {
    TORCH_CHECK(ids.scalar_type() == at::kLong && codes.scalar_type() == at::kChar && codes.is_contiguous(),
                "ids int64, codes contiguous int8");
    at::Tensor flat = ids.contiguous().view(-1);
    int64_t T = flat.numel(), V = codes.size(0), K = codes.size(1);
    at::Tensor y = at::empty({T, K}, scales.options());
    const int64_t* id = flat.data_ptr<int64_t>();
    const int8_t* w = codes.data_ptr<int8_t>();
    const float* s = scales.data_ptr<float>();
    float* out = y.data_ptr<float>();
    for (int64_t t = 0; t < T; ++t) {
        int64_t r = id[t];
        TORCH_CHECK(r >= 0 && r < V, "token id ", r, " out of range");
        for (int64_t k = 0; k < K; ++k) out[t * K + k] = (float)w[r * K + k] * s[r];
    }
    return y;
}

}  // namespace

TORCH_LIBRARY(llmopt_cpu, m) {
    m.def("w8_gemm(Tensor x, Tensor codes, Tensor scales, Tensor szeros, int gs) -> Tensor");
    m.def("w4_gemm(Tensor x, Tensor packed, Tensor scales, Tensor szeros, int gs) -> Tensor");
    m.def("wh_gemm(Tensor x, Tensor packed, Tensor scales, Tensor szeros, int gs, int bits) -> Tensor");
    m.def("f8_gemm(Tensor x, Tensor codes, Tensor scales) -> Tensor");
    m.def("w8_rows(Tensor ids, Tensor codes, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmopt_cpu, CPU, m) {
    m.impl("w8_gemm", &w8_gemm);
    m.impl("w4_gemm", &w4_gemm);
    m.impl("wh_gemm", &wh_gemm);
    m.impl("f8_gemm", &f8_gemm);
    m.impl("w8_rows", &w8_rows);
}
