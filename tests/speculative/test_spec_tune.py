"""`llmopt spec-tune` on a tiny random Llama with SmolLM2's tokenizer: trains an EAGLE head on the
target's own answers, stops at a step budget with a checkpoint, `--resume` continues it (the step
count and the loss curve continue exactly where an uninterrupted run goes), saves a head the engine
loads through --speculative-config (greedy outputs unchanged, drafts made), and writes a
spec_config.json that SpeculativeConfig accepts; the training loss falls on a learnable target
(the tiny target's own features), EAGLE-1 and EAGLE-3 with training-time test."""

import json

import pytest
import torch
from typer.testing import CliRunner

from llmopt.cli.app import app
from llmopt.engine.args import EngineArgs
from llmopt.engine.engine import LLMEngine
from llmopt.core.sampling_params import SamplingParams
from llmopt.models.loader import load_model
from llmopt.speculative.config import SpeculativeConfig, parse_speculative_config
from llmopt.spec_tune.train import TrainSettings, train_head
from llmopt.spec_tune.train_data import capture, make_prompts, passages

ARGS = ["--method", "eagle", "--num-prompts", "8", "--eval-prompts", "2", "--prompt-tokens", "16",
        "--max-new-tokens", "12", "--text-sequences", "3", "--epochs", "2", "--train-batch-size", "2", "--checkpoint-every", "2",
        "--batch-sizes", "1,2", "--max-k", "2", "--eval-k", "2", "--tune-max-tokens", "4", "--quiet", "--json"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: on a busy 2-core machine two threads contend (training runs 10x slower)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny(tiny_factory):
    return tiny_factory(tokenizer=True)


def _run(tiny, out, *extra):
    res = CliRunner().invoke(app, ["spec-tune", "-m", str(tiny), "-o", str(out), *ARGS, *extra])
    return res.exit_code, json.loads(res.stdout.strip().splitlines()[-1])


def test_train_stop_resume_reload_and_config(tiny, tmp_path):
    code, first = _run(tiny, tmp_path / "a", "--max-steps", "3")
    assert code == 0 and first["finished"] is False and first["spec_config_path"] is None
    assert first["train"]["steps"] == 3 and first["train"]["total_steps"] == 12      # 8 answers + 3 text sequences, 2 a step
    assert first["data"]["text_sequences"] == 3 and first["data"]["sequences"] == 8
    assert (tmp_path / "a" / "checkpoint.pt").is_file() and not (tmp_path / "a" / "spec_config.json").exists()
    code, again = _run(tiny, tmp_path / "a")                      # without --resume: refused, nothing lost
    assert code == 2 and "--resume" in again["error"]["message"]
    code, done = _run(tiny, tmp_path / "a", "--resume")
    assert code == 0 and done["finished"] is True
    t = done["train"]
    assert t["resumed_from_step"] == 3 and t["steps"] == 12 and done["data"]["reused_parts"] == 2
    assert t["step_losses"][:3] == first["train"]["step_losses"]
    # the same training never stopped (on the data parts the run wrote) takes the same steps
    loaded = load_model(str(tiny), "float32", "cpu", tokenizer=False)
    rows = [r for f in ("part-00000.pt", "text-00000.pt") for r in torch.load(tmp_path / "a" / "data" / f,
                                                                                weights_only=True)]
    assert [r["prompt_len"] for r in rows[8:]] == [0, 0, 0] and all(r["prompt_len"] > 0 for r in rows[:8])
    _, whole = train_head(loaded, rows, tmp_path, TrainSettings("eagle", epochs=2, batch_size=2), resume=False)
    torch.testing.assert_close(torch.tensor(t["step_losses"]), torch.tensor(whole.step_losses))

    # spec_config.json: vLLM's keys + the per-batch-size K map, valid for SpeculativeConfig
    raw = json.loads((tmp_path / "a" / "spec_config.json").read_text())
    assert raw["method"] == "eagle" and raw["model"] == "head"
    assert set(raw["num_speculative_tokens_by_batch_size"]) == {"1", "2"}
    cfg = parse_speculative_config(str(tmp_path / "a"))
    assert isinstance(cfg, SpeculativeConfig) and cfg.model == str(tmp_path / "a" / "head")
    assert cfg.num_speculative_tokens_by_batch_size == {int(b): k for b, k in done["choice"].items()}
    assert len(done["tune"]) == 2 * 3 and done["acceptance"]["acceptance_length"] >= 1.0

    # the head reloads through the engine: drafts are made and greedy outputs stay the target's
    spec = {"method": "eagle", "model": cfg.model, "num_speculative_tokens": 2}
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5], [7, 7, 7, 7, 7, 7, 9]]

    def run(spec):
        loaded.model.capture_hidden = None
        eng = LLMEngine(EngineArgs(model=str(tiny), detokenize=False, kv_cache_memory=1 << 22, block_size=4,
                                   speculative_config=spec), loaded=loaded)
        ids = [eng.add_request(None, p, params) for p in prompts]
        done = {}
        while eng.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})
        return [done[i] for i in ids], eng.stats().spec_decoding

    plain, _ = run(None)
    spec_out, st = run(spec)
    assert spec_out == plain and st.num_drafts > 0


