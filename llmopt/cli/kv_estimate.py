"""`llmopt kv-estimate`: does the model fit, how many requests, how long a context, at which dtype."""

from __future__ import annotations

from typing import Optional

import typer
from rich.table import Table

from llmopt import defaults
from llmopt.cli import output
from llmopt.cli.app import app
from llmopt.cli.common import JsonOpt, ModelOpt
from llmopt.errors import DoesNotFitError, UserInputError

GIB = 1 << 30


def _kv(title: str, rows) -> Table:
    t = Table(title=title, show_header=False, title_justify="left")
    t.add_column("key", style="bold", no_wrap=True)
    t.add_column("value", overflow="fold")
    for k, v in rows:
        t.add_row(k, output.fmt(v))
    return t


def _gib(n: float) -> str:
    return f"{n / GIB:,.2f} GiB"


def _layers_text(est) -> str:
    parts = []
    for s in est.layers:
        label = f"{s.layers} {s.kind}" + (f" (window {s.window:,})" if s.window else "")
        parts.append(f"{label}: {output.fmt(s.bytes_per_token)} B/token each")
    return "; ".join(parts)


def _model_table(est) -> Table:
    w = est.weights
    rows = [("source", f"{est.source}: {est.origin}"),
            ("attention", f"{est.attention}, {est.num_kv_heads} KV head(s) x {est.head_dim}"
                          + (f", {est.kv_heads_per_rank} per GPU" if est.tensor_parallel_size > 1 else "")),
            ("layers", _layers_text(est)),
            ("KV cache dtype", est.kv_cache_dtype),
            ("KV bytes per token", f"{output.fmt(est.bytes_per_token)} per GPU"
             + (f" ({output.fmt(est.bytes_per_token_model)} whole model)" if est.tensor_parallel_size > 1 else "")),
            ("one request", f"{_gib(est.request_bytes)} per GPU at {est.max_model_len:,} tokens (paged)"),
            ("weights", f"{_gib(w.bytes_per_rank)} per GPU, {_gib(w.bytes_total)} total ({w.format}, "
                        f"{w.params / 1e9:,.2f}B params, from {w.source})")]
    if est.note:
        rows.append(("note", est.note))
    return _kv(f"{est.model}  (tensor parallel {est.tensor_parallel_size})", rows)


def _memory_table(est) -> Table:
    m, p = est.memory, est.paged
    t = Table(title=f"Memory per GPU: {m.gpu}, {_gib(m.gpu_memory_bytes)}", title_justify="left")
    for c in ("", "GiB", "% of GPU"):
        t.add_column(c, justify="left" if not c else "right")
    kv = p.kv_cache_bytes if p else 0
    reserve = ", ".join(f"{k} {v / GIB:.2f}" for k, v in m.reserve_detail.items())
    rows = [("weights", m.weights_bytes), (f"reserve ({reserve})", m.reserve_bytes), ("KV cache", kv),
            ("free in budget", m.budget_bytes - m.weights_bytes - m.reserve_bytes - kv),
            (f"outside budget (utilization {m.gpu_memory_utilization:g})", m.gpu_memory_bytes - m.budget_bytes)]
    for name, b in rows:
        style = "red" if b < 0 else None
        t.add_row(name, f"{b / GIB:,.2f}", f"{100 * b / m.gpu_memory_bytes:.1f}%", style=style)
    return t


def _paged_table(est) -> Table:
    p = est.paged
    kinds: dict[tuple, list] = {}
    for g in p.groups:
        kinds.setdefault((g["kind"], g["window"], g["blocks_per_request"]), []).append(g["layers"])
    groups = "; ".join(f"{len(v)} x {k[0]}" + (f" (window {k[1]:,})" if k[1] else "")
                       + f" of {'/'.join(map(str, v)) if len(set(v)) > 1 else v[0]} layers: {k[2]:,} blocks/request"
                       for k, v in kinds.items())
    limit = " (the model's limit)" if p.longest_context_limited_by == "model" else ""
    rows = [("block size", f"{p.block_size} tokens, {p.block_bytes:,} bytes per block (all layers, one GPU)"),
            ("layout", f"{p.layout}: {groups}"),
            ("KV memory", _gib(p.available_bytes)),
            ("blocks", p.num_blocks),
            ("tokens in cache", p.tokens),
            (f"blocks per {est.max_model_len:,}-token request", p.blocks_per_request),
            ("max concurrency", f"{p.max_concurrency:,.2f} requests of {est.max_model_len:,} tokens"),
            ("longest context for one request", f"{p.longest_context:,} tokens{limit}")]
    return _kv("Paged KV cache", rows)


