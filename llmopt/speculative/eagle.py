"""EAGLE and EAGLE-3 draft heads, loaded in the EAGLE repository's format (what vLLM and SGLang load)
or ours (the same names, written by `llmopt spec-tune`).

EAGLE-1 (`EagleLlamaForCausalLM`-style: `fc.*`, `layers.0.*`): one decoder layer (no input norm)
over fc([token embedding ; target hidden state]); its output goes through the target's LM head.
EAGLE-3 (`LlamaForCausalLMEagle3`: `midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`, `t2d`): fc fuses the
target's low, middle and high features (the hidden states entering layers 2, L/2 and L-3, as vLLM
picks them) to one; the layer attends over [input_layernorm(embedding) ; hidden_norm(hidden)]
(2 x hidden wide); norm + its own lm_head over a draft vocabulary whose id i is target id
i + d2t[i]. Both use the target's embedding.

The head at position p reads the token at p + 1 and the target's feature at p, and predicts the
token at p + 2; drafting past the target's last feature feeds the head's own output hidden state
back (pre-norm for EAGLE-3). Its KV lives over the target's block table (paged.py). Positions the
head ran on drafts are recomputed with the target's features once they are verified."""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path

import torch
import torch.nn as nn

from llmopt import defaults
from llmopt.speculative.interface import DraftProposal, ProposeInput, Proposer, ProposerContext, StepHiddenStates
from llmopt.errors import ModelLoadError, UserInputError
from llmopt.kernels import cpu_quant
from llmopt.models.config import parse_hf_config
from llmopt.models.llama import MLP, RMSNorm, apply_rope, rope_cos_sin, rope_inv_freq
from llmopt.layers.modules_w8a8 import int8_rows
from llmopt.speculative.draft_model import DraftState
from llmopt.speculative.paged import DraftKVCache, prepare

EAGLE3_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def eagle3_layers(num_layers: int) -> tuple[int, int, int]:
    """The target layers whose input hidden states EAGLE-3 reads (vLLM's choice)."""
    return (2, num_layers // 2, num_layers - 3)


class HeadAttention(nn.Module):
    def __init__(self, cfg, in_features: int, bias: bool) -> None:
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(in_features, self.nh * self.hd, bias=bias)
        self.k_proj = nn.Linear(in_features, self.nkv * self.hd, bias=bias)
        self.v_proj = nn.Linear(in_features, self.nkv * self.hd, bias=bias)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, attn):
        lead = x.shape[:-1]
        q = self.q_proj(x).reshape(*lead, self.nh, self.hd)
        k = self.k_proj(x).reshape(*lead, self.nkv, self.hd)
        v = self.v_proj(x).reshape(*lead, self.nkv, self.hd)
        o = attn(0, apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, None)
        return self.o_proj(o.reshape(*lead, self.nh * self.hd))


class HeadLayer(nn.Module):
    def __init__(self, cfg, eagle3: bool, bias: bool) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.self_attn = HeadAttention(cfg, 2 * h if eagle3 else h, bias)
        self.mlp = MLP(cfg)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        if eagle3:
            self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
            self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)


