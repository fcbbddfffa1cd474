"""Draft-model speculation: a smaller model with the target's tokenizer drafts k tokens greedily,
with its own KV layers over the target's block table (paged.py).

Per request the drafter remembers which tokens its cache holds (the request's tokens when it last
drafted, plus the drafts it ran); the next time it runs only what the target accepted since
(usually the correction or bonus token, one accepted draft more when all were taken), then k - 1
one-token steps. A request that was preempted (its blocks freed) or is new starts from position 0.
A self-draft (the target's first layers with its final norm and head, LayerSkip-style early exit)
is an ordinary checkpoint written by `write_self_draft`."""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path

import torch

from llmopt.speculative.interface import DraftConfig, DraftProposal, ProposeInput, Proposer, ProposerContext
from llmopt.errors import UserInputError
from llmopt.models.config import ModelConfig
from llmopt.models.gguf_weights import iter_float_weights
from llmopt.models.loader import LoadedModel, iter_safetensors, resolve
from llmopt.speculative.paged import DraftKVCache, prepare


class DraftState:
    """What a drafter's cache holds for one request: its tokens at drafting time, then its drafts."""
    __slots__ = ("req", "preemptions", "n_base", "drafts")

    def __init__(self, req, n_base: int, drafts: list[int]) -> None:
        self.req, self.preemptions, self.n_base, self.drafts = req, req.num_preemptions, n_base, drafts

    def valid_prefix(self, req) -> int:
        """Leading positions of `req` whose draft K/V is right (0 if this is another request or it
        was preempted since)."""
        if self.req is not req or self.preemptions != req.num_preemptions:
            return 0
        toks, c = req.all_token_ids, self.n_base
        for j, d in enumerate(self.drafts):
            if c < len(toks) and toks[c] == d:
                c += 1
            else:
                break
        return c


class DraftModelProposer(Proposer):
    writes_kv = True

    def __init__(self, config: DraftConfig, loaded_draft: LoadedModel, ctx: ProposerContext) -> None:
        super().__init__(config)
        cfg, target_cfg = loaded_draft.config, ctx.target.config
        if cfg.vocab_size != target_cfg.vocab_size:
            raise UserInputError(f"the draft model's vocabulary ({cfg.vocab_size}) differs from the target's "
                                 f"({target_cfg.vocab_size}): use a draft with the same tokenizer")
        self.model = loaded_draft.model
        self.cache = DraftKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, ctx.num_blocks,
                                  ctx.block_size, loaded_draft.dtype, loaded_draft.device, ctx.backend)
        self.state: dict[str, DraftState] = {}

    @torch.inference_mode()
    def propose(self, batch: ProposeInput) -> DraftProposal:
        reqs, ks, tables = batch.requests, batch.num_draft_tokens, batch.block_ids
        seqs, todo = [], []
        for r in reqs:
            st = self.state.get(r.request_id)
            c = min(st.valid_prefix(r) if st else 0, r.num_tokens - 1)
            seqs.append((r.all_token_ids[c:], c, tables[r.request_id]))
            todo.append(r)
        if not todo:
            return DraftProposal()
        out = {r.request_id: [] for r in todo}
        for j in range(max(ks[r.request_id] for r in todo)):
            step = prepare(self.cache, seqs)
            hidden = self.model(step.input_ids, step.positions, self.cache)
            nxt = self.model.compute_logits(hidden[step.last_rows]).argmax(-1).tolist()
            for r, t in zip(todo, nxt):
                out[r.request_id].append(t)
            keep = [i for i, r in enumerate(todo) if ks[r.request_id] > j + 1]
            todo = [todo[i] for i in keep]
            seqs = [([nxt[i]], todo_r.num_tokens + j, tables[todo_r.request_id]) for i, todo_r in zip(keep, todo)]
            if not todo:
                break
        for r in reqs:
            d = out[r.request_id]
            self.state[r.request_id] = DraftState(r, r.num_tokens, d[:-1])
        return DraftProposal(out)

    def forget(self, live: Collection[str]) -> None:
        for rid in [rid for rid in self.state if rid not in live]:
            del self.state[rid]


def write_self_draft(target: str | Path, num_layers: int, output: Path) -> Path:
    """A LayerSkip-style self-draft: the target's embedding, first `num_layers` layers, final norm
    and head, saved as an ordinary checkpoint folder (safetensors, config, tokenizer files)."""
    from safetensors.torch import save_file
    ckpt = resolve(str(target))
    src = ckpt.folder
    cfg = json.loads((src / "config.json").read_text())
    total = cfg.get("num_hidden_layers")
    if not 1 <= num_layers < total:
        raise UserInputError(f"a self-draft of {num_layers} layers: give 1 to {total - 1} (the target has {total})")
    tensors = {}
    source = iter_float_weights(ckpt.gguf, ModelConfig.from_path(src)) if ckpt.gguf else iter_safetensors(src)
    for name, t in source:
        if ".layers." in name and int(name.split(".layers.")[1].split(".")[0]) >= num_layers:
            continue
        tensors[name] = t.contiguous()
    output.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(output / "model.safetensors"), metadata={"format": "pt"})
    cfg["num_hidden_layers"] = num_layers
    for key in ("layer_types", "sliding_window_pattern"):
        if isinstance(cfg.get(key), list):
            cfg[key] = cfg[key][:num_layers]
    (output / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "generation_config")) and f.is_file():
            (output / f.name).write_bytes(f.read_bytes())
    return output