def _grid_table(est) -> Table:
    seqs = sorted({c.seq_len for c in est.grid})
    batches = sorted({c.batch_size for c in est.grid})
    t = Table(title="Batch x context (share of the KV cache; GiB per GPU without a budget)", title_justify="left")
    t.add_column("context")
    for b in batches:
        t.add_column(f"batch {b}", justify="right")
    cells = {(c.seq_len, c.batch_size): c for c in est.grid}
    for s in seqs:
        row = []
        for b in batches:
            c = cells[(s, b)]
            if c.fits is None:
                row.append(f"{c.kv_bytes / GIB:,.2f} GiB")
            else:
                mark = "[green]fits[/]" if c.fits else "[red]miss[/]"
                row.append(f"{mark} {100 * c.kv_fraction:,.0f}%" if c.kv_fraction is not None else mark)
        t.add_row(f"{s:,}", *row)
    return t


def _naive_table(est) -> Table:
    n = est.naive
    rows = [("formula", n.formula), ("naive", _gib(n.naive_bytes)),
            ("real (paged, whole model)", _gib(n.real_bytes)), ("naive / real", f"{n.ratio:.2f}x")]
    rows += [("why", d) for d in n.differences]
    return _kv(f"Naive formula vs real, one request of {n.seq_len:,} tokens", rows)


def _what_if_table(est) -> Table:
    t = Table(title=f"What if (same GPU budget; GiB per GPU; requests of {est.max_model_len:,} tokens)",
              title_justify="left")
    t.add_column("change", no_wrap=True)
    for c in ("weights", "KV cache", "requests", "longest ctx", "fits"):
        t.add_column(c, justify="right")
    base = est.paged
    rows = [("(as asked)", est.fits, base.max_concurrency if base else None, base.longest_context if base else None,
             est.weights.bytes_per_rank, base.kv_cache_bytes if base else None)]
    rows += [(w.change, w.fits, w.max_concurrency, w.longest_context, w.weights_per_gpu_bytes, w.kv_cache_bytes)
             for w in est.what_if]
    for change, fits, conc, longest, wb, kvb in rows:
        t.add_row(change, f"{wb / GIB:,.2f}", "-" if kvb is None else f"{kvb / GIB:,.2f}",
                  "-" if conc is None else f"{conc:,.2f}",
                  "-" if longest is None else f"{longest:,}",
                  "-" if fits is None else ("[green]yes[/]" if fits else "[red]no[/]"))
    return t


def _verdict(est) -> Table:
    if est.fits is None:
        text = "[yellow]no memory budget[/]: give --gpu, --gpu-memory or --kv-cache-memory to plan blocks"
    elif est.fits:
        p = est.paged
        text = (f"[green]fits[/]: {int(p.max_concurrency):,} concurrent requests of {est.max_model_len:,} tokens "
                f"({p.tokens:,} tokens of KV cache) per replica of {est.tensor_parallel_size} GPU(s)")
    else:
        text = "[red]does not fit[/]: " + "; ".join(est.problems)
    t = Table(show_header=False, box=None)
    t.add_column()
    t.add_row(text)
    return t


def render(est) -> list[Table]:
    tables = [_model_table(est)]
    if est.memory:
        tables.append(_memory_table(est))
    if est.paged:
        tables.append(_paged_table(est))
    if est.grid:
        tables.append(_grid_table(est))
    if est.naive:
        tables.append(_naive_table(est))
    if est.what_if:
        tables.append(_what_if_table(est))
    tables.append(_verdict(est))
    return tables


