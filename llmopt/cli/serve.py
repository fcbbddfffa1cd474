"""`llmopt serve`: the OpenAI-compatible server (llmopt/serve) on one model, with vLLM's flag names.

`--config FILE.yaml` holds flags as keys (`max-model-len: 2048`, dashes or underscores, without the
leading `--`); flags given on the command line (or by environment variable) win, and an unknown key
is refused, as vLLM's --config."""

from __future__ import annotations

import difflib
import logging
import signal
import sys
from pathlib import Path
from typing import Any

import typer

from llmopt import defaults
from llmopt.cli import common
from llmopt.cli.ranges import in_range
from llmopt.errors import UserInputError
from llmopt.units import SIZE_HELP, parse_bytes

# Shown under Examples in --help (app.py registers the command); one short line each.
EXAMPLES = [
    "llmopt serve --port 8000",
    "llmopt serve out/smollm2-awq --served-model-name smol --api-key KEY",
    "llmopt serve --config serve.yaml --shutdown-timeout 30",
]

MAX_REQUEST_BYTES = f"{defaults.SERVE_MAX_REQUEST_BYTES >> 20}MiB"   # the default of --max-request-bytes, as text


@common.engine_options(before="max_num_queued_reqs")
def serve(
    ctx: typer.Context,
    model_tag: str = typer.Argument(None, metavar="MODEL", show_default=False,
                                    help="The model, as `vllm serve MODEL` (or --model)."),
    model: str = common.ModelOpt,
    config: Path = typer.Option(None, "--config", help="YAML file of flags (keys: flag names); flags on the command "
                                "line win, unknown keys are refused."),
    host: str = typer.Option(defaults.SERVE_HOST, "--host", help="Address to bind (0.0.0.0: every interface)."),
    port: int = typer.Option(defaults.SERVE_PORT, "--port", callback=in_range(1, 65535), help="TCP port, 1 to 65535."),
    api_key: list[str] = typer.Option(None, "--api-key", envvar="LLMOPT_API_KEY", metavar="KEY",
                                      help="Require `Authorization: Bearer KEY` on /v1/* (or LLMOPT_API_KEY); "
                                      "repeat it to accept any of several keys."),
    allowed_origins: list[str] = typer.Option(["*"], "--allowed-origins", metavar="ORIGIN",
                                              help="CORS: origins a browser may call from (repeatable; vLLM's "
                                              "default *)."),
    allowed_methods: list[str] = typer.Option(["*"], "--allowed-methods", metavar="METHOD",
                                              help="CORS: HTTP methods a browser may use (repeatable; vLLM's "
                                              "default *)."),
    allowed_headers: list[str] = typer.Option(["*"], "--allowed-headers", metavar="HEADER",
                                              help="CORS: request headers a browser may send (repeatable; vLLM's "
                                              "default *)."),
    allow_credentials: bool = typer.Option(False, "--allow-credentials",
                                           help="CORS: let browsers send cookies and credentials (vLLM's default: "
                                           "no)."),
    enable_request_id_headers: bool = typer.Option(False, "--enable-request-id-headers",
                                                   help="Answer each request with an X-Request-Id header (the "
                                                   "client's, else a new one), as vLLM."),
    chat_template: Path = typer.Option(None, "--chat-template", help="A Jinja chat template file used instead of "
                                       "the tokenizer's (e.g. one that renders tools)."),
    enable_auto_tool_choice: bool = typer.Option(False, "--enable-auto-tool-choice",
                                                 help="Allow tool_choice auto: --tool-call-parser reads the calls "
                                                 "from the model's text."),
    tool_call_parser: str = typer.Option(None, "--tool-call-parser", help="How tool calls are written in the "
                                         "model's output, for tool_choice auto: hermes."),
    generation_config: str = typer.Option("auto", "--generation-config",
                                          help="Sampling defaults for fields a request leaves out: auto (the model's "
                                          "generation_config.json), vllm (none) or a folder holding one."),
    served_model_name: str = typer.Option(None, "--served-model-name",
                                          help="The model name clients send (default: --model)."),
    max_num_queued_reqs: int = typer.Option(None, "--max-num-queued-reqs", callback=in_range(1),
                                            help="Answer 503 above this many queued sequences (default: no cap)."),
    max_request_bytes: str = typer.Option(MAX_REQUEST_BYTES, "--max-request-bytes",
                                          help=f"Largest request body; a larger one gets 413. {SIZE_HELP}."),
    scheduling_policy: str = typer.Option(defaults.SCHEDULING_POLICY, "--scheduling-policy",
                                          help="fcfs|priority (a request's priority: lower runs first)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the engine's sampler."),
    shutdown_timeout: float = typer.Option(defaults.SERVE_SHUTDOWN_TIMEOUT, "--shutdown-timeout", callback=in_range(0),
                                           help="On SIGTERM, let requests in flight finish for up to this many "
                                           "seconds (0: abort them at once, as vLLM), then exit 0."),
    log_interval: float = typer.Option(defaults.SERVE_LOG_INTERVAL, "--log-interval", callback=in_range(0),
                                       help="Seconds between stats lines in the log (0: none)."),
    disable_log_requests: bool = typer.Option(False, "--disable-log-requests",
                                              help="No log line per finished request."),
    log_level: str = typer.Option("info", "--uvicorn-log-level",
                                  help="uvicorn's log level: critical|error|warning|info|debug|trace."),
    **engine: Any,
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API (completions, chat, models, metrics)."""
    if model_tag is not None and model is not None and model_tag != model:
        raise UserInputError(f"the model is given twice ({model_tag!r} and --model {model!r}): give it once")
    model = model_tag if model_tag is not None else model
    opts = {k: v for k, v in locals().items() if k not in ("ctx", "engine", "model_tag")} | engine
    if config is not None:
        opts.update(config_values(ctx, config))
    run(**opts)


def run(*, model, config, host, port, api_key, allowed_origins, allowed_methods, allowed_headers, allow_credentials,
        enable_request_id_headers, generation_config, chat_template, enable_auto_tool_choice, tool_call_parser,
        served_model_name, max_num_queued_reqs, max_request_bytes, scheduling_policy, seed, shutdown_timeout,
        log_interval, disable_log_requests, log_level, **engine) -> None:
    engine_args = common.engine_args_from_flags(engine, model=model, seed=seed, scheduling_policy=scheduling_policy)
    body_bytes = parse_bytes(max_request_bytes, "--max-request-bytes")
    if body_bytes < 1:
        raise UserInputError(f"--max-request-bytes {max_request_bytes}: give at least 1 byte")
    template = _chat_template(chat_template)
    tool_call_parser = _tool_call_parser(enable_auto_tool_choice, tool_call_parser)
    levels = ("critical", "error", "warning", "info", "debug", "trace")
    if log_level not in levels:
        raise UserInputError(f"--uvicorn-log-level {log_level!r}: use one of {'|'.join(levels)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%m-%d %H:%M:%S", stream=sys.stderr)

    # the engine and server imports are here, not at the top: every command's start-up (and --help) stays fast
    from llmopt.engine.args import EngineArgs
    args = EngineArgs(**engine_args)
    if args.tensor_parallel_size > 1:
        from llmopt.distributed.worker import run_torchrun_worker
        if run_torchrun_worker(args):   # under torchrun, a rank other than 0: rank 0 serves
            return

    from llmopt.serve.run import bind, run_server
    sock = bind(host, port)   # a busy port fails now, not after the model has loaded

    from llmopt.engine.async_engine import AsyncLLMEngine
    from llmopt.serve.api_server import build_app
    from llmopt.serve.server import ServeConfig

    from llmopt.models.generation_config import resolve_generation_defaults
    async_engine = AsyncLLMEngine.from_engine_args(args)
    gen = resolve_generation_defaults(generation_config, async_engine.engine.loaded.path)
    log = logging.getLogger("llmopt.serve")
    if gen:
        log.info("Default sampling parameters have been overridden by the model's generation config: %s", gen)
    name = served_model_name or model or defaults.DEFAULT_MODEL
    app = build_app(async_engine, ServeConfig(model_name=name, api_keys=tuple(api_key or ()),
                                        allowed_origins=tuple(allowed_origins or ()),
                                        allowed_methods=tuple(allowed_methods or ()),
                                        allowed_headers=tuple(allowed_headers or ()),
                                        allow_credentials=allow_credentials,
                                        request_id_headers=enable_request_id_headers,
                                        max_num_queued_reqs=max_num_queued_reqs, max_request_bytes=body_bytes,
                                        log_interval=log_interval, log_requests=not disable_log_requests,
                                        generation_defaults=gen, chat_template=template,
                                        enable_auto_tool_choice=enable_auto_tool_choice,
                                        tool_call_parser=tool_call_parser))
    log.info("serving %s on http://%s:%d/v1", name, host, port)
    sig = run_server(app, sock, shutdown_timeout, log_level)
    log.info("shut down")
    if sig == signal.SIGINT:
        raise KeyboardInterrupt   # Ctrl-C: 130, as every command


def _chat_template(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserInputError(f"--chat-template {path}: cannot read it ({e.__class__.__name__})") from None


def _tool_call_parser(auto: bool, parser: str | None) -> str | None:
    """vLLM's rule: --enable-auto-tool-choice needs --tool-call-parser, one this server knows."""
    from llmopt.serve.tool_parsers import PARSERS   # deferred: start-up time (the server's modules)
    if parser is not None and parser not in PARSERS:
        raise UserInputError(f"--tool-call-parser {parser!r}: use one of {', '.join(PARSERS)}")
    if auto and parser is None:
        raise UserInputError("--enable-auto-tool-choice needs --tool-call-parser (hermes)")
    return parser


def config_values(ctx: typer.Context, path: Path) -> dict[str, Any]:
    """The values of a --config YAML file for the flags not given on the command line (or by
    environment variable), converted and range-checked as the flags are."""
    import yaml

    from llmopt.validate import decode_utf8
    if not path.is_file():
        raise UserInputError(f"--config {path}: no such file")
    try:
        data = yaml.safe_load(decode_utf8(path.read_bytes(), f"--config {path}"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise UserInputError(f"--config {path} is not valid YAML: {getattr(e, 'problem', None) or e}{where}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserInputError(f"--config {path} must be a mapping of flag names to values, got a "
                             f"{type(data).__name__}")
    flags: dict[str, tuple[Any, bool]] = {}   # flag name without dashes -> (click option, is the --no- form)
    for param in ctx.command.params:
        if param.param_type_name == "option" and param.name != "config":
            flags.update({o.lstrip("-"): (param, False) for o in param.opts})
            flags.update({o.lstrip("-"): (param, True) for o in param.secondary_opts})
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).lstrip("-").replace("_", "-")
        if name not in flags:
            close = difflib.get_close_matches(name, flags, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise UserInputError(f"--config {path}: unknown key {key!r}{hint}: use flag names of llmopt serve "
                                 "(see llmopt serve --help)")
        param, negative = flags[name]
        source = ctx.get_parameter_source(param.name)
        if value is None or getattr(source, "name", "") in ("COMMANDLINE", "ENVIRONMENT"):
            continue   # null: the default; a flag given on the command line (or LLMOPT_API_KEY) wins
        if getattr(param, "is_flag", False) and not isinstance(value, bool):
            raise UserInputError(f"--config {path}: {key} must be true or false, got {value!r}")
        if getattr(param, "multiple", False):   # a repeatable flag: one value or a list of them
            value = value if isinstance(value, list) else [value]
            if not all(isinstance(v, (str, int, float)) for v in value):
                raise UserInputError(f"--config {path}: {key} must be a value or a list of values")
        elif isinstance(value, (dict, list)):
            raise UserInputError(f"--config {path}: {key} must be a single value, got a {type(value).__name__}")
        try:
            out[param.name] = param.process_value(ctx, (not value) if negative else value)
        except typer.BadParameter as e:
            raise UserInputError(f"--config {path}: {key}: {getattr(e, 'message', '') or e.format_message()}") from None
    return out
