"""The C++ decode step (llmopt/worker/cpu_decode.py over kernels/cpu_decode.cpp) against the Python
layers it replaces: the same logits within float32 rounding for every architecture and weight
format it takes (float activations), the integer tiles (int8 activations) equal to a float64 dot
product of the quantized activations with the dequantized weight, the attention op against the
reference, and the engine's greedy tokens against Hugging Face transformers."""

from __future__ import annotations

import pytest
import torch

from llmopt import defaults
from llmopt.kernels import cpu_quant
from idot_util import IDOT_PATHS, quantize_x
from quant_util import quantization_config, rtn, write_quantized

pytestmark = pytest.mark.skipif(cpu_quant.ops() is None, reason="needs the C++ kernels (g++, AVX2)")


def _engine(path, quantization=None, lm_head_dtype="auto", **kw):
    from llmopt.engine.args import EngineArgs
    from llmopt.engine.engine import LLMEngine
    from llmopt.models.loader import load_model
    args = EngineArgs(model=str(path), dtype="float32", device="cpu", detokenize=False, kv_cache_memory=1 << 22, **kw)
    return LLMEngine(args, loaded=load_model(str(path), "float32", "cpu", tokenizer=False,
                                             quantization=quantization, lm_head_dtype=lm_head_dtype))


def _decode_logits(runner, int8_act: bool):
    """Logits of two decode steps of 3 sequences through the C++ layers and through the Python
    layers (each writes the same K/V into the same slots), the prompts prefilled by the Python path."""
    from llmopt.core.scheduler import ScheduledRequest, SchedulerOutput
    f = runner.cpu_decode
    assert f is not None
    f.set_int8_activations(int8_act)
    vocab = runner.cfg.vocab_size
    blocks, lens = [[1, 2, 6], [3], [4, 5]], [20, 7, 17]
    g = torch.Generator().manual_seed(0)
    runner.cpu_decode = None
    runner.execute(SchedulerOutput([ScheduledRequest(f"q{i}", torch.randint(0, vocab, (n,), generator=g).tolist(),
                                                     0, b, 0) for i, (b, n) in enumerate(zip(blocks, lens))]))
    got, want = [], []
    for t in range(2):
        step = SchedulerOutput([ScheduledRequest(f"q{i}", [7 + i + t], n + t, b, 1)
                                for i, (b, n) in enumerate(zip(blocks, lens))])
        runner.cpu_decode = f
        got.append(runner.execute(step))
        runner.cpu_decode = None
        want.append(runner.execute(step))
    runner.cpu_decode = f
    return torch.cat(got), torch.cat(want)


def test_verification_rows_equal_the_python_layers(tiny_factory):
    """A speculative verification step (3 scored tokens of one sequence beside a decode row): each
    draft row attends over its own prefix, as the Python layers' causal attention does."""
    from llmopt.core.scheduler import ScheduledRequest, SchedulerOutput
    runner = _engine(tiny_factory(weight_std=0.2, model_type="qwen3")).runner
    f = runner.cpu_decode
    runner.cpu_decode = None
    runner.execute(SchedulerOutput([ScheduledRequest("a", list(range(10, 25)), 0, [1, 2], 0),
                                    ScheduledRequest("b", list(range(30, 36)), 0, [3], 0)]))
    step = SchedulerOutput([ScheduledRequest("a", [40, 41, 42], 15, [1, 2], 3, spec_token_ids=[41, 42]),
                            ScheduledRequest("b", [43], 6, [3], 1)])
    want = runner.execute(step)
    runner.cpu_decode = f
    got = runner.execute(step)   # the same K/V into the same slots
    assert got.shape == want.shape == (4, 96)
    assert _rel(got, want) <= 1e-5


PREFILL_CASES = {   # name: (checkpoint format or None, load-time quantization)
    "float": (None, None),
    "awq-w4g32": ("awq-w4g32", None),
    "gptq-w4-act-order": ("gptq-w4-act-order", None),
    "int8": (None, "int8"),
    "fp8": (None, "fp8"),
}