def _presets(as_json: bool) -> None:
    from llmopt.estimate import bytes_per_token
    from llmopt.estimate.model_spec import spec_from_config
    from llmopt.estimate.params import count_params
    from llmopt.estimate.presets import GPU_PRESETS, MODEL_PRESETS
    models = []
    for p in MODEL_PRESETS:
        spec = spec_from_config(dict(p.config), p.hf_id, "preset", p.url, p.note)
        models.append({"hf_id": p.hf_id, "short": p.short, "attention": spec.attention, "layers": spec.num_layers,
                       "kv_bytes_per_token_bf16": int(bytes_per_token(spec, "bfloat16")),
                       "params": count_params(spec), "note": p.note, "source": p.url})
    gpus = [{"name": g.name, "memory_mib": g.memory_mib, "source": g.source} for g in GPU_PRESETS]
    result = {"models": models, "gpus": gpus}

    def tables(_):
        t = Table(title="Model presets (--model: Hugging Face id or short name)", title_justify="left")
        for c in ("Hugging Face id", "short", "attention", "layers", "KV B/token (bf16)", "params", "source"):
            t.add_column(c)
        for m in models:
            t.add_row(m["hf_id"], m["short"], m["attention"], str(m["layers"]), f"{m['kv_bytes_per_token_bf16']:,}",
                      f"{m['params'] / 1e9:,.2f}B", m["source"])
        g = Table(title="GPU presets (--gpu)", title_justify="left")
        for c in ("name", "memory", "source"):
            g.add_column(c)
        for x in gpus:
            g.add_row(x["name"], f"{x['memory_mib']:,} MiB ({x['memory_mib'] / 1024:,.2f} GiB)", x["source"])
        return [t, g]
    output.emit(result, as_json=as_json, table=tables)