@pytest.mark.parametrize("method,layers,soft", [("eagle", 2, False), ("eagle3", 4, False), ("eagle3", 4, True)])
def test_loss_falls_on_the_targets_own_features(tiny_factory, tmp_path, method, layers, soft):
    path = tiny_factory(tokenizer=True) if layers == 2 else tiny_factory(tokenizer=True, num_hidden_layers=layers)
    loaded = load_model(str(path), "float32", "cpu")
    from llmopt.data import read_dataset
    text = read_dataset("../shared/data/wikitext-2/wiki.valid.tokens", "text", "train").text
    prompts = make_prompts(loaded.tokenizer, passages(text, loaded.tokenizer, 4, 24, 0), chat=False)
    from llmopt.engine.llm import LLM
    outs = LLM(loaded=loaded, model=str(path), detokenize=False, kv_cache_memory=1 << 22).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
    from llmopt.spec_tune.train_data import feature_layers
    rows = capture(loaded, seqs, feature_layers(method, layers), keep_final=soft)
    for r, p in zip(rows, prompts):
        r["prompt_len"] = len(p)
    settings = TrainSettings(method, epochs=30, lr=5e-3, batch_size=4, warmup_steps=1, draft_vocab_size=256,
                             checkpoint_every=1000, soft_labels=soft)
    _, s = train_head(loaded, rows, tmp_path, settings, resume=False)
    assert s.finished and len(s.epoch_losses) == 30 and s.soft_labels == soft
    assert s.epoch_losses[-1] < 0.7 * s.epoch_losses[0], s.epoch_losses
    if method == "eagle3":      # every training-time-test step learns, not only the first
        first, last = s.step_parts[0], s.step_parts[-1]
        assert len(first) == settings.ttt_steps and all(b < a for a, b in zip(first, last))


