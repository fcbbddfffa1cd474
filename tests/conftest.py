"""Test-wide settings and the one tiny-model builder.

Nothing is fetched from a hub; the shared data folder is found relative to the repo. Every test
that needs a small random checkpoint builds it with `make_tiny` (or the `tiny_factory` /
`tiny_llama` fixtures), transformers' own model classes writing the Hugging Face folder, so the
checkpoint is an independent reference for our loader and model."""

import os
import signal
from pathlib import Path

# A suite started in the background by a non-interactive shell (`make test &`, nohup) inherits
# SIGINT ignored, and so would every process the signal tests start (an ignored signal stays
# ignored across exec): give SIGINT its default meaning, as in a terminal or CI.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# Without a GPU, Triton kernels run in its interpreter. The variable must be set before triton is
# first imported (some peer packages import it while tests are collected), so it is set here.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO / ".." / "shared" / "data"

# The common tiny shape: GQA 4/2, head_dim 16, two layers. Override any key per test.
TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5,
            initializer_range=0.2, tie_word_embeddings=False)

_CONFIGS = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}


def make_tiny(path: Path, model_type: str = "llama", seed: int = 0, tokenizer: bool = False,
              weight_std: float | None = None, dtype=None, **overrides) -> Path:
    """Save a random transformers model of `model_type` (llama, mistral, qwen2, qwen3) to `path`.

    tokenizer=True copies the default model's (SmolLM2) tokenizer files into the folder and sizes
    the vocabulary and BOS/EOS ids to it. weight_std redraws every parameter from N(0, std) (big
    enough weights that quantization matters, like a trained model's). Returns `path`."""
    import torch
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    kw = {**TINY, **overrides}
    tok = None
    if tokenizer:
        from transformers import AutoTokenizer
        from llmopt.models.loader import resolve_checkpoint
        tok = AutoTokenizer.from_pretrained(str(resolve_checkpoint(None)))
        kw.setdefault("bos_token_id", tok.bos_token_id)
        kw.setdefault("eos_token_id", tok.eos_token_id)
        if "vocab_size" not in overrides:
            kw["vocab_size"] = len(tok)
    cfg = getattr(transformers, _CONFIGS[model_type])(**kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    if weight_std is not None:
        for p in model.parameters():
            p.data.normal_(0, weight_std)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(path)
    if tok is not None:
        tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_factory(tmp_path_factory):
    """make_tiny(...) memoized per arguments for the whole session: `tiny_factory(seed=1, ...)`."""
    cache: dict = {}

    def build(**kw) -> Path:
        key = repr(sorted(kw.items()))
        if key not in cache:
            cache[key] = make_tiny(tmp_path_factory.mktemp("tiny"), **kw)
        return cache[key]

    return build


@pytest.fixture(scope="session")
def tiny_llama(tiny_factory) -> Path:
    """The default tiny Llama folder (no tokenizer)."""
    return tiny_factory()


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        raise FileNotFoundError(f"{SHARED_DATA} is missing: tests read ../shared/data beside the checkout")
    return SHARED_DATA


@pytest.fixture(scope="session")
def lm_eval_tasks(tmp_path_factory, shared_data) -> Path:
    """A folder of local lm-eval task files: llmopt_rolling (rolling perplexity on 4 WikiText-2
    paragraphs), llmopt_mc (6 multiple-choice questions of 4 choices) and llmopt_gen (generate_until
    with a stop string, 12 tokens at most)."""
    import json
    import random
    import textwrap
    folder = tmp_path_factory.mktemp("lm-eval-tasks")
    text = (shared_data / "wikitext-2-raw" / "wiki.test.raw").read_text(encoding="utf-8")
    passages = [line.strip() for line in text.splitlines() if len(line.strip()) > 400][:4]   # paragraphs
    rng = random.Random(0)
    words = "river hill city bridge music sound light water stone field cloud paper".split()
    rows = {"rolling": [{"text": p[:1200]} for p in passages],
            "mc": [{"question": " ".join(rng.sample(words, 5)),
                    "choices": [" ".join(rng.sample(words, rng.randint(1, 3))) for _ in range(4)],
                    "answer": rng.randrange(4)} for _ in range(6)],
            "gen": [{"prompt": p[:160], "answer": "x"} for p in passages]}
    for name, docs in rows.items():
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    specs = {
        "rolling": """output_type: loglikelihood_rolling
            doc_to_text: ""
            doc_to_target: "{{text}}"
            metric_list: [{metric: word_perplexity}, {metric: byte_perplexity}, {metric: bits_per_byte}]""",
        "mc": """output_type: multiple_choice
            doc_to_text: "Question: {{question}}\\nAnswer:"
            doc_to_choice: "{{choices}}"
            doc_to_target: "{{answer}}"
            metric_list: [{metric: acc}, {metric: acc_norm}]""",
        "gen": """output_type: generate_until
            doc_to_text: "{{prompt}}"
            doc_to_target: "{{answer}}"
            generation_kwargs: {until: ["."], max_gen_toks: 12, do_sample: false}
            metric_list: [{metric: exact_match}]"""}
    for name, spec in specs.items():
        head = (f"task: llmopt_{name}\ndataset_path: json\n"
                f"dataset_kwargs: {{data_files: {{test: {folder / (name + '.jsonl')}}}}}\ntest_split: test\n")
        (folder / f"llmopt_{name}.yaml").write_text(head + textwrap.dedent("            " + spec) + "\n")
    return folder


@pytest.fixture
def idot_path(request):
    """Sets the integer tiles' path named by the test's parameter (idot_util.IDOT_PATHS)."""
    import torch
    from idot_util import IDOT_PATHS
    from llmopt import defaults
    isa, panel = IDOT_PATHS[request.param]
    torch.ops.llmopt_cpu.tiles_config(isa, panel)
    yield request.param
    torch.ops.llmopt_cpu.tiles_config(-1, defaults.CPU_IDOT_PANEL_MIN_ROWS)


@pytest.fixture
def float32_products():
    """bfloat16 weights' panels multiply in float32 (no AMX / AVX-512 BF16 rounding of x) for the test."""
    import torch
    from llmopt import defaults
    from llmopt.kernels import cpu_quant
    cpu_quant.ops()
    torch.ops.llmopt_cpu.tiles_config(-1, 0, 0, -1, 0)
    yield
    torch.ops.llmopt_cpu.tiles_config(-1, 0, 0, -1, int(defaults.CPU_BF16_DOT_PRODUCTS))


@pytest.fixture(scope="session")
def smollm2_float(tmp_path_factory) -> Path:
    """The default model's GGUF dequantized to a float32 safetensors folder (the engine runs the file
    as stored): the transformers and lm-eval `hf` reference of the tests on the real model."""
    from llmopt import defaults
    from llmopt.models.config import builtin_gguf
    from llmopt.models.gguf_convert import convert_gguf
    return convert_gguf(builtin_gguf(defaults.DEFAULT_MODEL), tmp_path_factory.mktemp("smollm2") / "float",
                        weights=True)