@pytest.mark.parametrize("idot_path", list(IDOT_PATHS)[:1] + list(IDOT_PATHS)[-1:], indirect=True)
@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_prefill_rows_equal_the_python_layers(tiny_factory, tmp_path, case, idot_path):
    """A prefill step of 45 rows (two prompts, one after a cached prefix) through the C++ layers, only
    the last row of each prompt scored: float activations through the float panels (>=
    CPU_F32_PANEL_MIN_ROWS rows; quantized weights decoded a panel at a time) give the Python layers'
    logits; with int8 activations the layers take the integer panels (VNNI) or the float panels (AVX2)."""
    from llmopt.core.scheduler import ScheduledRequest, SchedulerOutput
    name, quantization = PREFILL_CASES[case]
    path = tiny_factory(weight_std=0.2)
    if name is not None:
        fmt, quantize, kw = CHECKPOINTS[name]
        write_quantized(path, tmp_path, fmt, quantize, quantization_config(fmt, **kw))
        path = tmp_path
    runner = _engine(path, quantization=quantization).runner
    f = runner.cpu_decode
    assert 45 >= defaults.CPU_F32_PANEL_MIN_ROWS
    runner.cpu_decode = None
    runner.execute(SchedulerOutput([ScheduledRequest("a", list(range(10, 18)), 0, [1, 2], 1)]))
    step = SchedulerOutput([ScheduledRequest("a", list(range(30, 50)), 8, [1, 2], 1),
                            ScheduledRequest("b", list(range(50, 75)), 0, [3, 4], 1)])
    results = {}
    for int8_act in (False, True):
        f.set_int8_activations(int8_act)
        runner.cpu_decode = None
        want = runner.execute(step)
        runner.cpu_decode = f
        results[int8_act] = (runner.execute(step), want)   # the same K/V into the same slots
    got, want = results[False]
    assert got.shape == want.shape == (2, 96)
    assert _rel(got, want) <= 1e-5
    got, want = results[True]
    if case != "float":   # the int8 activations ran (at least in the int8 head's 2 rows)
        assert 1e-4 < _rel(got, want) <= 0.05
    else:
        assert _rel(got, want) <= 1e-5


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _act_order(w):
    """GPTQ act-order codes: groups of 32 over a random permutation of the input columns."""
    order = torch.randperm(w.shape[1], generator=torch.Generator().manual_seed(1))
    qt = rtn(w[:, order], 4, 32, True)
    q = torch.empty_like(qt.qweight)
    q[:, order] = qt.qweight
    g_idx = torch.empty(w.shape[1], dtype=torch.int32)
    g_idx[order] = (torch.arange(w.shape[1]) // 32).to(torch.int32)
    qt.qweight, qt.g_idx = q, g_idx
    return qt


CHECKPOINTS = {
    "awq-w4g32": ("awq", lambda w: rtn(w, 4, 32, False), dict(method="awq", bits=4, group_size=32, sym=False)),
    "gptq-w4g64": ("gptq", lambda w: rtn(w, 4, 64, True), dict(method="gptq", bits=4, group_size=64, sym=True)),
    "gptq-w4-act-order": ("gptq", _act_order, dict(method="gptq", bits=4, group_size=32, sym=True, act_order=True)),
    "gptq-w8": ("gptq", lambda w: rtn(w, 8, 32, False), dict(method="gptq", bits=8, group_size=32, sym=False)),
}

FLOAT_CASES = {   # name: (make_tiny arguments, load-time quantization)
    "llama": (dict(), None),
    "llama-int8": (dict(), "int8"),
    "llama-fp8": (dict(), "fp8"),
    "qwen2-bias-tied": (dict(model_type="qwen2", tie_word_embeddings=True), None),
    "qwen3-qk-norm": (dict(model_type="qwen3"), None),
    "mistral-window": (dict(model_type="mistral", sliding_window=8), None),
    "llama-mha": (dict(num_key_value_heads=4), None),
}


@pytest.mark.parametrize("case", list(FLOAT_CASES))
def test_cpu_decode_equals_the_python_layers(tiny_factory, case):
    tiny, quantization = FLOAT_CASES[case]
    engine = _engine(tiny_factory(weight_std=0.2, **tiny), quantization=quantization)
    got, want = _decode_logits(engine.runner, int8_act=False)
    assert got.shape == want.shape == (6, 96)
    assert _rel(got, want) <= 1e-5


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_cpu_decode_quantized_checkpoints(tiny_factory, tmp_path, name):
    """Float activations: the Python layers' numbers; int8 activations: within their rounding."""
    fmt, quantize, kw = CHECKPOINTS[name]
    write_quantized(tiny_factory(weight_std=0.2), tmp_path, fmt, quantize, quantization_config(fmt, **kw))
    engine = _engine(tmp_path, lm_head_dtype="float" if name == "gptq-w8" else "auto")
    layer = engine.runner.model.model.layers[0]
    assert type(layer.mlp.down_proj).__name__ != "Linear"
    got, want = _decode_logits(engine.runner, int8_act=False)
    assert _rel(got, want) <= 1e-5
    got, want = _decode_logits(engine.runner, int8_act=True)
    if name == "gptq-w8":   # 8-bit codes shifted to int8 hold -128: those linears keep float activations
        assert engine.runner.cpu_decode.int8_head is False
        assert (layer.mlp.down_proj.cpu_codes == -128).any() and _rel(got, want) <= 1e-5
    else:                   # x rounded to 8 bits per 32 columns: ~0.4% per element (the int8 head's too)
        assert engine.runner.cpu_decode.int8_head is True
        assert 1e-4 < _rel(got, want) <= 0.05


FP4_CHECKPOINTS = {"nvfp4": ("nvfp4", "compressed-tensors"), "mxfp4-gguf": ("mxfp4", "gguf"),
                   "nf4": ("nf4", "bitsandbytes")}


@pytest.mark.parametrize("name", list(FP4_CHECKPOINTS))
def test_cpu_decode_fp4_checkpoints(tiny_factory, tmp_path, name):
    """4-bit float codes (E2M1 with E4M3 or E8M0 block scales, NF4 with a double-quantized absmax)
    decoded inside the C++ layers' tiles: the Python layers' numbers with float activations; with int8
    activations E2M1 takes the integer tiles (within x's rounding, as AWQ's), NF4 stays float."""
    from typer.testing import CliRunner
    from llmopt.cli.app import app
    from llmopt.layers.modules_fp4 import Fp4Linear
    method, fmt = FP4_CHECKPOINTS[name]
    folder = tiny_factory(tokenizer=True, dtype=torch.float16, weight_std=0.2)
    calib = tmp_path / "calib.txt"
    calib.write_text("The quick brown fox jumps over the lazy dog. " * 80)
    out = tmp_path / ("m.gguf" if fmt == "gguf" else "m")
    res = CliRunner().invoke(app, ["quantize", "--model", str(folder), "--output", str(out), "--calib-data", str(calib),
                                   "--num-samples", "4", "--seq-len", "32", "--quiet", "--method", method,
                                   "--format", fmt])
    assert res.exit_code == 0, res.output
    engine = _engine(out, lm_head_dtype="float")   # (no int8 head: the int8 activations are the layers' alone)
    assert not engine.runner.cpu_decode.int8_head
    down = engine.runner.model.model.layers[0].mlp.down_proj
    assert isinstance(down, Fp4Linear) and down.nibbles
    got, want = _decode_logits(engine.runner, int8_act=False)
    assert _rel(got, want) <= 1e-5
    got, want = _decode_logits(engine.runner, int8_act=True)
    if down.table_name == "e2m1":   # x rounded to 8 bits per 32 columns: ~0.4% per element
        assert 1e-4 < _rel(got, want) <= 0.05
    else:                           # NF4's levels are no integers: float activations still
        assert _rel(got, want) <= 1e-5


def _e2m1_case(n: int, k: int, block: int, g):
    """(codes in the int4 layout, scales, float64 W) of random FP4 E2M1 codes: NVFP4's scales (block
    16: an E4M3 value over a global scale) or MXFP4's (block 32: powers of two), as Fp4Linear holds them."""
    from llmopt.layers.formats.fp4 import TABLES
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    if block == 16:
        scales = (torch.rand(n, k // block, generator=g) * 448).to(torch.float8_e4m3fn).float() / (448 * 6 / 2.5)
    else:
        scales = torch.exp2(torch.randint(-8, 3, (n, k // block), generator=g).float())
    w = torch.tensor(TABLES["e2m1"], dtype=torch.float64)[codes.long()]
    w = (w.view(n, -1, block) * scales.double()[..., None]).view(n, k)
    return cpu_quant.pack_int4(codes), scales, w


def _grouped_case(kind: str, n: int, k: int, gs: int, g):
    """(codes in the kernels' layout, scales, szeros, Kind, float64 W) of random grouped codes: int8
    (no zero point), int4 with stored zeros, 5- and 6-bit ones with stored zeros ("w5z") or one
    zero code, half their range ("w5c": what the integer kernels take off as they decode), FP4 E2M1
    ("e2m1": _e2m1_case)."""
    if kind == "e2m1":
        packed, scales, w = _e2m1_case(n, k, gs, g)
        return packed, scales, torch.empty(0), cpu_quant.FP4_KINDS["e2m1"], w
    scales = torch.rand(n, k // gs, generator=g) * 0.1 + 0.01
    if kind == "int8":
        codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        return codes, scales, torch.empty(0), 1, (codes.double().view(n, -1, gs) * scales.double()[..., None]).view(n, k)
    bits = 4 if kind == "int4" else int(kind[1])
    q = torch.randint(0, 2 ** bits, (n, k), generator=g)
    if kind.endswith("c"):
        zeros = torch.full((n, k // gs), 2.0 ** (bits - 1))
        szeros = zeros[0, :1].clone()
    else:
        zeros = torch.randint(0, 2 ** bits, (n, k // gs), generator=g).float()
        szeros = scales * zeros
    w = (q.double().view(n, -1, gs) - zeros.double()[..., None]) * scales.double()[..., None]
    packed = cpu_quant.pack_int4(q) if bits == 4 else cpu_quant.pack_hb(q, bits)
    return packed, scales, szeros, cpu_quant.KINDS[f"w{bits}"][1], w.view(n, k)


@pytest.mark.parametrize("idot_path", list(IDOT_PATHS), indirect=True)
@pytest.mark.parametrize("kind,gs", [("int8", 576), ("int8", 64), ("int4", 32), ("int4", 64), ("int4", 128),
                                     ("w5c", 32), ("w5z", 64), ("w6c", 16), ("w6z", 32), ("w6c", 128)])
@pytest.mark.parametrize("m", [1, 3, 16, 21])
def test_integer_tiles_equal_float64_of_quantized_activations(idot_path, kind, gs, m):
    g = torch.Generator().manual_seed(gs + m)
    n, k = 43, 576 if gs != 128 else 640   # 43: a partial panel of rows
    x = torch.randn(m, k, generator=g) * 3
    x[:, 5] = 0.0
    if m > 1:
        x[1, :64] = 0.0                    # an all-zero block: scale 0
    packed, scales, szeros, code, w = _grouped_case(kind, n, k, gs, g)
    y = torch.ops.llmopt_cpu.idot_gemm(x, packed, scales, szeros, gs, code)
    want = quantize_x(x) @ w.t()
    assert float((y.double() - want).abs().max() / want.abs().max()) <= 2e-6
    assert float(((x.double() @ w.t()) - want).abs().max() / want.abs().max()) > 1e-4   # the rounding is real


@pytest.mark.parametrize("idot_path", list(IDOT_PATHS), indirect=True)
@pytest.mark.parametrize("block", [16, 32, 64])   # NVFP4 (groups of 16: each half block), MXFP4, wider
@pytest.mark.parametrize("m", [1, 3, 16, 64])
def test_e2m1_integer_path_equals_float64_of_quantized_activations(idot_path, block, m):
    """FP4 E2M1 codes through the integer kernels (their 2v, integers in [-12, 12], with dx halved):
    exactly the dot product of the int8-quantized x with the dequantized weight, up to float32
    rounding of the block and group sums. Without VNNI, linears of CPU_F32_PANEL_MIN_ROWS rows or
    more take the float panels with float activations (as int4's do), so x's own product is the reference."""
    g = torch.Generator().manual_seed(block + m)
    n, k = 43, 640
    x = torch.randn(m, k, generator=g) * 3
    x[:, 5] = 0.0
    if m > 1:
        x[1, :64] = 0.0   # an all-zero block: scale 0
    packed, scales, w = _e2m1_case(n, k, block, g)
    y = torch.ops.llmopt_cpu.idot_gemm(x, packed, scales, torch.empty(0), block, cpu_quant.FP4_KINDS["e2m1"])
    int8_act = idot_path != "avx2-tiles" or m < defaults.CPU_F32_PANEL_MIN_ROWS
    want = quantize_x(x) @ w.t() if int8_act else x.double() @ w.t()
    assert float((y.double() - want).abs().max() / want.abs().max()) <= 2e-6
    if int8_act:
        assert float(((x.double() @ w.t()) - want).abs().max() / want.abs().max()) > 1e-4   # the rounding is real
        last = torch.ops.llmopt_cpu.idot_gemm(x[-1:].contiguous(), packed, scales, torch.empty(0), block,
                                              cpu_quant.FP4_KINDS["e2m1"])
        assert torch.equal(last, y[-1:])   # a row's bits whatever the row count
    # float activations (fp4_gemm: what the C++ layer runs with int8 activations off) keep the float path
    y_float = torch.ops.llmopt_cpu.fp4_gemm(x, packed, scales, block, cpu_quant.FP4_KINDS["e2m1"])
    assert float((y_float.double() - x.double() @ w.t()).abs().max() / want.abs().max()) <= 2e-6


def test_idot_refuses_nf4():
    codes = torch.zeros(8, 32, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="kind must be"):
        torch.ops.llmopt_cpu.idot_gemm(torch.randn(1, 64), codes, torch.ones(8, 2), torch.empty(0), 32,
                                       cpu_quant.FP4_KINDS["nf4"])


@pytest.mark.parametrize("kind,gs", [("int8", 64), ("int8", 16), ("int4", 32), ("int4", 128), ("w5c", 32),
                                     ("w5z", 64), ("w6c", 16), ("w6z", 32), ("e2m1", 16), ("e2m1", 32)])
def test_integer_paths_give_each_row_the_same_bits_at_any_row_count(kind, gs):
    """AVX2 tiles, VNNI tiles and VNNI panels sum each 32-column block (groups of 16, Q6_K's and
    NVFP4's: each half) exactly and then scale in one order: a row's output is the same bits on every
    path and at every M (a verified draft gets plain decoding's logits; a sequence's logits do not depend on its
    step's batch)."""
    g = torch.Generator().manual_seed(7)
    n, k = 43, 640
    x = torch.randn(21, k, generator=g) * 3
    packed, scales, szeros, code, _ = _grouped_case(kind, n, k, gs, g)
    outs = []
    try:
        for isa, panel in IDOT_PATHS.values():
            torch.ops.llmopt_cpu.tiles_config(isa, panel)
            outs += [torch.ops.llmopt_cpu.idot_gemm(x[:m], packed, scales, szeros, gs, code) for m in (1, 2, 3, 21)]
    finally:
        torch.ops.llmopt_cpu.tiles_config(-1, defaults.CPU_IDOT_PANEL_MIN_ROWS)
    for y in outs[1:]:
        assert torch.equal(y, outs[-1][:len(y)])


def test_idot_refuses_int8_code_minus_128():
    codes = torch.zeros(8, 64, dtype=torch.int8)
    codes[3, 7] = -128
    with pytest.raises(RuntimeError, match=r"\[-127, 127\]"):
        torch.ops.llmopt_cpu.idot_gemm(torch.randn(1, 64), codes, torch.ones(8, 1), torch.empty(0), 64, 1)


def _filled_cache(kv: str, nb: int, bs: int, hkv: int, d: int, g, k_scale=1.0, v_scale=1.0):
    """A paged cache of `kv` with every slot written by the reference path: (k, v, k scales, v scales)."""
    from llmopt.kernels import reference
    dt, w = reference.kv_cache_torch_dtype(kv, torch.float32), reference.kv_head_width(kv, d)
    kc, vc = torch.zeros(nb, bs, hkv, w, dtype=dt), torch.zeros(nb, bs, hkv, w, dtype=dt)
    ksc, vsc = (torch.zeros(nb, bs, hkv), torch.zeros(nb, bs, hkv)) if kv == "int8" else (None, None)
    k, v = (torch.randn(nb * bs, hkv, d, generator=g) * 3 for _ in range(2))
    reference.write_kv(kc, vc, k, v, torch.arange(nb * bs), kv, k_scale, v_scale, ksc, vsc)
    return kc, vc, ksc, vsc


KV_SCALES = {"fp8_e4m3": (0.5, 0.25), "fp8_e5m2": (2.0, 0.5)}   # fp8 caches with scales other than 1


@pytest.mark.parametrize("window", [-1, 5])
@pytest.mark.parametrize("d", [6, 16, 72, 96])   # plain loops, 4-key sums, 64 + 8 columns, 3 x 32 columns
@pytest.mark.parametrize("kv", ["float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2", "int8", "int4"])
def test_decode_attention_op_equals_the_reference(window, d, kv):
    """The op over every cache dtype against float64 attention over the dequantized cache (int4:
    heads of 32, 64 and 96, its blocks of 32 on and off the 64 columns held in registers)."""
    from llmopt.kernels import reference
    if kv == "int4":
        d = {6: 32, 16: 64, 72: 96, 96: 128}[d]
    g = torch.Generator().manual_seed(3)
    nb, bs, hkv, hq = 12, 4, 2, 6
    ks, vs = KV_SCALES.get(kv, (1.0, 1.0))
    kc, vc, ksc, vsc = _filled_cache(kv, nb, bs, hkv, d, g, ks, vs)
    tables = torch.tensor([[3, 7, 1, 0], [5, 0, 0, 0], [2, 4, 6, 8]], dtype=torch.int32)
    lens = torch.tensor([11, 1, 16], dtype=torch.int32)
    q = torch.randn(3, hq, d, generator=g)
    got = torch.ops.llmopt_cpu.decode_attention(q, kc, vc, tables, lens, 0.25, window, ks, vs, ksc, vsc)
    want = reference.paged_attention(q.double(), kc, vc, tables, lens, torch.arange(4, dtype=torch.int32), 0.25,
                                     None if window < 0 else window, kv, ks, vs, ksc, vsc)
    assert float((got.double() - want).abs().max()) <= 1e-5
    with pytest.raises(RuntimeError, match="block id out of range"):
        torch.ops.llmopt_cpu.decode_attention(q, kc, vc, tables + 20, lens, 0.25, window, ks, vs, ksc, vsc)
    with pytest.raises(RuntimeError, match="one dtype"):
        torch.ops.llmopt_cpu.decode_attention(q, kc, vc.double(), tables, lens, 0.25, window)
    if kv == "int8":
        with pytest.raises(RuntimeError, match="scale caches"):
            torch.ops.llmopt_cpu.decode_attention(q, kc, vc, tables, lens, 0.25, window)


@pytest.mark.parametrize("d", [16, 64, 72])
@pytest.mark.parametrize("kv", ["float32", "bfloat16", "float16", "fp8_e4m3", "int8", "int4"])
def test_decode_attention_gqa_groups_equal_repeated_heads_bit_for_bit(d, kv):
    """A GQA group's query heads share each key and value row (read once for up to three heads): the
    output equals, bit for bit, attention over the same cache with every kv head repeated per query head
    (one head a group), for groups of 1 to 5 heads (three, two and one at a time)."""
    if kv == "int4":
        d = {16: 32, 64: 64, 72: 96}[d]
    g = torch.Generator().manual_seed(5)
    nb, bs, hkv = 10, 4, 2
    ks, vs = KV_SCALES.get(kv, (1.0, 1.0))
    kc, vc, ksc, vsc = _filled_cache(kv, nb, bs, hkv, d, g, ks, vs)
    tables = torch.tensor([[3, 7, 1, 0], [5, 0, 0, 0], [2, 4, 6, 8]], dtype=torch.int32)
    lens = torch.tensor([14, 3, 15], dtype=torch.int32)
    for group in range(1, 6):
        q = torch.randn(3, hkv * group, d, generator=g)
        rep = [None if t is None else t.repeat_interleave(group, dim=2) for t in (kc, vc, ksc, vsc)]
        for window in (-1, 6):
            got = torch.ops.llmopt_cpu.decode_attention(q, kc, vc, tables, lens, 0.25, window, ks, vs, ksc, vsc)
            want = torch.ops.llmopt_cpu.decode_attention(q, rep[0], rep[1], tables, lens, 0.25, window, ks, vs,
                                                         rep[2], rep[3])
            assert torch.equal(got, want), (group, window)


def _fp8_grid(dt: torch.dtype) -> torch.Tensor:
    """Every finite value of an fp8 format, the midpoints between neighbours (the ties) and the
    floats just beside each midpoint."""
    vals = torch.arange(256, dtype=torch.uint8).view(dt).float()
    vals = vals[vals.isfinite()].unique()
    mids = (vals[1:] + vals[:-1]) / 2
    return torch.cat([vals, mids, mids.nextafter(torch.tensor(1e9)), mids.nextafter(torch.tensor(-1e9))])


@pytest.mark.parametrize("kv", ["float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2", "int8", "int4"])
def test_cpp_kv_write_equals_the_reference_byte_for_byte(kv):
    """The decode layer's K/V write (rounding, fp8 ties and subnormals, clamping past the format's
    range, int8 scales of zero rows, int4 blocks of zeros and of values 2^-20 to 2^18 apart, skipped
    slots) stores the bytes reference.write_kv stores."""
    from llmopt.kernels import reference
    g = torch.Generator().manual_seed(1)
    nb, bs, hkv, d = 8, 32, 2, 64 if kv == "int4" else 40
    n = nb * bs
    k = torch.randn(n, hkv, d, generator=g) * torch.exp2(torch.randint(-20, 18, (n, hkv, d), generator=g).float())
    v = torch.randn(n, hkv, d, generator=g)
    dt = reference.kv_cache_torch_dtype(kv, torch.float32)
    if dt.itemsize == 1 and dt not in (torch.int8, torch.uint8):
        grid = _fp8_grid(dt)
        v.view(-1)[:grid.numel()] = grid[torch.randperm(grid.numel(), generator=g)] * KV_SCALES[kv][1]
    k[0, 0], k[1, 1, :5] = 0.0, -0.0
    slots = torch.randperm(n, generator=g)
    slots[3] = -1
    ks, vs = KV_SCALES.get(kv, (1.0, 1.0))
    caches = []
    w = reference.kv_head_width(kv, d)
    for write in (reference.write_kv, None):
        kc, vc = torch.zeros(nb, bs, hkv, w, dtype=dt), torch.zeros(nb, bs, hkv, w, dtype=dt)
        ksc, vsc = (torch.zeros(nb, bs, hkv), torch.zeros(nb, bs, hkv)) if kv == "int8" else (None, None)
        if write is None:
            torch.ops.llmopt_cpu.write_kv(kc, vc, k, v, slots, ks, vs, ksc, vsc)
        else:
            write(kc, vc, k, v, slots, kv, ks, vs, ksc, vsc)
        caches.append([t.view(torch.uint8) for t in (kc, vc, ksc, vsc) if t is not None])
    for want, got in zip(*caches):
        assert torch.equal(got, want)


def test_engine_greedy_matches_transformers_through_the_cpp_step(tiny_factory):
    """Greedy decoding of 12 tokens for 4 prompts at once (decode steps of 4 rows in C++)."""
    from engine_helpers import hf_greedy, hf_model, mixed_prompts, run_engine
    from llmopt.core.sampling_params import SamplingParams
    path = tiny_factory(weight_std=0.2, model_type="qwen2")
    engine = _engine(path)
    assert engine.runner.cpu_decode is not None
    prompts = mixed_prompts(4, 96, lo=3, hi=20, seed=4)
    got = run_engine(engine, prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert got == hf_greedy(hf_model(path), prompts, 12)


def test_cpu_decode_off_where_it_does_not_apply(tiny_llama):
    from llmopt.worker.cpu_decode import CpuDecode
    engine = _engine(tiny_llama)
    assert engine.runner.cpu_decode is not None
    engine.runner.model.model.layers[1].mlp.down_proj.register_forward_hook(lambda *a: None)   # it would skip it
    assert CpuDecode.build(engine.runner) is None
    assert defaults.CPU_DECODE_MAX_ROWS >= 1


@pytest.mark.parametrize("kv", ["bfloat16", "float16", "fp8_e4m3", "fp8_e5m2", "int8", "int4"])
@pytest.mark.parametrize("tiny", [dict(), dict(model_type="mistral", sliding_window=8)], ids=["llama", "mistral-window"])
def test_cpu_decode_writes_and_reads_a_quantized_cache_as_the_python_layers(tiny_factory, kv, tiny):
    """The C++ layers store K/V as the reference path does and read them back dequantized: the
    Python layers' logits on the same cache, within float32 rounding (16-bit caches) or a code's
    rounding step (fp8, int8, int4: K/V computed in another order can round to a neighbouring code)."""
    shape = dict(head_dim=32, hidden_size=128) if kv == "int4" else {}   # int4: blocks of 32 along the head
    engine = _engine(tiny_factory(weight_std=0.2, **tiny, **shape), kv_cache_dtype=kv)
    assert engine.runner.cpu_decode is not None
    from llmopt.kernels import reference
    assert engine.runner.key_caches[0].dtype == reference.kv_cache_torch_dtype(kv, torch.float32)
    got, want = _decode_logits(engine.runner, int8_act=False)
    assert _rel(got, want) <= (1e-5 if kv in reference.FLOAT_KV else 1e-3)


@pytest.mark.parametrize("kv", ["bfloat16", "float16"])
def test_a_16bit_cache_generates_as_float32_within_its_rounding(tiny_factory, kv):
    from engine_helpers import mixed_prompts
    from llmopt.core.sampling_params import SamplingParams
    path = tiny_factory(weight_std=0.2, model_type="qwen2")
    prompts = mixed_prompts(4, 96, lo=3, hi=20, seed=4)
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = {}
    for name in ("float32", kv):
        engine = _engine(path, kv_cache_dtype=name)
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, sp)
        done = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o.outputs[0]
        outs[name] = [done[f"r{i}"] for i in range(len(prompts))]
    eps = {"bfloat16": 2 ** -8, "float16": 2 ** -11}[kv]
    for a, b in zip(outs["float32"], outs[kv]):
        assert a.token_ids == b.token_ids
        diff = max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs))
        assert diff <= 200 * eps, diff   # K/V rounded at eps relative: logits move by a few eps


def test_long_prefill_chunks_take_the_python_layers(tiny_factory, monkeypatch):
    """Prefill chunks of 64 rows or more past CPU_DECODE_MAX_CHUNK_CONTEXT run the Python layers
    (SDPA over the block), the ones before it and every decode step the C++ layers; the greedy
    tokens equal transformers' either way."""
    from engine_helpers import hf_greedy, hf_model, run_engine
    from llmopt.core.sampling_params import SamplingParams
    from llmopt.worker.cpu_decode import CpuDecode
    monkeypatch.setattr(defaults, "CPU_DECODE_MAX_CHUNK_CONTEXT", 128)
    path = tiny_factory(weight_std=0.2, max_position_embeddings=1024)
    engine = _engine(path, max_num_batched_tokens=64)
    rows = []
    real = CpuDecode.run
    monkeypatch.setattr(CpuDecode, "run", lambda self, ids, *a, **k: rows.append(len(ids)) or real(self, ids, *a, **k))
    prompt = torch.randint(0, 96, (300,), generator=torch.Generator().manual_seed(2)).tolist()
    got = run_engine(engine, [prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    # chunks ending at 64 and 128 in C++, at 192 and 256 in Python, the last 44 rows and decode in C++
    assert rows == [64, 64, 44] + [1] * 5
    assert got == hf_greedy(hf_model(path), [prompt], 6)
