"""eval-ppl: each protocol against an independent reference computed here with transformers' model
(the HF sliding loop, the GPTQ chunk loop, lm-eval's rolling windows, llama.cpp's chunk scoring) on
the first few thousand tokens of WikiText-2; KL divergence; the data readers; the CLI."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from llmopt.errors import DataError, UserInputError
from llmopt.eval import load_text_dataset, plan_ppl, run_ppl
from llmopt.eval.data import wikitext_detokenize
from llmopt.eval.windows import llamacpp_windows
from llmopt.models.loader import load_model

DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data"
WIKI = DATA / "wikitext-2-raw" / "wiki.test.raw"
LIMIT = 2000
REL = 1e-4


# a tiny random llama with SmolLM2's tokenizer (vocab 49152)
TINY_EVAL = dict(tokenizer=True, initializer_range=0.1, tie_word_embeddings=True, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def tiny(tiny_factory):
    folder = tiny_factory(seed=0, **TINY_EVAL)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    lm = load_model(str(folder), dtype="float32", device="cpu")
    return folder, hf, lm


@pytest.fixture(scope="module")
def tiny_head32(tiny_factory):
    """Heads of 32 values: the int4 cache quantizes them in blocks of 32."""
    folder = tiny_factory(seed=0, head_dim=32, hidden_size=128, **TINY_EVAL)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, hf, load_model(str(folder), dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def wiki():
    return load_text_dataset(str(WIKI))


def _ids(tok, text, limit=LIMIT):
    return tok(text, return_tensors="pt").input_ids[:, :limit]


def _rel(a, b):
    return abs(a - b) / abs(b)


# --- references (written from the peers' descriptions, on transformers' model) ----------------

@torch.no_grad()
def hf_sliding(model, enc, max_length, stride):
    """The loop of the HF guide "Perplexity of fixed-length models", counting each window's scored
    labels exactly (the guide's `num_valid_tokens - batch_size` is one short after the first window)."""
    seq_len, nll_sum, n_tokens, prev_end = enc.size(1), 0.0, 0, 0
    for begin in range(0, seq_len, stride):
        end = min(begin + max_length, seq_len)
        trg_len = end - prev_end
        input_ids = enc[:, begin:end]
        target_ids = input_ids.clone()
        target_ids[:, :-trg_len] = -100
        loss = model(input_ids, labels=target_ids).loss
        n = int((target_ids[:, 1:] != -100).sum())
        nll_sum += float(loss) * n
        n_tokens += n
        prev_end = end
        if end == seq_len:
            break
    return math.exp(nll_sum / n_tokens), n_tokens


@torch.no_grad()
def gptq_chunks(model, enc, seqlen):
    """GPTQ's eval loop: non-overlapping seqlen windows, tail dropped."""
    nsamples = enc.numel() // seqlen
    nlls = []
    for i in range(nsamples):
        batch = enc[:, i * seqlen:(i + 1) * seqlen]
        logits = model(batch).logits
        loss = torch.nn.CrossEntropyLoss()(logits[:, :-1, :].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        nlls.append(loss.float() * seqlen)
    return torch.exp(torch.stack(nlls).sum() / (nsamples * seqlen)).item()


@torch.no_grad()
def llamacpp_reference(model, tokens, n_ctx, bos=None):
    """llama.cpp perplexity(): chunks of n_ctx, logits of positions first..n_ctx-2 score the next token."""
    nll, count, first = 0.0, 0, n_ctx // 2
    for i in range(len(tokens) // n_ctx):
        start = i * n_ctx
        batch = tokens[start:start + n_ctx].clone()
        if bos is not None:
            batch[0] = bos
        logp = torch.log_softmax(model(batch[None]).logits[0].double(), -1)
        for j in range(first, n_ctx - 1):
            nll -= float(logp[j, tokens[start + j + 1]])
        count += n_ctx - first - 1
    return math.exp(nll / count)


def _lm_eval_rolling_windows(token_list, prefix_token, max_seq_len):
    """lm-eval utils.get_rolling_token_windows(context_len=1) followed by make_disjoint_window."""
    pred_len, predicted = max_seq_len, 0
    first_seq_len = min(max_seq_len, len(token_list))
    windows = [([prefix_token] + token_list[:first_seq_len - 1], token_list[:first_seq_len])]
    predicted += first_seq_len
    while predicted < len(token_list):
        window_pred_len = min(len(token_list) - predicted, pred_len)
        window_end = predicted + window_pred_len
        windows.append((token_list[window_end - max_seq_len - 1:window_end - 1],
                        token_list[window_end - window_pred_len:window_end]))
        predicted += window_pred_len
    return [(a[:len(a) - (len(b) - 1)], b) for a, b in windows]


@torch.no_grad()
def lm_eval_rolling(model, tok, pages, max_length):
    """lm-eval wikitext: loglikelihood_rolling per page, word/byte perplexity, bits per byte."""
    prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    lls, words, nbytes = [], 0, 0
    for page in pages:
        ll = 0.0
        for ctx, cont in _lm_eval_rolling_windows(tok.encode(wikitext_detokenize(page), add_special_tokens=False),
                                                  prefix, max_length):
            inp = torch.tensor((ctx + cont)[-(max_length + 1):][:-1])
            logits = F.log_softmax(model(inp[None]).logits[0], dim=-1)
            sel = logits[len(inp) - len(cont):len(inp)]
            ll += float(sel.gather(1, torch.tensor(cont)[:, None]).sum())
        lls.append(ll)
        words += len(re.split(r"\s+", page))
        nbytes += len(page.encode("utf-8"))
    return math.exp(-sum(lls) / words), math.exp(-sum(lls) / nbytes), -sum(lls) / nbytes / math.log(2)


# --- each method against its reference --------------------------------------------------------

def test_sliding_matches_hf_loop(tiny, wiki):
    folder, hf, lm = tiny
    plan = plan_ppl(lm.tokenizer, 1024, wiki, "sliding", max_length=256, stride=96, limit=LIMIT)
    r = run_ppl(lm, plan, batch_size=3)
    ref, n = hf_sliding(hf, _ids(lm.tokenizer, wiki.text), 256, 96)
    assert r.scored_tokens == n == LIMIT - 1
    assert _rel(r.ppl, ref) <= REL
    assert r.input_tokens > LIMIT and r.bits_per_byte > 0 and r.tokens_per_s > 0


def test_chunks_matches_gptq_loop(tiny, wiki):
    folder, hf, lm = tiny
    r = run_ppl(lm, plan_ppl(lm.tokenizer, 1024, wiki, "chunks", ctx=256, limit=LIMIT), batch_size=4)
    ref = gptq_chunks(hf, _ids(lm.tokenizer, wiki.text), 256)
    assert r.windows == LIMIT // 256 and r.scored_tokens == r.windows * 255
    assert _rel(r.ppl, ref) <= REL
    # bits per byte: the scored tokens' bytes, counted independently by decoding each chunk's targets
    ids = _ids(lm.tokenizer, wiki.text)[0]
    nbytes = sum(len(lm.tokenizer.decode(ids[i * 256 + 1:(i + 1) * 256]).encode()) for i in range(r.windows))
    assert abs(r.scored_bytes - nbytes) <= r.windows  # a chunk may split a multi-byte character
    assert _rel(r.bits_per_byte, r.mean_nll * r.scored_tokens / r.scored_bytes / math.log(2)) <= 1e-12


def test_llamacpp_matches_perplexity_tool(tiny, wiki):
    folder, hf, lm = tiny
    r = run_ppl(lm, plan_ppl(lm.tokenizer, 1024, wiki, "llamacpp", limit=LIMIT), batch_size=2)
    tokens = _ids(lm.tokenizer, WIKI.read_bytes().decode("utf-8"))[0]   # llama.cpp reads the file's bytes
    assert "\r\n" in wiki.as_stored and "\r" not in wiki.text     # WikiText-2 raw is stored with CRLF
    assert not torch.equal(tokens, _ids(lm.tokenizer, wiki.text)[0])   # so its tokens are not the LF text's
    assert tokens[0] != lm.tokenizer.bos_token_id  # SmolLM2's tokenizer adds no BOS: no replacement
    assert r.window == 512 and r.windows == LIMIT // 512 and r.scored_tokens == r.windows * 255
    assert _rel(r.ppl, llamacpp_reference(hf, tokens, 512)) <= REL


def test_llamacpp_bos_replacement():
    tokens = torch.arange(10, 30)
    wins = llamacpp_windows(tokens, 8, bos_id=1)
    assert len(wins) == 2 and [int(w.ids[0]) for w in wins] == [1, 1]
    assert torch.equal(wins[1].ids[1:], tokens[9:16]) and wins[1].start == 4
    assert torch.equal(wins[1].targets, tokens[13:16])  # 8 - 1 - 4 = 3 scored
    with pytest.raises(DataError):
        llamacpp_windows(tokens[:15], 8, None)  # llama.cpp needs 2 * n_ctx tokens


def test_rolling_matches_lm_eval_wikitext(tiny, wiki):
    folder, hf, lm = tiny
    plan = plan_ppl(lm.tokenizer, 1024, wiki, "rolling", max_length=384, limit=LIMIT)
    r = run_ppl(lm, plan, batch_size=4)
    assert r.documents >= 1 and r.windows > r.documents  # several windows per page, a partial last one
    word_ppl, byte_ppl, bpb = lm_eval_rolling(hf, lm.tokenizer, wiki.documents[:r.documents], 384)
    assert _rel(r.word_perplexity, word_ppl) <= REL
    assert _rel(r.byte_perplexity, byte_ppl) <= REL
    assert _rel(r.bits_per_byte, bpb) <= REL


def test_rolling_default_window_is_model_max_length(tiny, wiki):
    folder, hf, lm = tiny
    plan = plan_ppl(lm.tokenizer, lm.config.max_position_embeddings, wiki, "rolling", limit=LIMIT)
    assert plan.window == 1024 and max(len(w.ids) for w in plan.windows) == 1024


def test_smollm2_chunks_matches_transformers(smollm2_float):
    lm = load_model(None, dtype="float32", device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(smollm2_float, dtype=torch.float32).eval()
    data = load_text_dataset(str(WIKI))
    r = run_ppl(lm, plan_ppl(lm.tokenizer, 8192, data, "chunks", ctx=256, limit=512), batch_size=2)
    assert r.windows == 2
    assert _rel(r.ppl, gptq_chunks(hf, _ids(lm.tokenizer, data.text, 512), 256)) <= REL
    assert 5 < r.ppl < 200  # a trained model, not noise (a random one sits near the vocab size)


# --- KL divergence against a base model -------------------------------------------------------

def test_kl_against_itself_is_zero(tiny, wiki):
    folder, hf, lm = tiny
    r = run_ppl(lm, plan_ppl(lm.tokenizer, 1024, wiki, "chunks", ctx=128, limit=600), batch_size=2, base=lm)
    assert r.kl.top1_agreement == 1.0
    assert abs(r.kl.kld_mean) < 1e-6 and abs(r.kl.kld_max) < 1e-5
    assert _rel(r.kl.base_ppl, r.ppl) <= 1e-9


def test_kl_against_another_model(tiny, wiki, tiny_factory):
    folder, hf, lm = tiny
    base_hf_folder = tiny_factory(seed=1, **TINY_EVAL)
    base = load_model(str(base_hf_folder), dtype="float32", device="cpu")
    base_hf = AutoModelForCausalLM.from_pretrained(base_hf_folder, dtype=torch.float32).eval()
    r = run_ppl(lm, plan_ppl(lm.tokenizer, 1024, wiki, "chunks", ctx=128, limit=600), batch_size=2, base=base)
    enc = _ids(lm.tokenizer, wiki.text, 600)
    kls, agree = [], []
    with torch.no_grad():
        for i in range(enc.numel() // 128):
            batch = enc[:, i * 128:(i + 1) * 128]
            lp = torch.log_softmax(hf(batch).logits[0, :-1].double(), -1)
            lq = torch.log_softmax(base_hf(batch).logits[0, :-1].double(), -1)
            kls.append((lq.exp() * (lq - lp)).sum(-1))
            agree.append(lp.argmax(-1) == lq.argmax(-1))
    kl, agree = torch.cat(kls), torch.cat(agree)
    assert r.kl.kld_mean > 1e-3
    assert _rel(r.kl.kld_mean, float(kl.mean())) <= 1e-4
    assert _rel(r.kl.kld_median, float(kl.median())) <= 1e-4
    assert _rel(r.kl.kld_max, float(kl.max())) <= 1e-4
    assert _rel(r.kl.kld_p99, float(torch.quantile(kl, 0.99))) <= 1e-4
    assert r.kl.top1_agreement == pytest.approx(float(agree.double().mean()), abs=1.5 / len(kl))
    assert _rel(r.kl.base_ppl, gptq_chunks(base_hf, enc, 128)) <= REL


def _fake_quantized(kv: str, x: torch.Tensor) -> torch.Tensor:
    """K or V [B, Hkv, T, D] as a cache of `kv` holds it, written from the formats' definitions:
    16-bit and fp8 casts (fp8 clamped to the format's largest value, scale 1), int8 codes of
    round(x / s) with s = absmax / 127 per token and head, int4 through the gguf package's own Q4_0
    quantizer and dequantizer along the head."""
    if kv == "int4":
        from gguf import GGMLQuantizationType, quants
        a = x.detach().float().numpy().reshape(-1, 32)
        back = quants.dequantize(quants.quantize(a, GGMLQuantizationType.Q4_0), GGMLQuantizationType.Q4_0)
        return torch.from_numpy(back).reshape(x.shape).to(x.dtype)
    if kv == "int8":
        s = x.abs().amax(-1, keepdim=True) / 127
        return torch.round(x / s.clamp_min(1e-30)).clamp(-127, 127) * s
    dt = {"bfloat16": torch.bfloat16, "float16": torch.float16, "fp8_e4m3": torch.float8_e4m3fn,
          "fp8_e5m2": torch.float8_e5m2}[kv]
    if dt in (torch.float8_e4m3fn, torch.float8_e5m2):
        x = x.clamp(-torch.finfo(dt).max, torch.finfo(dt).max)
    return x.to(dt).float()


@pytest.mark.parametrize("kv", ["bfloat16", "float16", "fp8_e4m3", "fp8_e5m2", "int8", "int4"])
def test_kv_cache_dtype_scores_as_transformers_over_that_cache(request, wiki, kv):
    """--kv-cache-dtype: the windows run through the engine's paged cache of that dtype; the
    perplexity equals transformers' with its K/V quantized as that cache stores them, and the KL
    divergence against the same model through a float32 cache is the cache's own (small)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    folder, hf, lm = request.getfixturevalue("tiny_head32" if kv == "int4" else "tiny")

    def attention(module, q, k, v, mask, **kw):
        return sdpa_attention_forward(module, q, _fake_quantized(kv, k), _fake_quantized(kv, v), mask, **kw)

    AttentionInterface.register("llmopt_test_kv", attention)
    want_hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="llmopt_test_kv")
    plan = plan_ppl(lm.tokenizer, 1024, wiki, "llamacpp", limit=LIMIT)
    r = run_ppl(lm, plan, batch_size=2, base=lm, kv_cache_dtype=kv)
    assert r.kv_cache_dtype == kv
    want = llamacpp_reference(want_hf.eval(), _ids(lm.tokenizer, wiki.as_stored)[0], 512)
    assert _rel(r.ppl, want) <= REL
    assert _rel(r.kl.base_ppl, llamacpp_reference(hf, _ids(lm.tokenizer, wiki.as_stored)[0], 512)) <= REL
    # against the same runner with a float32 cache: the cache's own KL (float16's is at rounding level)
    assert -1e-6 < r.kl.kld_mean < 0.05 and r.kl.kld_max > 0 and r.kl.top1_agreement > 0.5
    with pytest.raises(UserInputError, match="unknown KV-cache dtype"):
        run_ppl(lm, plan, batch_size=2, kv_cache_dtype="int3")


def _kivi_fake(x: torch.Tensor, over_tokens: bool, g: int) -> torch.Tensor:
    """K or V [B, H, T, D] (T a multiple of g) with every group quantized as KIVI defines it: 2 bits,
    zero = the group's minimum and scale = (max - min) / 3, both fp16; keys per channel over g tokens,
    values per token over g channels (the whole head when it is narrower)."""
    b, h, t, d = x.shape
    xg = x.reshape(b, h, t // g, g, d) if over_tokens else x.reshape(b, h, t, -1, min(g, d))
    dim = 3 if over_tokens else 4
    lo, hi = xg.amin(dim, keepdim=True), xg.amax(dim, keepdim=True)
    scale, zero = ((hi - lo) / 3).half().float(), lo.half().float()
    q = torch.where(scale > 0, torch.round((xg - zero) / torch.where(scale > 0, scale, 1)), 0).clamp(0, 3)
    return (q * scale + zero).reshape(x.shape)


def test_kivi2_scores_as_transformers_decoding_with_kivi(tiny_head32, wiki):
    """--kv-cache-dtype kivi2: the perplexity is transformers' with KIVI's cache as it decodes: the query
    at position i reads the groups before its last R tokens (i - R rounded down to a group) as 2-bit
    codes, every later key and value in full precision."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import repeat_kv
    folder, hf, lm = tiny_head32
    g, res = 32, 128

    def attention(module, q, k, v, mask, scaling=None, **kw):
        t = k.shape[2]
        pad = -t % g
        kq = _kivi_fake(torch.nn.functional.pad(k, (0, 0, 0, pad)), True, g)[:, :, :t]
        vq = _kivi_fake(v, False, g)
        k, v, kq, vq = (repeat_kv(x, module.num_key_value_groups) for x in (k, v, kq, vq))
        i, j = torch.arange(t)[:, None], torch.arange(t)[None]
        quantized = j < ((i - res).clamp_min(0) // g) * g             # the groups KIVI holds quantized for query i
        s = torch.where(quantized, q @ kq.transpose(-1, -2), q @ k.transpose(-1, -2)) * scaling
        p = torch.softmax(s.masked_fill(j > i, float("-inf")), -1)
        o = (p * quantized) @ vq + (p * ~quantized) @ v
        return o.transpose(1, 2).contiguous(), None

    AttentionInterface.register("llmopt_test_kivi", attention)
    want_hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="llmopt_test_kivi")
    plan = plan_ppl(lm.tokenizer, 1024, wiki, "llamacpp", limit=LIMIT)
    r = run_ppl(lm, plan, batch_size=2, base=lm, kv_cache_dtype="kivi2")
    assert r.kv_cache_dtype == "kivi2"
    base = llamacpp_reference(hf, _ids(lm.tokenizer, wiki.as_stored)[0], 512)
    want = llamacpp_reference(want_hf.eval(), _ids(lm.tokenizer, wiki.as_stored)[0], 512)
    assert _rel(want, base) > 10 * REL                                # KIVI's error shows at this window
    assert _rel(r.ppl, want) <= REL
    assert _rel(r.kl.base_ppl, base) <= REL
    assert 1e-4 < r.kl.kld_mean < 0.5             # the cache's own cost (a random model: top-1 is a coin toss)


def test_float32_kv_cache_scores_as_no_cache(tiny, wiki):
    folder, hf, lm = tiny
    plan = plan_ppl(lm.tokenizer, 1024, wiki, "llamacpp", limit=LIMIT)
    r = run_ppl(lm, plan, batch_size=3, base=lm, kv_cache_dtype="float32")
    assert _rel(r.ppl, run_ppl(lm, plan, batch_size=2).ppl) <= 1e-6
    assert abs(r.kl.kld_mean) < 1e-6 and r.kl.top1_agreement == 1.0


# --- data -------------------------------------------------------------------------------------

def test_text_file_crlf_and_wikitext_documents(tmp_path):
    raw = WIKI.read_bytes()
    assert b"\r\n" in raw
    d = load_text_dataset(str(WIKI))
    assert "\r" not in d.text and d.text.startswith(" = Robert Boulter = \n")
    assert len(d.documents) == sum(1 for line in d.text.split("\n")
                                   if re.fullmatch(r" = [^=].* = ", line))
    assert d.documents[0].startswith(" = Robert Boulter = ") and " = = Career = = " in d.documents[0]
    assert d.documents[1].startswith(" = Du Fu = ")
    assert "\n".join(d.documents) == d.text


def test_wikitext_detokenizer():
    s = " = = Career = = \n In 2000 Boulter 's role ( as \" Scott \" ) cost 1 @,@ 000 @.@ 5 , a two @-@ part arc . \n"
    assert wikitext_detokenize(s) == " == Career ==\nIn 2000 Boulter's role (as \"Scott\") cost 1,000.5, a two-part arc.\n"


def test_jsonl_and_text_field(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"text": "first doc"}) + "\n" + json.dumps({"text": "second doc", "q": "x"}) + "\n")
    d = load_text_dataset(str(p))
    assert d.documents == ["first doc", "second doc"] and d.text == "first doc\n\nsecond doc"
    with pytest.raises(DataError) as e:  # line 1 lacks "q"
        load_text_dataset(str(p), text_field="q")
    assert f"{p}:1 has no field 'q'" in str(e.value)
    with pytest.raises(DataError) as e:
        load_text_dataset(str(p), text_field="question")
    assert "--text-field" in str(e.value)


def test_bad_datasets(tmp_path):
    with pytest.raises(DataError):
        load_text_dataset(str(tmp_path / "missing.txt"))
    with pytest.raises(DataError):
        load_text_dataset(str(tmp_path))
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(DataError) as e:
        load_text_dataset(str(tmp_path / "bin.txt"))
    assert "byte 0: 0xff" in str(e.value)
    with pytest.raises(DataError) as e:  # offline and not in the local HF cache
        load_text_dataset("no-such-org/no-such-dataset:cfg:test")
    assert "local Hugging Face cache" in str(e.value) and "\n" not in str(e.value)


def test_bad_options(tiny, wiki):
    folder, hf, lm = tiny
    with pytest.raises(UserInputError):
        plan_ppl(lm.tokenizer, 1024, wiki, "bogus")
    with pytest.raises(UserInputError):
        plan_ppl(lm.tokenizer, 1024, wiki, "sliding", max_length=64, stride=128, limit=500)
    with pytest.raises(DataError):
        plan_ppl(lm.tokenizer, 4096, wiki, "chunks", ctx=2048, limit=500)
    with pytest.raises(UserInputError, match="--ctx 2,048 is longer than the model's context of 1,024 tokens"):
        plan_ppl(lm.tokenizer, 1024, wiki, "chunks", ctx=2048, limit=500)


# --- CLI --------------------------------------------------------------------------------------

def _cli(args):
    from typer.testing import CliRunner
    from llmopt.cli.app import app
    return CliRunner().invoke(app, args)


def test_cli_json_and_output_file(tiny, tmp_path):
    folder, hf, lm = tiny
    out = tmp_path / "r.json"
    res = _cli(["eval-ppl", "--model", str(folder), "--dataset", str(WIKI), "--method", "chunks", "--ctx", "128",
                "--limit", "400", "--batch-size", "3", "--base-model", str(folder), "--json", "--quiet",
                "--output", str(out)])
    assert res.exit_code == 0, res.output
    obj = json.loads(res.stdout)
    assert obj["method"] == "chunks" and obj["scored_tokens"] == 3 * 127 and obj["ppl"] > 1
    assert obj["kl"]["top1_agreement"] == 1.0 and abs(obj["kl"]["kld_mean"]) < 1e-6
    assert json.loads(out.read_text()) == obj and obj["kv_cache_dtype"] is None
    res = _cli(["eval-ppl", "--model", str(folder), "--dataset", str(WIKI), "--method", "chunks", "--ctx", "128",
                "--limit", "400", "--kv-cache-dtype", "int8", "--quiet"])
    assert res.exit_code == 0 and re.search(r"KV cache dtype\s+.*int8", res.stdout), res.output


@pytest.mark.parametrize("args,fragment", [
    (["--model", "/no/such/model"], "not found"),
    (["--dataset", "/no/such/file.txt"], "not found"),
    (["--method", "bogus"], "unknown method"),
    (["--kv-cache-dtype", "int3"], "unknown KV-cache dtype"),
])
def test_cli_bad_input_one_line(tiny, args, fragment):
    folder, hf, lm = tiny
    base = ["eval-ppl", "--model", str(folder), "--dataset", str(WIKI), "--limit", "300", "--quiet"]
    res = _cli(base + args)
    assert res.exit_code == 2
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "error" in lines[0] and fragment in lines[0], res.stderr