def test_soft_labels_are_the_targets_distribution_and_sharpen_to_hard_labels(tiny_factory):
    """capture(keep_final=True) keeps the final hidden states whose logits are Hugging Face
    transformers' for the same sequence; EAGLE-3's soft loss is the cross-entropy against the target's
    distribution on the draft vocabulary (a float64 computation from transformers' logits), and with
    that distribution sharpened to one-hot it equals the hard-label loss."""
    from transformers import AutoModelForCausalLM
    from llmopt.spec_tune.train import init_head
    from llmopt.spec_tune.train_data import feature_layers
    from llmopt.spec_tune.train_loss import collate, eagle3_loss
    path = tiny_factory(tokenizer=True, num_hidden_layers=4)
    loaded = load_model(str(path), "float32", "cpu")
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, loaded.config.vocab_size, (n,), generator=g).tolist() for n in (14, 9)]
    rows = capture(loaded, seqs, feature_layers("eagle3", 4), keep_final=True)
    hf = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32).eval()
    ref = []
    for r, s in zip(rows, seqs):
        r["prompt_len"] = 3
        with torch.no_grad():
            ref.append(hf(torch.tensor([s])).logits[0].double())
        mine = r["final"].double() @ loaded.model.lm_head.weight.double().T
        torch.testing.assert_close(mine, ref[-1], atol=2e-2, rtol=0)     # final kept in float16
        assert r["final"].shape == (len(s), loaded.config.hidden_size) and r["final"].dtype == torch.float16
    head = init_head(loaded, "eagle3", rows, TrainSettings("eagle3", draft_vocab_size=64))
    batch = collate(rows, 1, "cpu")
    with torch.no_grad():
        soft, _, n_soft = eagle3_loss(head, loaded.model, batch, 1, 0.8, prompts=True, soft=True)
        hard, _, n_hard = eagle3_loss(head, loaded.model, batch, 1, 0.8, prompts=True)
    # the reference: transformers' logits at the labelled positions (p = i + 1), restricted to the
    # draft vocabulary, against the head's log-probabilities there
    from llmopt.spec_tune.train_loss import TTTAttention
    n = batch["feats"].shape[1] - 1
    with torch.no_grad():
        out = head(loaded.model.embed(batch["tokens"][:, 1:1 + n]), batch["feats"][:, :n],
                   torch.arange(n)[None].expand(2, n), TTTAttention(), fuse=True)
        logq = torch.log_softmax(head.lm_head(head.norm(out)).double(), -1)
    vocab, total, count = head.t2d, 0.0, 0
    for b, r in enumerate(rows):
        for i in range(len(seqs[b]) - 2):
            if vocab[r["argmax"][i + 1]]:
                p = torch.softmax(ref[b][i + 1][vocab], -1)
                total, count = total - float((p * logq[b, i]).sum()), count + 1
    assert n_soft == n_hard == count > 0
    assert float(soft) == pytest.approx(total / count, abs=2e-3)
    batch["final"] = batch["final"] * 1e4          # the target's distribution made one-hot on its choice
    with torch.no_grad():
        sharp, _, _ = eagle3_loss(head, loaded.model, batch, 1, 0.8, prompts=True, soft=True)
    assert float(sharp) == pytest.approx(float(hard), rel=1e-4) and float(soft) != pytest.approx(float(hard), rel=1e-2)


def test_text_sequences_leave_out_the_held_out_prompts_paragraphs(tiny):
    """Text sequences are whole paragraphs, cut at the length asked, and never the paragraphs the
    held-out prompts were made from (their passages do not occur in them)."""
    from transformers import AutoTokenizer
    from llmopt.data import read_dataset
    from llmopt.spec_tune.train_data import paragraphs, pick_passages, text_sequences
    tok = AutoTokenizer.from_pretrained(str(tiny))
    text = read_dataset("../shared/data/wikitext-2/wiki.valid.tokens", "text", "train").text
    picked = pick_passages(text, tok, 40, 24, 0)
    assert [p for _, p in picked] == passages(text, tok, 40, 24, 0)
    held = {i for i, _ in picked[30:]}
    seqs = text_sequences(text, tok, 50, 64, 24, held, 0)
    assert len(seqs) == 50 and all(len(s) == 64 for s in seqs)
    joined = tok.decode(sum(seqs, []))
    paras = paragraphs(text, 4 * 24)
    assert not any(paras[i][:60] in joined for i in held)
    kept = [i for i in range(len(paras)) if i not in held]
    assert sum(paras[i][:60] in joined for i in kept) > 10      # the others are read


