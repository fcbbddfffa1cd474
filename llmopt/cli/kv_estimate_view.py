"""Rich tables for `llmopt kv-estimate`: model, memory per GPU, paged cache, grid, naive formula,
what-if levers and a one-line verdict; and the preset listing."""

from __future__ import annotations

from rich.table import Table

from llmopt.cli import output

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
            ("runs on", f"{est.device}, {est.dtype}" + (f" with {est.weight_dtype} weights" if est.weight_dtype != est.dtype
                                                       else "") + " (the engine's meaning of auto)"),
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
    if p.residual_blocks:   # kivi2's full-precision pool
        rows.insert(5, ("full-precision residual", f"{p.residual_blocks:,} blocks of {p.residual_block_bytes:,} bytes "
                        f"({_gib(p.residual_blocks * p.residual_block_bytes)}), {p.residual_blocks_per_request} per "
                        "request"))
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


def list_presets(as_json: bool) -> None:
    from llmopt.estimate import bytes_per_token
    from llmopt.estimate.arch import arch_from_config
    from llmopt.estimate.params import count_params
    from llmopt.estimate.presets import GPU_PRESETS, MODEL_PRESETS
    models = []
    for p in MODEL_PRESETS:
        arch = arch_from_config(dict(p.config), p.hf_id, "preset", p.url, p.note)
        models.append({"hf_id": p.hf_id, "short": p.short, "attention": arch.attention, "layers": arch.num_layers,
                       "kv_bytes_per_token_bf16": int(bytes_per_token(arch, "bfloat16")),
                       "params": count_params(arch), "note": p.note, "source": p.url})
    gpus = [{"name": g.name, "memory_mib": g.memory_mib, "source": g.source} for g in GPU_PRESETS]
    result = {"models": models, "gpus": gpus}

    def tables(_):
        t = Table(title="Model presets (--model: Hugging Face id or short name)", title_justify="left")
        for c in ("Hugging Face id", "short", "attention", "layers", "KV B/token (bf16)", "params"):
            t.add_column(c, no_wrap=c in ("Hugging Face id", "short"))
        t.add_column("source", overflow="fold")
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
