"""The quantization algorithms against direct computations (float64 formulas written here) and
the behaviour they promise: GPTQ beats RTN on real layer inputs, folding leaves the function alone."""

import pytest
import torch
import transformers

from llmopt.errors import UserInputError
from llmopt.layers import fp8, int8
from llmopt.quant import awq, gptq, rtn, smoothquant
from llmopt.quant.layerwise import LINEARS, batches, input_of, quantize_layer
from llmopt.quant.config import QuantConfig
from quant_util import our_layer


def direct_rtn(w, bits, gs, sym):
    """Group quantization written out group by group (in float32, so exact ties round alike)."""
    w = w.float()
    out = torch.empty_like(w)
    maxq = 2 ** bits - 1
    for r in range(w.shape[0]):
        for g0 in range(0, w.shape[1], gs):
            g = w[r, g0:g0 + gs]
            if sym:
                scale = 2 * g.abs().max() / maxq
                zero = 2 ** (bits - 1)
            else:
                lo, hi = min(g.min(), 0.0), max(g.max(), 0.0)
                scale = (hi - lo) / maxq
                zero = torch.round(-lo / scale)
            q = torch.clamp(torch.round(g / scale) + zero, 0, maxq)
            out[r, g0:g0 + gs] = (q - zero) * scale
    return out


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("bits,gs", [(4, 32), (8, 64), (3, 16)])
def test_rtn_matches_direct_computation(sym, bits, gs):
    torch.manual_seed(0)
    w = torch.randn(12, 64) * torch.rand(12, 1)
    qt = rtn.quantize_rtn(w, bits, gs, sym)
    assert qt.qweight.min() >= 0 and qt.qweight.max() < 2 ** bits
    assert qt.scales.shape == (12, 64 // gs)
    torch.testing.assert_close(qt.dequantize(), direct_rtn(w, bits, gs, sym), rtol=0, atol=1e-6)
    torch.testing.assert_close(rtn.fake_quantize(w, bits, gs, sym), qt.dequantize(), rtol=0, atol=1e-6)
    if sym:
        assert (qt.zeros == 2 ** (bits - 1)).all()


def test_group_size_must_divide():
    with pytest.raises(UserInputError, match="does not divide"):
        rtn.quantize_rtn(torch.randn(4, 576), 4, 128, True)
    assert rtn.quantize_rtn(torch.randn(4, 576), 4, -1, True).scales.shape == (4, 1)


def test_hessian_accumulator_is_2xtx_over_n():
    torch.manual_seed(0)
    xs = [torch.randn(3, 7, 16), torch.randn(5, 16)]
    acc = gptq.HessianAccumulator(16)
    for x in xs:
        acc.add(x)
    X = torch.cat([x.reshape(-1, 16) for x in xs]).double()
    torch.testing.assert_close(acc.H.double(), 2 * X.T @ X / X.shape[0], rtol=1e-5, atol=1e-5)
    wide = [torch.randn(40, 1030), torch.randn(3, 5, 1030)]   # the blocked upper-triangle path
    acc = gptq.HessianAccumulator(1030)
    assert len(acc.edges) == 5
    for x in wide:
        acc.add(x)
    X = torch.cat([x.reshape(-1, 1030) for x in wide]).double()
    torch.testing.assert_close(acc.H.double(), 2 * X.T @ X / X.shape[0], rtol=1e-5, atol=1e-5)


def test_gptq_with_uncorrelated_inputs_is_rtn():
    """H = I: the inverse Hessian is diagonal, nothing to compensate, GPTQ must round to nearest."""
    torch.manual_seed(0)
    w = torch.randn(16, 128)
    res = gptq.gptq_quantize(w, torch.eye(128), 4, 32, sym=False)
    torch.testing.assert_close(res.quantized.dequantize(), rtn.quantize_rtn(w, 4, 32, False).dequantize())


def paper_gptq(w, H, bits, gs, act_order, damp=0.01):
    """GPTQ as the paper's Algorithm 1 states it, without lazy batches, in float64: one column at
    a time, its error (w − ŵ) / U[j, j] pushed onto every later column through the upper Cholesky
    factor U of H⁻¹. Symmetric groups; `static`: columns by decreasing diag(H), each in its natural
    group with the scale of the original weights; `none`: natural order, a group's scale from its
    columns as updated when the group starts."""
    W, H = w.double().clone(), H.double()
    n = W.shape[1]
    maxq = 2 ** bits - 1
    perm = torch.argsort(torch.diag(H), descending=True) if act_order == "static" else torch.arange(n)
    scale0 = 2 * W.reshape(W.shape[0], -1, gs).abs().amax(-1) / maxq          # [out, groups]
    U = torch.linalg.cholesky(torch.linalg.inv(
        (H + torch.eye(n, dtype=H.dtype) * damp * torch.diag(H).mean())[perm][:, perm]), upper=True)
    W = W[:, perm]
    Q = torch.empty_like(W)
    for j in range(n):
        c = int(perm[j])
        if act_order == "static":
            s = scale0[:, c // gs]
        else:
            if j % gs == 0:
                s_group = 2 * W[:, j:j + gs].abs().amax(-1) / maxq
            s = s_group
        q = torch.clamp(torch.round(W[:, j] / s) + 2 ** (bits - 1), 0, maxq)
        Q[:, j] = (q - 2 ** (bits - 1)) * s
        err = (W[:, j] - Q[:, j]) / U[j, j]
        W[:, j:] -= torch.outer(err, U[j, j:])
    return Q[:, torch.argsort(perm)]


@pytest.mark.parametrize("act_order", ["none", "static"])
def test_gptq_equals_the_papers_column_by_column_algorithm(act_order):
    """Lazy batches of 32 columns, in-place float32 column loop: the same weights as the plain
    float64 algorithm, up to codes that float32 rounds to the other side of a tie (the error
    feedback can carry such a flip along its row), and the same output error."""
    g = torch.Generator().manual_seed(3)
    X = torch.randn(1024, 96, generator=g) @ (torch.randn(96, 96, generator=g) * 0.3 + torch.eye(96))
    H = 2 * X.T @ X / X.shape[0]
    w = torch.randn(40, 96, generator=g) * 0.1
    ours = gptq.gptq_quantize(w, H, 4, 32, sym=True, act_order=act_order, block=32).quantized.dequantize().double()
    ref = paper_gptq(w, H, 4, 32, act_order)
    step = 2 * w.abs().max() / 15
    same = (ours - ref).abs() < 1e-3 * step
    assert same.float().mean() > 0.95
    out_err = lambda q: float((X.double() @ (q - w.double()).T).pow(2).sum())  # noqa: E731
    assert abs(out_err(ours) - out_err(ref)) < 0.02 * out_err(ref)


def linear_inputs(model, ids):
    inputs, hooks = {}, []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and "layers" in name:
            hooks.append(mod.register_forward_pre_hook(lambda m, a, n=name: inputs.__setitem__(n, a[0].detach())))
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return inputs


@pytest.mark.parametrize("act_order", ["none", "static", "group"])
def test_gptq_beats_rtn_on_every_linear_of_a_tiny_model(act_order, tiny_factory):
    folder = tiny_factory(vocab_size=256, max_position_embeddings=256, initializer_range=0.02)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(1))
    inputs = linear_inputs(model, ids)
    assert len(inputs) == 14
    for name, x in inputs.items():
        lin = model.get_submodule(name)
        w = lin.weight.detach()
        acc = gptq.HessianAccumulator(w.shape[1])
        acc.add(x)
        g = gptq.gptq_quantize(w, acc.H, 4, 16, sym=True, act_order=act_order, block=32).quantized
        r = rtn.quantize_rtn(w, 4, 16, True)
        X = x.reshape(-1, w.shape[1]).double()
        err = lambda q: float((X @ (q.dequantize().double() - w.double()).T).pow(2).sum())  # noqa: E731
        assert err(g) < 0.9 * err(r), name
        if act_order == "group":
            assert g.g_idx is not None and sorted(torch.bincount(g.g_idx.long()).tolist()) == [16] * (w.shape[1] // 16)
        else:
            assert g.g_idx is None
        if act_order == "static":   # natural groups, scales fixed from the original weights: RTN's scales
            torch.testing.assert_close(g.scales, r.scales)


def outlier_inputs(n=4, t=32, h=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, t, h, generator=g)
    x[..., :3] *= 30.0          # a few large channels, as in real LLM activations
    return x


def test_awq_folding_keeps_the_float_function():
    layer, ctx = our_layer()
    x = outlier_inputs()
    with torch.no_grad():
        ref = ctx.forward(layer, x)
        at, mlp = layer.self_attn, layer.mlp
        s = lambda n: torch.rand(n) * 3 + 0.2  # noqa: E731
        awq.fold_scales(layer.input_layernorm, [at.q_proj, at.k_proj, at.v_proj], s(64))
        awq.fold_scales(at.v_proj, [at.o_proj], s(64))
        awq.fold_scales(layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj], s(64))
        awq.fold_scales(mlp.up_proj, [mlp.down_proj], s(128))
        torch.testing.assert_close(ctx.forward(layer, x), ref, rtol=1e-4, atol=1e-4)


def test_smoothquant_folding_keeps_the_float_function_and_tames_outliers():
    layer, ctx = our_layer()
    x = outlier_inputs()
    with torch.no_grad():
        ref = ctx.forward(layer, x)
        h = layer.input_layernorm(x)
        amax = h.reshape(-1, 64).abs().amax(0)
        at = layer.self_attn
        s = smoothquant.smooth(layer.input_layernorm, [at.q_proj, at.k_proj, at.v_proj], amax, 0.5)
        torch.testing.assert_close(ctx.forward(layer, x), ref, rtol=1e-4, atol=1e-4)
        h2 = layer.input_layernorm(x).reshape(-1, 64).abs().amax(0)
        torch.testing.assert_close(h2, amax / s)
        assert h2.max() / h2.median() < amax.max() / amax.median()


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_calibrated_methods_beat_rtn_on_a_layer(method):
    x = outlier_inputs(n=8)
    errs = {}
    for m in ("rtn", method):
        layer, ctx = our_layer(kv_heads=4 if method == "awq" else 2)
        qconfig = QuantConfig(method=m, bits=4, group_size=16, sym=m != "awq", awq_search_tokens=128).resolved()
        errs[m] = quantize_layer(layer, x, 4, ctx, qconfig).rel_error
    assert errs[method] < 0.9 * errs["rtn"], errs


def test_gptq_one_pass_equals_recomputing_each_sublayers_inputs():
    """The pipeline's single pass (cached activations, q/k/v and gate/up stacked) against the plain
    true-sequential reference: each group's inputs taken by a hook on the whole layer's forward,
    through the sublayers quantized so far, and each Linear quantized on its own."""
    x = outlier_inputs(n=6)
    qconfig = QuantConfig(method="gptq", bits=4, group_size=16, sym=True).resolved()
    layer, ctx = our_layer(kv_heads=2)
    ours = quantize_layer(layer, x, 2, ctx, qconfig)

    ref_layer, _ = our_layer(kv_heads=2)
    groups = (LINEARS[:3], LINEARS[3:4], LINEARS[4:6], LINEARS[6:])
    with torch.no_grad():
        for names in groups:
            first = ref_layer.get_submodule(names[0])
            acc = gptq.HessianAccumulator(first.in_features)
            for xb in batches(x):
                acc.add(input_of(first, lambda xb=xb: ref_layer(xb, ctx.cos, ctx.sin, ctx.attn)))
            for n in names:
                lin = ref_layer.get_submodule(n)
                q = gptq.gptq_quantize(lin.weight, acc.H, 4, 16, True, act_order=qconfig.act_order).quantized
                lin.weight.data = q.dequantize()
                same = (q.qweight == ours.quantized[n].qweight).float().mean()
                assert same > 0.999, (n, float(same))
                torch.testing.assert_close(ours.quantized[n].dequantize(), q.dequantize(), rtol=0, atol=0.05)
        torch.testing.assert_close(ours.next_x, ctx.forward(ref_layer, x), rtol=1e-3, atol=1e-3)


def test_fp8_and_int8_weights_match_direct_computation():
    torch.manual_seed(0)
    w = torch.randn(8, 32) * torch.rand(8, 1)
    for scheme in ("channel", "tensor"):
        q = fp8.quantize_fp8(w, scheme)
        amax = w.abs().amax(1, keepdim=True) if scheme == "channel" else w.abs().max().reshape(1)
        torch.testing.assert_close(q.weight_scale, amax / 448.0)
        assert q.weight.float().abs().max() == 448.0
        rel = ((q.dequantize() - w).abs() / w.abs().clamp(min=1e-3 * amax.max())).max()
        assert rel <= 2 ** -4 + 1e-6            # e4m3: 3 mantissa bits, half an ulp
    q8 = int8.quantize_int8(w)
    s = w.double().abs().amax(1, keepdim=True) / 127
    torch.testing.assert_close(q8.dequantize().double(), torch.round(w.double() / s) * s, rtol=0, atol=1e-6)