def test_prompt_loss_counts_every_position_with_a_next_token():
    from llmopt.spec_tune.train_loss import _valid
    batch = {"lens": torch.tensor([6, 4]), "plens": torch.tensor([3, 0])}
    # query i at step j labels position p = i + 1 + j: answers from prompt_len - 1, all with prompts,
    # and never the last position (it has no next token)
    T, F = True, False
    assert _valid(batch, 5, 0).tolist() == [[F, T, T, T, F], [T, T, F, F, F]]
    assert _valid(batch, 5, 0, prompts=True).tolist() == [[T, T, T, T, F], [T, T, F, F, F]]
    assert _valid(batch, 5, 1, prompts=True).tolist() == [[T, T, T, F, F], [T, F, F, F, F]]


class _ScriptedLLM:
    """LLM.generate's shape, each request's output taken from a script by its seed."""

    def __init__(self, tok, script):
        self.tok, self.script, self.calls = tok, script, []

    def generate(self, prompts, params):
        from types import SimpleNamespace
        self.calls.append((prompts, [p.seed for p in params]))
        outs = []
        for p in params:
            text, reason = self.script(p.seed)
            ids = self.tok(text, add_special_tokens=False).input_ids
            outs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, finish_reason=reason)]))
        return outs


def test_self_prompts_keep_finished_unique_requests_in_the_chat_template(tiny):
    """Magpie: the model is given the template up to a user's message; requests that ended by
    themselves, long enough and not seen before, become chat prompts (the template's own
    rendering); a model that writes too few is an error, not a short list."""
    from transformers import AutoTokenizer
    from llmopt.errors import DataError
    from llmopt.spec_tune.self_instruct import self_prompts, user_turn_prefix
    tok = AutoTokenizer.from_pretrained(str(tiny))
    prefix = user_turn_prefix(tok)
    full = tok.apply_chat_template([{"role": "user", "content": "Write a haiku."}], tokenize=False,
                                   add_generation_prompt=True)
    assert tok.decode(prefix) + "Write a haiku." == full[:full.index("Write a haiku.") + len("Write a haiku.")]

    def script(seed):
        i = seed - 7 * 1_000_003
        return [("Explain how tides work in simple words.", "stop"), ("Cut off in the middle of a", "length"),
                ("Hi", "stop"), ("Explain how tides work in simple words.", "stop"),
                ("Write a Python function that sorts a list of names.", "stop")][i % 5]

    llm = _ScriptedLLM(tok, script)
    kept = []
    got = self_prompts(llm, tok, 2, seed=7, batch=3, kept=kept.append)
    want = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
            for t in ("Explain how tides work in simple words.", "Write a Python function that sorts a list of names.")]
    assert [tok.decode(p) for p in got] == want
    assert [seeds for _, seeds in llm.calls] == [[7 * 1_000_003 + i for i in range(3)],
                                                 [7 * 1_000_003 + i for i in range(3, 6)]]
    assert all(p == [prefix] * len(p) for p, _ in llm.calls) and kept == [1, 1]
    with pytest.raises(DataError, match="only 0 usable requests"):
        self_prompts(_ScriptedLLM(tok, lambda s: ("never ends", "length")), tok, 3, seed=0, batch=8)


