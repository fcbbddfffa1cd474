"""kivi2 in the C++ CPU decode kernels (llmopt/kernels/cpu_decode.cpp): decode_attention over a float
residual cache and 2-bit pages (llmopt/kernels/kivi.py), each row reading its first quant_blocks blocks
from the pages, against float64 attention over the dequantized rows and against the reference path;
make_cache's checks of the pages and of the ids of each space; and the C++ decoder layer
(CpuDecode.run with pages, decode and per-token rows) against the model's Python layers over the same
kivi2 cache."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from llmopt import kernels
from llmopt.cache.kivi import key_page_bytes, value_page_bytes
from llmopt.kernels import cpu_quant, kivi, reference

pytestmark = pytest.mark.skipif(cpu_quant.ops() is None, reason="needs the C++ kernels (g++, AVX2)")


def _cache(g, G, hkv, d, dtype, num_residual, num_pages):
    """Random residual caches [num_residual, G, hkv, d] of dtype and pages quantized from random blocks."""
    kc, vc = ((torch.randn(num_residual, G, hkv, d, generator=g) * 2).to(dtype) for _ in range(2))
    kx = torch.randn(num_pages, G, hkv, d, generator=g) * 2 + torch.randn(1, 1, hkv, d, generator=g)  # channel offsets
    vx = torch.randn(num_pages, G, hkv, d, generator=g) * 2
    kp, vp = kivi.quantize_keys(kx), kivi.quantize_values(vx)
    assert kp.shape == (num_pages, hkv, key_page_bytes(G, d)) and vp.shape == (num_pages, hkv, value_page_bytes(G, d))
    return kc, vc, kp, vp


def _tables(g, lens, quant, G, num_residual, num_pages, width):
    """Block tables [S, width]: sequence s's first quant[s] entries distinct page ids, then distinct
    residual ids (every id of both spaces used at most once in all), padded with -1."""
    pages, residual = torch.randperm(num_pages, generator=g).tolist(), torch.randperm(num_residual, generator=g).tolist()
    rows = []
    for n, q in zip(lens, quant):
        used = -(-n // G)
        row = [pages.pop() for _ in range(q)] + [residual.pop() for _ in range(used - q)]
        rows.append(row + [-1] * (width - used))
    return torch.tensor(rows, dtype=torch.int32)


def _float64_attention(q, kc, vc, kp, vp, tables, lens, quant, scale, window):
    """Per sequence: its rows gathered block by block (pages dequantized in float64, residual rows
    widened), softmax(q k^T * scale) v over the last `window` of them (all when window < 0)."""
    G, hkv, d = kc.shape[1], kc.shape[2], kc.shape[3]
    out = torch.empty(q.shape, dtype=torch.float64)
    for s in range(q.shape[0]):
        n, ks, vs = int(lens[s]), [], []
        for b in range(-(-n // G)):
            i = int(tables[s, b])
            if b < quant[s]:
                ks.append(kivi.dequantize_keys(kp[i:i + 1], G, d, torch.float64)[0])
                vs.append(kivi.dequantize_values(vp[i:i + 1], G, d, torch.float64)[0])
            else:
                ks.append(kc[i].double())
                vs.append(vc[i].double())
        k, v = torch.cat(ks)[:n], torch.cat(vs)[:n]            # [n, hkv, d]
        lo = max(0, n - window) if window > 0 else 0
        k, v = k[lo:], v[lo:]
        qs = q[s].double().view(hkv, -1, d)                    # the head group of each kv head
        scores = torch.einsum("hgd,nhd->hgn", qs, k) * scale
        p = torch.exp(scores - scores.amax(-1, keepdim=True))
        p = p / p.sum(-1, keepdim=True)
        out[s] = torch.einsum("hgn,nhd->hgd", p, v).reshape(-1, d)
    return out


def _rel(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


# (G, hq, hkv, d, residual dtype, lens, quant_blocks): sequences with no pages, some, all but the
# partial last block, every block a page (a full last one), and one token
CASES = {
    "g32-d64-gqa3-f32": (32, 6, 2, 64, torch.float32, [40, 100, 1, 64, 129, 33], [0, 2, 0, 2, 4, 1]),
    "g32-d32-gqa3-bf16": (32, 9, 3, 32, torch.bfloat16, [97, 5, 64, 70], [3, 0, 1, 2]),
    "g32-d64-f16": (32, 9, 3, 64, torch.float16, [150, 31], [4, 0]),
    "g16-d64-mha-f32": (16, 2, 2, 64, torch.float32, [50, 16, 81], [3, 1, 2]),   # 4 value groups of 16 channels
    "g16-d32-bf16": (16, 6, 2, 32, torch.bfloat16, [47, 33], [2, 0]),
}


@pytest.mark.parametrize("window", [-1, 45])   # 45: a window starting inside a page
@pytest.mark.parametrize("case", list(CASES))
def test_decode_attention_reads_pages_and_residual(case, window):
    G, hq, hkv, d, dtype, lens, quant = CASES[case]
    g = torch.Generator().manual_seed(len(case) + window)
    num_residual, num_pages, width = 24, 30, 8
    kc, vc, kp, vp = _cache(g, G, hkv, d, dtype, num_residual, num_pages)
    tables = _tables(g, lens, quant, G, num_residual, num_pages, width)
    seq_lens, qb = torch.tensor(lens, dtype=torch.int32), torch.tensor(quant, dtype=torch.int32)
    q = torch.randn(len(lens), hq, d, generator=g)
    scale = d ** -0.5
    got = torch.ops.llmopt_cpu.decode_attention(q, kc, vc, tables, seq_lens, scale, window, 1.0, 1.0, None, None,
                                                kp, vp, qb)
    want = _float64_attention(q, kc, vc, kp, vp, tables, lens, quant, scale, window)
    assert got.dtype == torch.float32 and got.shape == q.shape
    assert _rel(got, want) <= 2e-6
    # the reference path (kivi.gather_rows) agrees, and kernels.paged_attention takes the C++ op for it
    qsl = torch.arange(len(lens) + 1, dtype=torch.int32)
    win = None if window < 0 else window
    ref = reference.paged_attention(q.double(), kc, vc, tables, seq_lens, qsl, scale, win, "kivi2", 1.0, 1.0,
                                    pages=(kp, vp, qb))
    assert _rel(got, ref) <= 2e-6
    routed = kernels.paged_attention(q, kc, vc, tables, seq_lens, qsl, scale, win, "kivi2", 1.0, 1.0,
                                     backend="torch", pages=(kp, vp, qb.long()))
    assert torch.equal(routed, got)
    # the pages matter: the same ids read as residual blocks give another result
    if any(quant):
        plain = torch.ops.llmopt_cpu.decode_attention(q, kc, vc, tables.clamp(max=num_residual - 1), seq_lens, scale,
                                                      window)
        assert _rel(plain, want) > 1e-2


def test_decode_attention_checks_pages_and_ids_per_space():
    G, hq, hkv, d = 32, 4, 2, 64
    g = torch.Generator().manual_seed(5)
    num_residual, num_pages = 4, 10                            # page ids 4..9 are no residual ids
    kc, vc, kp, vp = _cache(g, G, hkv, d, torch.float32, num_residual, num_pages)
    q = torch.randn(2, hq, d, generator=g)
    lens, qb = torch.tensor([70, 40], dtype=torch.int32), torch.tensor([2, 1], dtype=torch.int32)
    tables = torch.tensor([[9, 8, 3], [7, 2, -1]], dtype=torch.int32)

    def run(kc=kc, vc=vc, kp=kp, vp=vp, tables=tables, qb=qb):
        return torch.ops.llmopt_cpu.decode_attention(q, kc, vc, tables, lens, 0.125, -1, 1.0, 1.0, None, None, kp, vp, qb)

    want = _float64_attention(q, kc, vc, kp, vp, tables, lens.tolist(), qb.tolist(), 0.125, -1)
    assert _rel(run(), want) <= 2e-6
    bad = tables.clone()
    bad[0, 2] = 5                                               # a page id where a residual id belongs
    with pytest.raises(RuntimeError, match="block id out of range"):
        run(tables=bad)
    bad = tables.clone()
    bad[1, 0] = num_pages                                       # past the pages
    with pytest.raises(RuntimeError, match="page id out of range"):
        run(tables=bad)
    with pytest.raises(RuntimeError, match="quant_blocks"):
        run(qb=torch.tensor([4, 1], dtype=torch.int32))       # more pages than the row's blocks
    with pytest.raises(RuntimeError, match="quant_blocks must be"):
        run(qb=qb.long())
    with pytest.raises(RuntimeError, match="quant_blocks must be"):
        run(qb=qb[:1])
    with pytest.raises(RuntimeError, match="kivi2 pages must be"):
        run(vp=vp[..., 1:].contiguous())
    with pytest.raises(RuntimeError, match="kivi2 pages must be"):
        run(kp=kp[:5])                                          # pools of different sizes
    with pytest.raises(RuntimeError, match="kivi2 pages must be"):
        run(kp=None)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        run(kc=kc.to(torch.float8_e4m3fn), vc=vc.to(torch.float8_e4m3fn))
    # without pages the op reads the tables as residual ids only
    with pytest.raises(RuntimeError, match="block id out of range"):
        torch.ops.llmopt_cpu.decode_attention(q, kc, vc, tables, lens, 0.125, -1)


# -- the decoder layer: CpuDecode.run against the model's Python layers over the same kivi2 cache ---
class _KiviAttention(kernels.PagedStep):
    """A kivi2 attention context for the model's Python layers (the reference path: K/V written into
    the residual, attention over pages and residual) and for CpuDecode (for_layer, quant_blocks)."""

    backend = "torch"

    def __init__(self, kcs, vcs, kps, vps, scale) -> None:
        self.kcs, self.vcs, self.kps, self.vps, self.scale = kcs, vcs, kps, vps, scale
        self.group_steps = []
        self.r = SimpleNamespace(layer_group=[0] * len(kcs))

    def for_layer(self, i):
        return self

    def __call__(self, i, q, k, v, window):
        reference.write_kv(self.kcs[i], self.vcs[i], k, v, self.slot_mapping, "auto", 1.0, 1.0)
        return reference.paged_attention(q, self.kcs[i], self.vcs[i], self.block_tables, self.seq_lens,
                                         self.query_start_loc, self.scale, window, "auto", 1.0, 1.0,
                                         pages=(self.kps[i], self.vps[i], self.quant_blocks))


def _engine(path):
    from llmopt.engine.args import EngineArgs
    from llmopt.engine.engine import LLMEngine
    from llmopt.models.loader import load_model
    args = EngineArgs(model=str(path), dtype="float32", device="cpu", detokenize=False, kv_cache_memory=1 << 22)
    return LLMEngine(args, loaded=load_model(str(path), "float32", "cpu", tokenizer=False))


@pytest.mark.parametrize("rows", ["decode", "per-token"])
def test_cpu_decode_layers_read_kivi2_pages_as_the_python_layers(tiny_factory, rows):
    """One step (3 decode rows, or per-token rows: 3 new tokens of one sequence beside a decode row)
    through the C++ layers and through the Python layers with the reference kivi2 attention: the same
    K/V written into the residual and the same logits within float32 rounding."""
    runner = _engine(tiny_factory(weight_std=0.2, head_dim=32, hidden_size=128)).runner
    f, model, cfg = runner.cpu_decode, runner.model, runner.cfg
    assert f is not None
    G, hkv, d, layers = 16, cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers
    g = torch.Generator().manual_seed(11)
    caches = [_cache(g, G, hkv, d, torch.float32, 12, 16) for _ in range(layers)]
    kcs, vcs, kps, vps = (list(t) for t in zip(*caches))
    new = [1, 1, 1] if rows == "decode" else [3, 1]
    lens = [45, 70, 17] if rows == "decode" else [52, 33]   # after the step (its tokens included)
    quant = [2, 4, 0] if rows == "decode" else [2, 1]
    tables = _tables(g, lens, quant, G, 12, 16, 6)
    seq_idx = torch.repeat_interleave(torch.arange(len(new)), torch.tensor(new))
    qsl = torch.tensor([0] + new).cumsum(0).to(torch.int32)
    positions = torch.cat([torch.arange(n - k, n) for n, k in zip(lens, new)])
    slots = tables[seq_idx, positions // G].long() * G + positions % G
    assert all(int(tables[s, p // G]) < 12 and p // G >= quant[s] for s, p in zip(seq_idx.tolist(), positions.tolist()))
    ids = torch.randint(0, cfg.vocab_size, (len(positions),), generator=g)

    def context(kcs, vcs):
        a = _KiviAttention(kcs, vcs, kps, vps, runner.scale)
        a.set_step(slots, tables, torch.tensor(lens, dtype=torch.int32), qsl, torch.tensor(quant, dtype=torch.int32))
        return a

    py = context([t.clone() for t in kcs], [t.clone() for t in vcs])
    cpp = context([t.clone() for t in kcs], [t.clone() for t in vcs])
    with torch.inference_mode():
        want = model.compute_logits(model(ids, positions, py)).float()
        got = f.run(ids, positions, cpp if rows == "decode" else f.rows_context(cpp, seq_idx, positions), cpp.kcs,
                    cpp.vcs, pages=(kps, vps))
    assert got.shape == want.shape == (len(positions), cfg.vocab_size)
    assert _rel(got, want) <= 1e-5
    for a, b in zip(cpp.kcs + cpp.vcs, py.kcs + py.vcs):   # the step's K/V in the residual, as the Python layers wrote them
        assert _rel(a, b) <= 1e-5
    # the pages are read: the same step with every block read from the residual gives other logits
    plain = context([t.clone() for t in kcs], [t.clone() for t in vcs])
    plain.set_step(slots, tables.clamp(max=11), plain.seq_lens, qsl, None)
    with torch.inference_mode():
        other = f.run(ids, positions, plain if rows == "decode" else f.rows_context(plain, seq_idx, positions),
                      plain.kcs, plain.vcs)
    assert _rel(other, want) > 1e-3
    with pytest.raises(ValueError, match="quant_blocks"):
        f.run(ids, positions, plain if rows == "decode" else f.rows_context(plain, seq_idx, positions), plain.kcs,
              plain.vcs, pages=(kps, vps))


def _pages_from_definition(x, per_channel: bool, g: int) -> bytes:
    """One block of one head, [G, D] float32, as KIVI's page written from its definition, in numpy:
    the groups' fp16 scales, their fp16 zeros, then the 2-bit codes token by token, channel c in
    bits 2 * (c % 4) of byte c / 4."""
    import numpy as np
    x = x.numpy().astype(np.float32)
    t, d = x.shape
    v = min(g, d)
    groups = x.T if per_channel else x.reshape(t, d // v, v)   # [groups..., members]
    lo, hi = groups.min(-1), groups.max(-1)
    scale, zero = ((hi - lo) / np.float32(3)).astype(np.float16), lo.astype(np.float16)
    s32, z32 = scale.astype(np.float32), zero.astype(np.float32)
    if per_channel:
        s_full, z_full = np.broadcast_to(s32[None], x.shape), np.broadcast_to(z32[None], x.shape)
    else:
        s_full, z_full = np.repeat(s32, v, 1), np.repeat(z32, v, 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(s_full > 0, np.rint((x - z_full) / np.where(s_full > 0, s_full, 1)), 0)
    q = np.clip(q, 0, 3).astype(np.uint8).reshape(t, d // 4, 4)
    codes = q[..., 0] | (q[..., 1] << 2) | (q[..., 2] << 4) | (q[..., 3] << 6)
    return scale.tobytes() + zero.tobytes() + codes.tobytes()


@pytest.mark.parametrize("g,d", [(32, 64), (16, 32), (32, 16)])
def test_pages_are_kivis_definition_byte_for_byte_and_round_trip_within_half_a_step(g, d):
    gen = torch.Generator().manual_seed(g + d)
    x = torch.randn(3, g, 2, d, generator=gen) * 3 + torch.randn(2, d, generator=gen) * 4   # channel offsets
    x[1, :, 0, 0] = 1.5                                                                      # a flat group
    kp, vp = kivi.quantize_keys(x), kivi.quantize_values(x)
    assert kp.shape[-1] == key_page_bytes(g, d) and vp.shape[-1] == value_page_bytes(g, d)
    for n in range(3):
        for h in range(2):
            assert bytes(kp[n, h].numpy()) == _pages_from_definition(x[n, :, h], True, g)
            assert bytes(vp[n, h].numpy()) == _pages_from_definition(x[n, :, h], False, g)
    k, v = kivi.dequantize_keys(kp, g, d, torch.float64), kivi.dequantize_values(vp, g, d, torch.float64)
    xd = x.double()
    k_step = (xd.amax(1, keepdim=True) - xd.amin(1, keepdim=True)) / 3
    vg = xd.reshape(3, g, 2, -1, min(g, d))
    v_step = ((vg.amax(-1, keepdim=True) - vg.amin(-1, keepdim=True)) / 3).expand_as(vg).reshape(xd.shape)
    assert ((k - xd).abs() <= k_step / 2 + 2e-3 * xd.abs().amax()).all()   # + the fp16 rounding of scale and zero
    assert ((v - xd).abs() <= v_step / 2 + 2e-3 * xd.abs().amax()).all()
    assert torch.equal(k[1, :, 0, 0], torch.full((g,), 1.5, dtype=torch.float64))           # exact where flat


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("g,d", [(32, 64), (16, 32), (32, 16)])
def test_cpp_conversion_writes_the_reference_pages_byte_for_byte(dtype, g, d):
    """llmopt_cpu.kivi_convert (the runner's conversions on the CPU) stores the bytes of
    kivi.quantize_keys / quantize_values, flat groups and fp16 rounding ties included."""
    gen = torch.Generator().manual_seed(g * d)
    kc = (torch.randn(6, g, 3, d, generator=gen) * 3 + torch.randn(3, d, generator=gen) * 4).to(dtype)
    vc = torch.randn(6, g, 3, d, generator=gen).to(dtype)
    kc[2, :, 1, 0] = 0.75                                               # a flat key channel
    vc[4, 5, 2] = -2.0                                                  # a flat value token
    vc[1, :, 0, :] = torch.arange(g * d).reshape(g, d).to(dtype) % 7    # exact ties of (x - zero) / scale
    res, pages = torch.tensor([4, 0, 2, 1]), torch.tensor([1, 3, 0, 2])
    kp = torch.full((4, 3, key_page_bytes(g, d)), 0xAB, dtype=torch.uint8)
    vp = torch.full((4, 3, value_page_bytes(g, d)), 0xAB, dtype=torch.uint8)
    cpu_quant.ops().kivi_convert(kc, vc, kp, vp, res, pages)
    assert torch.equal(kp[pages], kivi.quantize_keys(kc[res]))
    assert torch.equal(vp[pages], kivi.quantize_values(vc[res]))
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_quant.ops().kivi_convert(kc, vc, kp, vp, torch.tensor([6]), torch.tensor([0]))
    with pytest.raises(RuntimeError, match="converted twice"):   # blocks run in parallel: one writer a page
        cpu_quant.ops().kivi_convert(kc, vc, kp, vp, torch.tensor([0, 1]), torch.tensor([2, 2]))


def test_a_nan_in_the_residual_makes_its_group_nan_in_both_conversions():
    """A NaN poisons its group (scale and zero NaN, as torch's amin / amax), never a finite page."""
    kc, vc = torch.randn(2, 32, 2, 64), torch.randn(2, 32, 2, 64)
    kc[1, 5, 0, 3] = vc[1, 7, 1, 9] = float("nan")
    kp = torch.zeros(2, 2, key_page_bytes(32, 64), dtype=torch.uint8)
    vp = torch.zeros(2, 2, value_page_bytes(32, 64), dtype=torch.uint8)
    cpu_quant.ops().kivi_convert(kc, vc, kp, vp, torch.tensor([0, 1]), torch.tensor([0, 1]))
    keys = (kivi.dequantize_keys(kp, 32, 64, torch.float32),
            kivi.dequantize_keys(kivi.quantize_keys(kc), 32, 64, torch.float32))
    values = (kivi.dequantize_values(vp, 32, 64, torch.float32),
              kivi.dequantize_values(kivi.quantize_values(vc), 32, 64, torch.float32))
    for got, want in (keys, values):
        assert torch.equal(got.isnan(), want.isnan()) and int(got.isnan().sum()) == 32
        assert torch.equal(got.nan_to_num(), want.nan_to_num())