@app.command("kv-estimate")
def kv_estimate(
    model: Optional[str] = ModelOpt,
    gpu: Optional[str] = typer.Option(None, "--gpu", help="GPU preset: H100-80GB, H200, A100-40GB, A100-80GB, L40S, "
                                      "L4, RTX-4090 (see --list-presets)."),
    gpu_memory: Optional[float] = typer.Option(None, "--gpu-memory", help="GPU memory in GiB (instead of --gpu)."),
    gpu_memory_utilization: float = typer.Option(defaults.GPU_MEMORY_UTILIZATION, "--gpu-memory-utilization",
                                                 help="Share of GPU memory the server may use (vLLM's meaning)."),
    tensor_parallel_size: int = typer.Option(1, "--tensor-parallel-size", "-tp", help="GPUs per replica."),
    kv_cache_dtype: str = typer.Option(defaults.KV_CACHE_DTYPE, "--kv-cache-dtype",
                                       help="auto|float32|bfloat16|float16|fp8|fp8_e4m3|fp8_e5m2|int8|int4|kivi2|fp8_ds_mla."),
    block_size: int = typer.Option(defaults.BLOCK_SIZE, "--block-size", help="Tokens per KV block."),
    max_model_len: Optional[str] = typer.Option(None, "--max-model-len", help="Context per request, e.g. 32768 or 32k "
                                                "(default: the model's max_position_embeddings)."),
    max_num_batched_tokens: str = typer.Option(str(defaults.MAX_NUM_BATCHED_TOKENS), "--max-num-batched-tokens",
                                               help="Tokens per scheduler step (caps sliding-window blocks)."),
    max_num_seqs: int = typer.Option(defaults.MAX_NUM_SEQS, "--max-num-seqs", help="Requests per step (sizes logits)."),
    kv_cache_memory: Optional[str] = typer.Option(None, "--kv-cache-memory", help="KV cache bytes per GPU, e.g. 8GiB "
                                                  "(instead of deriving it from the GPU budget)."),
    reserve_gib: Optional[float] = typer.Option(None, "--reserve-gib", help="Non-KV, non-weight memory per GPU "
                                                "(default: estimated activations + logits + runtime)."),
    weight_format: str = typer.Option("auto", "--weight-format", help="auto|bfloat16|float16|float32|fp8|fp8-block|"
                                      "int8|int4|<GGML type such as q4_k>."),
    group_size: Optional[int] = typer.Option(None, "--group-size", help="Group size for --weight-format int4 "
                                             f"(default {defaults.QUANT_GROUP_SIZE}; -1 per channel)."),
    batch_sizes: Optional[str] = typer.Option(None, "--batch-sizes", help="Grid mode: batch sizes, e.g. 1,8,32."),
    seq_lens: Optional[str] = typer.Option(None, "--seq-lens", help="Grid mode: context lengths, e.g. 2k,8k,32k."),
    naive: bool = typer.Option(False, "--naive", help="Show the 2 x layers x hidden x seq x batch x bytes formula beside."),
    require_fit: bool = typer.Option(False, "--require-fit", help="Exit with code 3 when it does not fit (CI gate)."),
    no_hybrid: bool = typer.Option(False, "--no-hybrid", help="Like vLLM --disable-hybrid-kv-cache-manager: "
                                   "sliding-window layers hold full-length blocks."),
    what_if: bool = typer.Option(True, "--what-if/--no-what-if", help="Also show fp8 KV, quantized weights, "
                                 "2x GPUs and the longest fitting context under the same budget."),
    list_presets: bool = typer.Option(False, "--list-presets", help="List model and GPU presets and exit."),
    num_layers: Optional[int] = typer.Option(None, "--num-layers", help="Override: decoder layers."),
    num_kv_heads: Optional[int] = typer.Option(None, "--num-kv-heads", help="Override: KV heads."),
    head_dim: Optional[int] = typer.Option(None, "--head-dim", help="Override: head dimension."),
    hidden_size: Optional[int] = typer.Option(None, "--hidden-size", help="Override: hidden size."),
    num_attention_heads: Optional[int] = typer.Option(None, "--num-attention-heads", help="Override: query heads."),
    intermediate_size: Optional[int] = typer.Option(None, "--intermediate-size", help="Override: MLP width."),
    vocab_size: Optional[int] = typer.Option(None, "--vocab-size", help="Override: vocabulary size."),
    sliding_window: Optional[int] = typer.Option(None, "--sliding-window", help="Override: window (0: none)."),
    kv_lora_rank: Optional[int] = typer.Option(None, "--kv-lora-rank", help="Override: MLA latent rank."),
    as_json: bool = JsonOpt,
) -> None:
    """Plan KV-cache and weight memory: bytes per token, blocks, concurrency, longest context, fit."""
    def run() -> None:
        if list_presets:
            _presets(as_json)
            return
        from llmopt.estimate import estimate, resolve_model_spec
        from llmopt.estimate.units import parse_bytes, parse_list, parse_tokens
        overrides = {"num_layers": num_layers, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
                     "hidden_size": hidden_size, "num_attention_heads": num_attention_heads,
                     "intermediate_size": intermediate_size, "vocab_size": vocab_size,
                     "sliding_window": sliding_window, "kv_lora_rank": kv_lora_rank}
        spec = resolve_model_spec(model, overrides)
        if reserve_gib is not None and reserve_gib < 0:
            raise UserInputError(f"--reserve-gib must be non-negative, got {reserve_gib}")
        est = estimate(
            spec, kv_cache_dtype=kv_cache_dtype, block_size=block_size,
            max_model_len=parse_tokens(max_model_len, "--max-model-len") if max_model_len else None,
            max_num_batched_tokens=parse_tokens(max_num_batched_tokens, "--max-num-batched-tokens"),
            max_num_seqs=max_num_seqs, tensor_parallel_size=tensor_parallel_size, gpu=gpu, gpu_memory_gib=gpu_memory,
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_memory=parse_bytes(kv_cache_memory) if kv_cache_memory else None,
            reserve_bytes=None if reserve_gib is None else int(reserve_gib * GIB), weight_format=weight_format,
            group_size=group_size, batch_sizes=parse_list(batch_sizes, "--batch-sizes") if batch_sizes else None,
            seq_lens=parse_list(seq_lens, "--seq-lens") if seq_lens else None, naive=naive, hybrid=not no_hybrid,
            what_if=what_if)
        output.emit(est, as_json=as_json, table=render)
        if require_fit:
            if est.fits is None:
                raise UserInputError("--require-fit needs a memory budget: --gpu, --gpu-memory or --kv-cache-memory")
            if not est.fits:
                raise DoesNotFitError("does not fit: " + "; ".join(est.problems))
    output.run_guarded(run)
