"""EAGLE and EAGLE-3 heads in the engine on a tiny random target: greedy outputs identical with
speculation on and off (penalties too), no block leaked after preemptions and aborts; heads saved
in the EAGLE repository's format (EAGLE-3: LlamaForCausalLMEagle3, midlayer.*, fc, norm, lm_head,
d2t, t2d) load back to the same weights; the target's forward hands out the hidden states entering
layers 2, L/2 and L-3."""

import json

import pytest
import torch
from safetensors.torch import load_file

from engine_helpers import check_no_leak, run_engine
from llmopt.engine.args import EngineArgs
from llmopt.engine.engine import LLMEngine
from llmopt.core.sampling_params import SamplingParams
from llmopt.errors import UserInputError
from llmopt.models.attention import DenseCausalAttention
from llmopt.models.loader import load_model
from llmopt.speculative.eagle import eagle3_layers, load_eagle_head, new_head, save_head
from test_drafters import _prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PENALTY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3)


@pytest.fixture(scope="module")
def setup(tiny_factory, tmp_path_factory):
    target = tiny_factory(seed=0, num_hidden_layers=6)
    loaded = load_model(str(target), "float32", "cpu", tokenizer=False)
    heads = {}
    for method in ("eagle", "eagle3"):
        folder = tmp_path_factory.mktemp(method)
        vocab = list(range(0, 96, 2)) if method == "eagle3" else None   # a draft vocabulary of every other id
        save_head(new_head(loaded.config, method, vocab, seed=1), folder)
        heads[method] = folder
    return target, loaded, heads


def _engine(setup, method, **kw):
    target, loaded, heads = setup
    loaded.model.capture_hidden = None
    spec = None if method is None else {"method": method, "model": str(heads[method]), "num_speculative_tokens": 3}
    kw.setdefault("kv_cache_memory", 1 << 22)
    return LLMEngine(EngineArgs(model=str(target), detokenize=False, block_size=4, speculative_config=spec,
                                enforce_eager=True, **kw), loaded=loaded)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_greedy_identity_and_no_leak(setup, method):
    prompts = _prompts(6, seed=4)
    for params in (GREEDY, PENALTY):
        ref = run_engine(_engine(setup, None), prompts, params)
        engine = _engine(setup, method)
        assert run_engine(engine, prompts, params) == ref
        check_no_leak(engine)
        st = engine.stats().spec_decoding
        assert st.num_drafts > 0 and st.num_drafts <= st.num_draft_tokens <= 3 * st.num_drafts
    engine = _engine(setup, method, kv_cache_memory=6 * 512 * 60, max_model_len=96)   # preempts
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = _prompts(12, seed=1)
    assert run_engine(engine, prompts, params) == run_engine(_engine(setup, None), prompts, params)
    assert engine.stats().num_preemptions > 0
    check_no_leak(engine)


def test_eagle3_format_roundtrip_and_capture(setup, tmp_path):
    target, loaded, heads = setup
    names = set(load_file(str(heads["eagle3"] / "model.safetensors")))
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.hidden_norm.weight",
            "midlayer.input_layernorm.weight", "midlayer.self_attn.q_proj.weight"} <= names
    cfg = json.loads((heads["eagle3"] / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 48
    head = load_eagle_head(heads["eagle3"], "eagle3", loaded.config, torch.float32, "cpu")
    assert head.midlayer.self_attn.q_proj.in_features == 2 * loaded.config.hidden_size
    assert head.fc.in_features == 3 * loaded.config.hidden_size
    ids = torch.arange(48)
    assert torch.equal(ids + head.d2t, ids * 2) and int(head.t2d.sum()) == 48
    with pytest.raises(UserInputError):
        load_eagle_head(heads["eagle3"], "eagle", loaded.config, torch.float32, "cpu")
    # the hidden states entering layers 2, 3, 3 of 6
    m = loaded.model
    m.capture_hidden = eagle3_layers(6)
    x = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        final = m(x, torch.arange(4)[None], DenseCausalAttention())
        aux = [a.clone() for a in m.captured[1]]
    m.capture_hidden = None
    assert torch.equal(m.captured[0], final) and len(aux) == 2 and eagle3_layers(6) == (2, 3, 3)
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(target)).eval()
    with torch.no_grad():
        hs = hf(x, output_hidden_states=True).hidden_states   # hs[i] enters layer i
    for a, i in zip(aux, (2, 3)):
        torch.testing.assert_close(a, hs[i], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("int8_group", [0, 16])
def test_cpu_kernel_linears_match_the_heads_torch_linears(setup, method, int8_group):
    """The proposer's head runs its linears through the C++ kernels: float32 (llmopt_cpu::f32_gemm)
    gives nn.Linear's outputs; the int8 drafting copy (w8_gemm) gives the outputs of nn.Linear over
    its dequantized weights, which are within half a step of the float ones. 1, 3 and 40 rows (the
    tiles and the panels), bias included (EAGLE-1's fc)."""
    from llmopt.kernels import cpu_quant
    from llmopt.speculative.eagle import CpuLinear, use_cpu_kernels
    from llmopt.spec_tune.train_loss import TTTAttention
    _, loaded, heads = setup
    assert cpu_quant.ops() is not None, "the C++ kernels did not build"
    ref = load_eagle_head(heads[method], method, loaded.config, torch.float32, "cpu")
    fast = load_eagle_head(heads[method], method, loaded.config, torch.float32, "cpu")
    assert use_cpu_kernels(fast, int8_group)
    swapped = [m for m in fast.modules() if type(m) is CpuLinear]
    assert not any(type(m) is torch.nn.Linear for m in fast.modules())
    assert len(swapped) == sum(type(m) is torch.nn.Linear for m in ref.modules())
    if int8_group:
        assert all(m.gs == int8_group for m in swapped)
        for name, m in ref.named_modules():
            if type(m) is torch.nn.Linear:       # the reference: nn.Linear over the dequantized weights
                q = fast.get_submodule(name)
                deq = (q.codes.float().view(m.out_features, -1, int8_group) * q.scales[..., None]).view_as(m.weight)
                assert ((deq - m.weight).abs() <= q.scales.repeat_interleave(int8_group, 1) / 2 + 1e-7).all()
                with torch.no_grad():
                    m.weight.copy_(deq)
    h = loaded.config.hidden_size
    width = 3 * h if method == "eagle3" else h
    g = torch.Generator().manual_seed(0)
    for n in (1, 3, 40):
        emb, hid = torch.randn(1, n, h, generator=g), torch.randn(1, n, width, generator=g)
        pos = torch.arange(n)[None]
        with torch.inference_mode():
            a = ref(emb, hid, pos, TTTAttention())
            b = fast(emb, hid, pos, TTTAttention())
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
        if method == "eagle3":
            torch.testing.assert_close(fast.lm_head(fast.norm(b)), ref.lm_head(ref.norm(a)), atol=1e-4, rtol=1e-4)
