"""A bfloat16 / float16 checkpoint on the CPU (`--dtype auto`) holds its Linear and embedding weights
16-bit (llmopt.layers.modules16), computes in float32, and decodes exactly as its float32 copy
(`--dtype float32`): the C++ kernels widen each weight to the float32 value it stands for."""

from __future__ import annotations

import pytest
import torch

from llmopt.core.sampling_params import SamplingParams
from llmopt.engine.llm import LLM
from llmopt.estimate import estimate, resolve_model_arch
from llmopt.kernels import cpu_quant
from llmopt.layers.modules16 import Embedding16, Linear16
from llmopt.models.attention import DenseCausalAttention
from llmopt.models.loader import load_model

pytestmark = pytest.mark.skipif(cpu_quant.ops() is None, reason="needs the C++ kernels (g++, AVX2)")


def held_bytes(model) -> int:
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()] if t is not model.inv_freq}
    return sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.fixture(scope="module", params=[(torch.bfloat16, False), (torch.float16, True)],
                ids=["bf16-untied", "fp16-tied"])
def ckpt16(request, tiny_factory):
    dtype, tied = request.param
    return dtype, tiny_factory(dtype=dtype, tie_word_embeddings=tied, weight_std=0.05, vocab_size=256)


def test_weights_are_held_16bit_and_the_plan_says_so(ckpt16):
    dtype, path = ckpt16
    lm = load_model(str(path), "auto", "cpu", tokenizer=False)
    full = load_model(str(path), "float32", "cpu", tokenizer=False)
    assert (lm.dtype, lm.weight_dtype, full.weight_dtype) == (torch.float32, dtype, torch.float32)
    m = lm.model
    linears = [mod for mod in m.modules() if isinstance(mod, torch.nn.Linear)]
    assert linears and all(type(mod) is Linear16 and mod.weight.dtype == dtype for mod in linears)
    assert type(m.model.embed_tokens) is Embedding16 and m.model.embed_tokens.weight.dtype == dtype
    assert all(n.weight.dtype == torch.float32 for n in m.modules() if type(n).__name__ == "RMSNorm")
    if m.config.tie_word_embeddings:
        assert m.lm_head.weight is m.model.embed_tokens.weight
    matrices = sum(p.numel() for p in {id(p): p for p in m.parameters()}.values() if p.dim() == 2)
    assert held_bytes(full.model) - held_bytes(m) == 2 * matrices   # 2 bytes a weight, not 4
    for flag, held in (("auto", held_bytes(m)), ("float32", held_bytes(full.model))):
        est = estimate(resolve_model_arch(str(path)), device="cpu", dtype=flag, kv_cache_memory=1 << 20)
        assert est.weights.bytes_total == held, flag
        assert (est.dtype, est.weight_dtype) == ("float32", str(lm.weight_dtype if flag == "auto" else
                                                             torch.float32).removeprefix("torch."))


def test_decodes_bit_for_bit_as_its_float32_copy(ckpt16, float32_products):
    """Greedy tokens and their logprobs through the engine's C++ decode step (prefill rows and
    decode rows) equal those of the float32 copy exactly, on a float32 KV cache (`auto` holds the
    cache in the weights' 16-bit dtype), with float32 products; the Python layers (the model's own
    forward, as eval-ppl runs it) agree with transformers within float32 rounding, and with the
    bfloat16 products of AMX / AVX-512 BF16 (defaults.CPU_BF16_DOT_PRODUCTS, where the CPU has them)
    within twice that."""
    dtype, path = ckpt16
    prompts = [[3, 17, 42, 9], list(range(5, 205))]
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    outs = []
    for flag in ("auto", "float32"):
        loaded = load_model(str(path), flag, "cpu", tokenizer=False)
        kw = dict(kv_cache_memory=4 << 20, max_model_len=512, detokenize=False)
        auto = LLM(str(path), loaded=loaded, **kw).engine.executor
        assert auto.key_caches[0].dtype == (dtype if flag == "auto" else torch.float32)
        llm = LLM(str(path), loaded=loaded, kv_cache_dtype="float32", **kw)
        assert llm.engine.executor.cpu_decode is not None
        outs.append([(o.outputs[0].token_ids, [(d.logprob, sorted(d.top.items())) for d in o.outputs[0].logprobs])
                     for o in llm.generate(prompts, sp)])
    assert outs[0] == outs[1]

    import transformers
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32).eval()
    ids = torch.tensor([prompts[1]])
    with torch.no_grad():
        want = ref(ids).logits[0]
        lm = load_model(str(path), "auto", "cpu", tokenizer=False).model
        got = lm.compute_logits(lm(ids, torch.arange(ids.shape[1])[None], DenseCausalAttention()))[0]
        assert torch.allclose(got, want, atol=2e-4, rtol=1e-4), (got - want).abs().max()
        torch.ops.llmopt_cpu.tiles_config(-1, 0, 0, -1, 1)   # (the fixture restores the default)
        got = lm.compute_logits(lm(ids, torch.arange(ids.shape[1])[None], DenseCausalAttention()))[0]
    assert torch.allclose(got, want, atol=4e-4, rtol=2e-4), (got - want).abs().max()


def test_gradients_flow_through_a_16bit_linear():
    """spec-tune's loss runs through the target's head: autograd widens the weight for that call."""
    torch.manual_seed(0)
    lin = Linear16(24, 5, True, torch.bfloat16)
    lin.weight.copy_(torch.randn(5, 24))
    lin.bias.copy_(torch.randn(5))
    x = torch.randn(3, 24, requires_grad=True)
    lin(x).square().sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    torch.nn.functional.linear(x2, lin.weight.float(), lin.bias).square().sum().backward()
    assert torch.allclose(x.grad, x2.grad)
    with torch.no_grad():
        assert torch.allclose(lin(x), x @ lin.weight.double().float().t() + lin.bias, atol=1e-5)
