"""`llmopt bench` in place of `vllm bench serve`: its flags (--backend, --host/--port, --save-result,
--result-dir, --result-filename, --label, --metadata KEY=VALUE ..., --save-detailed, --append-result,
--disable-tqdm)
against a real server in this process (the tiny model), and the saved file's name, keys and types
as vllm/benchmarks/serve.py writes them. A request log on the server shows which endpoint was hit."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from llmopt.cli.app import app
from llmopt.cli.output import spread_values
from llmopt.engine.args import EngineArgs
from llmopt.engine.async_engine import AsyncLLMEngine
from llmopt.engine.engine import LLMEngine
from llmopt.serve.api_server import build_app
from llmopt.serve.server import ServeConfig
from serve.serve_util import ENGINE_ARGS, TINY_CHAT, inprocess_server

# vllm/benchmarks/serve.py: main_async's setup keys, then benchmark()'s result of a generation run,
# then process_one_metric's for the default --percentile-metrics ttft,tpot,itl and --metric-percentiles 99
VLLM_SETUP = {"date": str, "endpoint_type": str, "backend": str, "label": (str, type(None)), "model_id": str,
              "tokenizer_id": str, "num_prompts": int, "request_rate": (str, float), "burstiness": float,
              "max_concurrency": (int, type(None))}
VLLM_RESULT = {"duration": float, "completed": int, "failed": int, "total_input_tokens": int,
               "total_output_tokens": int, "request_throughput": float, "request_goodput": (float, type(None)),
               "output_throughput": float, "total_token_throughput": float, "latencies": list,
               "queue_times": list, "max_output_tokens_per_s": float, "max_concurrent_requests": int,
               "rtfx": float}
VLLM_STATS = {f"{s}_{m}_ms": float for m in ("ttft", "tpot", "itl") for s in ("mean", "median", "std", "p99")}
# kept only with --save-detailed (vLLM deletes them otherwise)
VLLM_DETAILED = {"input_lens": list, "output_lens": list, "start_times": list, "ttfts": list, "itls": list,
                 "generated_texts": list, "errors": list}
N, OUT = 4, 5


class RequestLog:
    """ASGI wrapper noting the method and path of every HTTP request the server gets."""

    def __init__(self, app) -> None:
        self.app, self.seen = app, []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            self.seen.append((scope["method"], scope["path"]))
        await self.app(scope, receive, send)

    def posts(self) -> list[str]:
        return [p for m, p in self.seen if m == "POST"]


@pytest.fixture(scope="module")
def model(tiny_factory):
    return tiny_factory(**TINY_CHAT)


@pytest.fixture(scope="module")
def server(model):
    engine = AsyncLLMEngine(LLMEngine(EngineArgs(model=str(model), **ENGINE_ARGS)))
    log = RequestLog(build_app(engine, ServeConfig(model_name="tiny", log_interval=0)))
    with inprocess_server(log) as url:
        yield log, int(url.rsplit(":", 1)[1])


def bench(port: int, *args: str):
    base = ["bench", "--host", "127.0.0.1", "--port", str(port), "--num-prompts", str(N), "--random-input-len", "8",
            "--random-output-len", str(OUT), "--ignore-eos", "-q"]
    return CliRunner().invoke(app, base + list(args), env={"COLUMNS": "200"})


def check_types(d: dict, spec: dict) -> None:
    for key, kind in spec.items():
        assert key in d, key
        assert isinstance(d[key], kind) and not isinstance(d[key], bool), (key, d[key])


def test_chat_backend_saves_vllms_file(server, model, tmp_path):
    log, port = server
    log.seen.clear()
    out = tmp_path / "results"   # not there yet: made, as vLLM makes it
    res = bench(port, "--backend", "openai-chat", "--save-result", "--save-detailed", "--result-dir", str(out),
                "--label", "L", "--metadata", "a=1", "b=x", "--max-concurrency", "2", "--json")
    assert res.exit_code == 0, res.output
    files = list(out.iterdir())
    assert len(files) == 1, files
    m = re.fullmatch(r"L-infqps-concurrency2-tiny-(\d{8}-\d{6})\.json", files[0].name)
    assert m, files[0].name
    text = files[0].read_text()
    assert "\n" not in text.strip()                  # one line, as vLLM's json.dump
    d = json.loads(text)
    assert d["date"] == m.group(1)
    check_types(d, {**VLLM_SETUP, **VLLM_RESULT, **VLLM_STATS, **VLLM_DETAILED})
    assert d["backend"] == d["endpoint_type"] == "openai-chat" and d["label"] == "L"
    assert d["a"] == "1" and d["b"] == "x"
    assert list(d).index("num_prompts") < list(d).index("a") < list(d).index("request_rate")   # where vLLM puts them
    assert d["model_id"] == "tiny" and d["tokenizer_id"] == str(model) and d["base_url"] == f"http://127.0.0.1:{port}"
    assert d["request_rate"] == "inf" and d["burstiness"] == 1.0 and d["max_concurrency"] == 2
    assert d["completed"] == d["num_prompts"] == N and d["failed"] == 0
    assert d["output_lens"] == [OUT] * N and d["total_output_tokens"] == sum(d["output_lens"])   # --ignore-eos
    assert d["total_input_tokens"] == sum(d["input_lens"]) and d["errors"] == [""] * N
    assert all(isinstance(t, str) and t for t in d["generated_texts"])
    assert all(len(x) == len(d["input_lens"]) for x in (d["ttfts"], d["itls"], d["latencies"], d["queue_times"]))
    assert 1 <= d["max_concurrent_requests"] <= 2
    assert json.loads(res.stdout) == d               # --json carries the same object
    # the chat endpoint was hit, once per prompt (the completions endpoint never)
    assert log.posts() == ["/v1/chat/completions"] * N


def test_completions_backend_default_name_and_append(server, tmp_path):
    log, port = server
    log.seen.clear()
    res = bench(port, "--backend", "openai", "--save-result", "--result-dir", str(tmp_path))
    assert res.exit_code == 0, res.output
    (f,) = tmp_path.iterdir()
    assert re.fullmatch(r"openai-infqps-tiny-\d{8}-\d{6}\.json", f.name), f.name   # label: --backend's
    d = json.loads(f.read_text())
    check_types(d, {**VLLM_SETUP, **VLLM_RESULT, **VLLM_STATS})
    assert not set(VLLM_DETAILED) & set(d)            # without --save-detailed, as vLLM
    assert d["label"] is None and d["backend"] == "openai" and d["completed"] == N
    assert log.posts() == ["/v1/completions"] * N
    # --append-result: a line per run in --result-filename
    for rate in ("20", "30"):
        res = bench(port, "--save-result", "--append-result", "--result-dir", str(tmp_path), "--result-filename",
                    "all.json", "--request-rate", rate, "--disable-tqdm")
        assert res.exit_code == 0, res.output
    lines = (tmp_path / "all.json").read_text().splitlines()
    assert [json.loads(x)["request_rate"] for x in lines] == [20.0, 30.0]


@pytest.mark.parametrize("args, fragment", [
    (["--metadata", "bad"], "KEY=VALUE"),
    (["--metadata", "a=1", "bad"], "KEY=VALUE"),
    (["--backend", "nope"], "openai, openai-chat"),
    (["--backend", "openai-chat", "--endpoint", "/v1/completions"], "--backend openai-chat"),
    (["--save-result", "--sweep"], "--sweep"),
])
def test_bad_flags_are_one_line_exit_2(server, tmp_path, args, fragment):
    log, port = server
    log.seen.clear()
    res = bench(port, *args, "--save-result", "--result-dir", str(tmp_path / "out"))
    assert res.exit_code == 2, res.output
    assert fragment in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not (tmp_path / "out").exists() and log.posts() == []   # refused before any request or folder


def test_multi_value_flags_spread_as_argparse_nargs():
    nargs = {"--metadata": "*", "--goodput": "+"}
    assert spread_values(["--metadata", "a=1", "b=2", "-q"], nargs) == ["--metadata", "a=1", "--metadata", "b=2", "-q"]
    assert spread_values(["--metadata", "--json"], nargs) == ["--json"]                  # '*': may be empty
    assert spread_values(["--goodput", "--json"], nargs) == ["--goodput", "--json"]      # '+': click refuses
    assert spread_values(["--goodput", "ttft:5", "tpot:1"], nargs) == ["--goodput", "ttft:5", "--goodput", "tpot:1"]
    assert spread_values(["--", "--metadata", "a", "b"], nargs) == ["--", "--metadata", "a", "b"]