class EagleHead(nn.Module):
    """One EAGLE (eagle3=False) or EAGLE-3 head. `forward(embeds, hidden, positions, attn, fuse)`
    -> the layer's output (pre-norm); `fuse`: hidden holds target features to pass through fc
    (EAGLE-3: only those; EAGLE-1: always)."""

    def __init__(self, cfg, eagle3: bool, draft_vocab_size: int | None = None, fc_bias: bool = False,
                 target_hidden_size: int | None = None) -> None:
        super().__init__()
        self.config, self.eagle3 = cfg, eagle3
        h = cfg.hidden_size
        th = target_hidden_size or h
        layer = HeadLayer(cfg, eagle3, bias=fc_bias and not eagle3)
        if eagle3:
            self.fc = nn.Linear(3 * th, h, bias=False)
            self.midlayer = layer
            self.norm = RMSNorm(h, cfg.rms_norm_eps)
            dv = draft_vocab_size or cfg.vocab_size
            self.lm_head = nn.Linear(h, dv, bias=False)
            self.register_buffer("d2t", torch.zeros(dv, dtype=torch.long))
            self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
        else:
            self.fc = nn.Linear(2 * h, h, bias=fc_bias)
            self.layers = nn.ModuleList([layer])
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    @property
    def layer(self) -> HeadLayer:
        return self.midlayer if self.eagle3 else self.layers[0]

    def forward(self, embeds, hidden, positions, attn, fuse: bool = True):
        L = self.layer
        cos, sin = rope_cos_sin(self.inv_freq, positions, embeds.dtype)
        if self.eagle3:
            if fuse:
                hidden = self.fc(hidden)
            residual = hidden
            x = torch.cat([L.input_layernorm(embeds), L.hidden_norm(hidden)], -1)
        else:
            x = residual = self.fc(torch.cat([embeds, hidden], -1))
        x = residual + L.self_attn(x, cos, sin, attn)
        return x + L.mlp(L.post_attention_layernorm(x))

    def logits_to_target(self, out: torch.Tensor, target) -> torch.Tensor:
        """Target-vocabulary token ids the head picks (greedy) from its output hidden states."""
        if not self.eagle3:
            return target.compute_logits(out).argmax(-1)
        ids = self.lm_head(self.norm(out)).argmax(-1)
        return ids + self.d2t[ids]