def test_prompt_source_self_saves_its_prompts_and_init_head_starts_from_a_head(tiny, tmp_path, monkeypatch):
    """--prompt-source self: the requests are written once to data/self_prompts.json, and --resume
    reads them instead of sampling again; --init-head: training starts from that head's weights
    (its first loss is the trained head's level, far below a fresh head's)."""
    import llmopt.spec_tune.self_instruct as si
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(tiny))
    asks = ["Name three rivers in Europe.", "How do I boil an egg?", "Write a short poem about rain.",
            "What is 12 times 7?", "Summarize the plot of Hamlet.", "Give me a tip for learning piano.",
            "Translate 'good morning' into French.", "Why is the sky blue?", "List two prime numbers.",
            "Describe a cat.", "Suggest a name for a dog.", "What is a verb?"]
    calls = []

    def chat(a):
        return tok(tok.apply_chat_template([{"role": "user", "content": a}], tokenize=False,
                                           add_generation_prompt=True), add_special_tokens=False).input_ids

    def fake(llm, tokenizer, n, seed, batch, kept=lambda k: None):
        calls.append(n)
        return [chat(a) for a in asks[:n]]

    monkeypatch.setattr(si, "self_prompts", fake)
    code, fresh = _run(tiny, tmp_path / "a", "--prompt-source", "self", "--max-steps", "2")
    assert code == 0 and calls == [12] and fresh["data"]["sequences"] == 8
    saved = json.loads((tmp_path / "a" / "data" / "self_prompts.json").read_text())
    assert saved["prompts"] == [chat(a) for a in asks]
    code, done = _run(tiny, tmp_path / "a", "--prompt-source", "self", "--resume")
    assert code == 0 and done["finished"] and calls == [12] and done["data"]["reused_parts"] == 2
    kept = (tmp_path / "a" / "data" / "self_prompts.json").read_bytes()
    code, other = _run(tiny, tmp_path / "a", "--prompt-source", "self", "--resume", "--num-prompts", "6")
    assert code == 2 and "self-written prompts" in other["error"]["message"] and calls == [12]
    assert (tmp_path / "a" / "data" / "self_prompts.json").read_bytes() == kept

    # a second run that starts from the trained head: its first loss is about the head's last
    code, again = _run(tiny, tmp_path / "b", "--prompt-source", "self", "--init-head", str(tmp_path / "a" / "head"),
                       "--max-steps", "2")
    assert code == 0
    first_fresh, last = fresh["train"]["step_losses"][0], done["train"]["step_losses"][-1]
    assert again["train"]["step_losses"][0] < first_fresh - 0.5 * (first_fresh - last), \
        (first_fresh, last, again["train"]["step_losses"][0])
    code, bad = _run(tiny, tmp_path / "c", "--init-head", str(tmp_path / "nowhere"))
    assert code == 2 and "--init-head" in bad["error"]["message"] and not (tmp_path / "c" / "data").exists()


def test_soft_labels_keep_final_states_in_the_data_and_resume_needs_the_same_labels(tiny_factory, tmp_path):
    """--soft-labels (EAGLE-3): the data parts hold the target's final hidden states and the summary
    says soft; a --resume with hard labels is refused (its data lacks nothing, but the data settings
    differ), and --soft-labels with EAGLE-1 exits 2 before any work."""
    path = tiny_factory(tokenizer=True, num_hidden_layers=4)
    eagle3 = [a if a != "eagle" else "eagle3" for a in ARGS]

    def run(out, *extra):
        res = CliRunner().invoke(app, ["spec-tune", "-m", str(path), "-o", str(out), *eagle3, *extra])
        return res.exit_code, json.loads(res.stdout.strip().splitlines()[-1])

    code, first = run(tmp_path / "a", "--soft-labels", "--max-steps", "2")
    assert code == 0 and first["train"]["soft_labels"] is True and first["train"]["steps"] == 2
    for part in ("part-00000.pt", "text-00000.pt"):
        for r in torch.load(tmp_path / "a" / "data" / part, weights_only=True):
            assert r["final"].shape == (len(r["tokens"]), 64) and r["final"].dtype == torch.float16
    code, hard = run(tmp_path / "a", "--resume")
    assert code == 2 and "final_hidden" in hard["error"]["message"]
    code, done = run(tmp_path / "a", "--resume", "--soft-labels")
    assert code == 0 and done["finished"] and done["train"]["resumed_from_step"] == 2
    code, bad = _run(tiny_factory(tokenizer=True), tmp_path / "b", "--soft-labels")
    assert code == 2 and "--soft-labels" in bad["error"]["message"] and not (tmp_path / "b").exists()