class CpuLinear(nn.Module):
    """An nn.Linear through the C++ kernels, for the one to a few rows of a draft step: float32
    weights (`llmopt_cpu::f32_gemm`), or an int8 copy (`gs` > 0: symmetric, round to nearest per
    group of `gs` inputs, `w8_gemm`: 4x fewer bytes to stream). Both use the two cores where aten's
    GEMV uses one. Measured for an EAGLE-3 head of SmolLM2 at K = 2 (docs/benchmarks.md, speculative
    decoding): drafting 11.8 ms a step on aten, 6.1 on f32_gemm, 4.5 on the int8 copy
    (held-out acceptance 1.549 float32, 1.553 int8: drafts are verified, outputs cannot change)."""

    def __init__(self, linear: nn.Linear, ops, gs: int = 0) -> None:
        super().__init__()
        self.bias, self.out_features, self.gs, self._ops = linear.bias, linear.out_features, gs, ops
        if gs:   # int8_rows over rows of gs inputs: one symmetric scale per group
            codes, scales = int8_rows(linear.weight.reshape(-1, gs))
            self.codes, self.scales = codes.view(linear.weight.shape), scales.view(self.out_features, -1)
            self.weight = None
        else:
            self.weight = linear.weight

    def _matmul(self, x2: torch.Tensor) -> torch.Tensor:
        if self.gs:
            return cpu_quant.w8_gemm(x2, self.codes, self.scales, _NO_ZEROS, self.gs)
        return self._ops.f32_gemm(x2, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_quant.linear_2d(x, self._matmul, self.out_features, self.bias)


_NO_ZEROS = torch.empty(0)


def use_cpu_kernels(head: nn.Module, int8_group: int = defaults.SPEC_EAGLE_CPU_INT8_GROUP) -> bool:
    """Swap a float32 CPU head's linears for CpuLinear where the C++ kernels are built (int8 where
    `int8_group` divides a linear's inputs, else float32); whether it did."""
    ops = cpu_quant.ops()
    w = next(head.parameters())
    if ops is None or w.device.type != "cpu" or w.dtype != torch.float32:
        return False
    for parent in list(head.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.is_contiguous():
                gs = int8_group if int8_group and child.in_features % int8_group == 0 else 0
                setattr(parent, name, CpuLinear(child, ops, gs))
    return True


def load_eagle_head(path: str | Path, method: str, target_cfg, dtype, device) -> EagleHead:
    """A head from a folder with config.json and model.safetensors or pytorch_model.bin."""
    folder = Path(path).expanduser()
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"{folder}: no config.json, so not an EAGLE head folder")
    d = json.loads((folder / "config.json").read_text())
    archs = d.get("architectures") or []
    eagle3 = method == "eagle3"
    if eagle3 != any(a in EAGLE3_ARCHS for a in archs) and archs:
        raise UserInputError(f"{folder} is a{'n EAGLE-3' if not eagle3 else 'n EAGLE-1'} head "
                             f"({', '.join(archs)}): use method {'eagle' if eagle3 else 'eagle3'}")
    hf = dict(d, num_hidden_layers=1, model_type="llama")
    hf.setdefault("vocab_size", target_cfg.vocab_size)
    cfg = parse_hf_config(hf, str(folder / "config.json"))
    if cfg.vocab_size != target_cfg.vocab_size:
        raise UserInputError(f"the head's vocabulary ({cfg.vocab_size}) is not the target's ({target_cfg.vocab_size})")
    if cfg.hidden_size != target_cfg.hidden_size:   # it reads the target's embeddings
        raise UserInputError(f"{folder}: the head's hidden size ({cfg.hidden_size}) is not the target's "
                             f"({target_cfg.hidden_size})")
    state = _read_weights(folder)
    head = EagleHead(cfg, eagle3, d.get("draft_vocab_size"), fc_bias="fc.bias" in state,
                     target_hidden_size=d.get("target_hidden_size") or target_cfg.hidden_size)
    state = {k: v for k, v in state.items() if not k.startswith("embed_tokens")}
    if eagle3 and "d2t" in state:
        state["d2t"] = state["d2t"].long()
    if eagle3 and "t2d" in state:
        state["t2d"] = state["t2d"].bool()
    missing, unexpected = head.load_state_dict(state, strict=False)
    missing = [m for m in missing if m not in ("d2t", "t2d")]
    if missing or unexpected:
        raise ModelLoadError(f"{folder}: the head's weights do not match an {method} head "
                             f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    return head.to(device=device, dtype=dtype).eval()


def new_head(target_cfg, method: str, draft_vocab: list[int] | None = None, seed: int = 0) -> EagleHead:
    """A freshly initialized head for a target (spec-tune starts here): the target's attention shape,
    one layer; EAGLE-3 with `draft_vocab` (target ids, ascending) as its vocabulary."""
    import dataclasses
    cfg = dataclasses.replace(target_cfg, num_hidden_layers=1, layer_windows=[], quantization_config=None)
    torch.manual_seed(seed)
    eagle3 = method == "eagle3"
    head = EagleHead(cfg, eagle3, len(draft_vocab) if draft_vocab else None, fc_bias=not eagle3)
    if eagle3 and draft_vocab:
        ids = torch.tensor(draft_vocab, dtype=torch.long)
        head.d2t.copy_(ids - torch.arange(len(ids)))
        head.t2d.zero_()
        head.t2d[ids] = True
    return head


def save_head(head: EagleHead, folder: Path) -> None:
    """config.json (a Llama config; LlamaForCausalLMEagle3 with draft_vocab_size for EAGLE-3) and
    model.safetensors with the EAGLE repository's tensor names."""
    from safetensors.torch import save_file
    cfg = head.config
    d = {"architectures": ["LlamaForCausalLMEagle3" if head.eagle3 else "EagleLlamaForCausalLM"],
         "model_type": "llama", "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
         "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
         "head_dim": cfg.head_dim, "num_hidden_layers": 1, "rms_norm_eps": cfg.rms_norm_eps,
         "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position_embeddings,
         "vocab_size": cfg.vocab_size, "torch_dtype": "float16", "hidden_act": "silu"}
    if cfg.rope_scaling:
        d["rope_scaling"] = cfg.rope_scaling
    if head.eagle3:
        d["draft_vocab_size"] = head.lm_head.out_features
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: (v.half() if v.is_floating_point() else v).contiguous().cpu() for k, v in head.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(d, indent=2))


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    if (folder / "model.safetensors").is_file():
        from safetensors.torch import load_file
        return load_file(str(folder / "model.safetensors"))
    if (folder / "pytorch_model.bin").is_file():
        return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise ModelLoadError(f"{folder}: no model.safetensors or pytorch_model.bin")


class EagleProposer(Proposer):
    """Drafts with an EAGLE / EAGLE-3 head from the target's hidden states of each step, which it
    asks the runner for (`hidden_layers`: EAGLE-1 the final ones, EAGLE-3 also three layers' inputs)."""
    writes_kv = True

    def __init__(self, config, ctx: ProposerContext) -> None:
        super().__init__(config)
        target, tcfg = ctx.target, ctx.target.config
        self.eagle3 = config.method == "eagle3"
        self.head = load_eagle_head(config.model, config.method, tcfg, target.dtype, target.device)
        use_cpu_kernels(self.head)
        self.target = target.model
        self.layers = eagle3_layers(tcfg.num_hidden_layers) if self.eagle3 else ()
        self.hidden_layers = self.layers
        hc = self.head.config
        self.cache = DraftKVCache(1, hc.num_key_value_heads, hc.head_dim, ctx.num_blocks, ctx.block_size,
                                  target.dtype, target.device, ctx.backend)
        self.state: dict[str, DraftState] = {}
        self.feats: dict[str, list] = {}    # request id -> [first position, features [n, F]]

    def observe(self, hidden: StepHiddenStates | None) -> None:
        n = sum(rows for _, _, rows in hidden.rows) if hidden is not None else 0
        if hidden is None or hidden.states.final.shape[0] != n:   # a step rerun request by request: features unknown
            self.feats.clear()
            self.state.clear()
            return
        uniq = sorted(set(self.layers))      # returned once per layer, in order
        hs = hidden.states
        f = torch.cat([hs.layers[uniq.index(i)] for i in self.layers], -1) if self.eagle3 else hs.final
        off = 0
        for rid, start, count in hidden.rows:
            rows = f[off:off + count]
            off += count
            buf = self.feats.get(rid)
            if buf is None or start < buf[0] or start > buf[0] + buf[1].shape[0]:
                self.feats[rid] = [start, rows.clone()]
            else:
                keep = buf[1][:start - buf[0]]
                buf[1] = torch.cat([keep, rows])

    @torch.inference_mode()
    def propose(self, batch: ProposeInput) -> DraftProposal:
        reqs, ks, tables = batch.requests, batch.num_draft_tokens, batch.block_ids
        seqs, hid, todo = [], [], []
        for r in reqs:
            buf = self.feats.get(r.request_id)
            if buf is None:
                continue
            st = self.state.get(r.request_id)
            c = st.valid_prefix(r) if st else 0
            hi = r.num_tokens - 2                    # the last position with a target feature and a next token
            lo = max(c, buf[0])
            if lo > hi or hi >= buf[0] + buf[1].shape[0]:
                continue
            seqs.append((r.all_token_ids[lo + 1:hi + 2], lo, tables[r.request_id]))
            hid.append(buf[1][lo - buf[0]:hi - buf[0] + 1])
            todo.append(r)
        out = {r.request_id: [] for r in todo}
        if not todo:
            return DraftProposal(out)
        hidden = torch.cat(hid)
        for j in range(max(ks[r.request_id] for r in todo)):
            step = prepare(self.cache, seqs)
            h = self.head(self.target.embed(step.input_ids), hidden, step.positions, self.cache, fuse=j == 0)
            last = h[step.last_rows]
            nxt = self.head.logits_to_target(last, self.target).tolist()
            for r, t in zip(todo, nxt):
                out[r.request_id].append(t)
            keep = [i for i, r in enumerate(todo) if ks[r.request_id] > j + 1]
            seqs = [([nxt[i]], todo[i].num_tokens - 1 + j, tables[todo[i].request_id]) for i in keep]
            hidden = last[keep]
            todo = [todo[i] for i in keep]
            if not todo:
                break
        for rid in out:
            r = next(x for x in reqs if x.request_id == rid)
            self.state[rid] = DraftState(r, r.num_tokens - 1, [])   # drafted positions are redone with features
            buf = self.feats[rid]
            cut = r.num_tokens - 1 - buf[0]
            if cut > 0:
                buf[0], buf[1] = buf[0] + cut, buf[1][cut:]
        return DraftProposal(out)

    def forget(self, live: Collection[str]) -> None:
        for d in (self.state, self.feats):
            for rid in [rid for rid in d if rid not in live]:
                del d[rid]
