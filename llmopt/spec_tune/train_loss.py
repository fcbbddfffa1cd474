"""The losses `llmopt spec-tune` trains a head with (train.py), and the batches they read.

The head at position i reads the token at i+1 and the feature at i and predicts the target's choice
at i+1 (the token at i+2), at every position with a next token (`prompts`; else on the answers'
positions only).
- EAGLE-1 (`eagle1_loss`): SmoothL1(head output, the target's final hidden state at i+1) + 0.1 x
  cross-entropy of the head's logits (through the target's LM head) against the target's
  distribution there.
- EAGLE-3 with training-time test (`eagle3_loss`): step 0 as above (fc over the three features); step
  j feeds the head its own output of step j-1 with the token j positions further and predicts the
  choice j positions further; a query at step j sits at position i+j and attends to the step-0 keys
  at positions <= i and to its own chain's keys of steps 1..j, as when drafting (`TTTAttention`).
  Loss: sum over steps of decay^j x cross-entropy over the draft vocabulary (the target's most
  frequent choices; the head's lm_head and norm start as the target's rows of them), against the
  target's choice (hard labels) or its distribution there (`soft`, as EAGLE-3 trains: the data then
  keeps the target's final hidden states).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmopt.errors import DataError

# -- the loss ---------------------------------------------------------------------------------------------

class TTTAttention:
    """Attention for training-time test: step 0 is causal over the sequence; at step j the query of
    position i attends to the step-0 keys at positions <= i and to its own chain's keys of steps
    1..j (the keys drafting would have cached)."""

    def __init__(self) -> None:
        self.k0 = self.v0 = None
        self.chain: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, layer_idx, q, k, v, window):
        g = q.shape[2] // k.shape[2]
        q = q.transpose(1, 2)                                  # [B, Hq, n, D]
        k, v = (x.transpose(1, 2).repeat_interleave(g, 1) for x in (k, v))
        if self.k0 is None:
            self.k0, self.v0 = k, v
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return o.transpose(1, 2)
        self.chain.append((k, v))
        n, scale = q.shape[2], q.shape[-1] ** -0.5
        s0 = (q @ self.k0.transpose(-1, -2)) * scale
        s0 = s0.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=q.device).tril(), float("-inf"))
        sd = [(q * kc).sum(-1, keepdim=True) * scale for kc, _ in self.chain]
        p = torch.softmax(torch.cat([s0, *sd], -1), -1)
        o = p[..., :n] @ self.v0
        for c, (_, vc) in enumerate(self.chain):
            o = o + p[..., n + c:n + c + 1] * vc
        return o.transpose(1, 2)


def collate(rows: list[dict], steps: int, device) -> dict:
    """Right-padded tensors for a batch: tokens, features, choices, prompt and total lengths (with
    `steps` extra padding, so step j can read j positions further), and the target's final hidden
    states where the rows hold them (soft labels)."""
    B, T = len(rows), max(len(r["tokens"]) for r in rows)
    W = T + steps + 1
    tok = torch.zeros(B, W, dtype=torch.long)
    am = torch.zeros(B, W, dtype=torch.long)
    feats = torch.zeros(B, T, rows[0]["feats"].shape[-1])
    final = torch.zeros(B, W, rows[0]["final"].shape[-1]) if "final" in rows[0] else None
    for b, r in enumerate(rows):
        n = len(r["tokens"])
        tok[b, :n], am[b, :n], feats[b, :n] = r["tokens"].long(), r["argmax"].long(), r["feats"].float()
        if final is not None:
            final[b, :n] = r["final"].float()
    lens = torch.tensor([len(r["tokens"]) for r in rows])
    plens = torch.tensor([r["prompt_len"] for r in rows])
    out = {"tokens": tok.to(device), "argmax": am.to(device), "feats": feats.to(device), "lens": lens.to(device),
           "plens": plens.to(device)}
    if final is not None:
        out["final"] = final.to(device)
    return out


def _valid(batch: dict, n: int, j: int, prompts: bool = False) -> torch.Tensor:
    """[B, n]: query i at step j has a label: the choice at p = i + 1 + j lies on the answer
    (p >= prompt_len - 1; anywhere with `prompts`) and is followed by a token of the sequence
    (p <= len - 2)."""
    p = torch.arange(n, device=batch["lens"].device)[None, :] + 1 + j
    last = p <= batch["lens"][:, None] - 2
    return last if prompts else last & (p >= batch["plens"][:, None] - 1)


def eagle3_loss(head, target, batch: dict, steps: int, decay: float, prompts: bool = False,
                soft: bool = False) -> tuple[torch.Tensor, list[float], int]:
    """Training-time-test loss of an EAGLE-3 head: sum_j decay^j x CE(step j), over the answers'
    positions (and the prompts' with `prompts`) where the target's choice is in the draft vocabulary;
    CE against the target's choice, or with `soft` against the target's distribution restricted to
    the draft vocabulary and renormalized (softmax of its logits there, from the final hidden states
    in `batch`), as EAGLE-3 trains; returns (loss, each step's mean CE, rows counted at step 0)."""
    t2d = head.t2d
    dmap = torch.cumsum(t2d.long(), 0) - 1                       # target id -> draft id (where t2d)
    if soft:
        if "final" not in batch:
            raise DataError("soft labels need the target's final hidden states in the training data")
        with torch.no_grad():    # the target's distribution on the draft vocabulary per position, once for all steps
            target_p = torch.softmax(batch["final"] @ target.lm_head.weight.detach()[t2d].float().T, -1)
    n = batch["feats"].shape[1] - 1
    attn = TTTAttention()
    hidden, total, parts, rows0 = batch["feats"][:, :n], 0.0, [], 0
    pos0 = torch.arange(n, device=hidden.device)[None, :].expand(hidden.shape[0], n)
    for j in range(steps):
        tok = batch["tokens"][:, 1 + j:1 + j + n]
        with torch.no_grad():
            emb = target.embed(tok)
        out = head(emb, hidden, pos0 + j, attn, fuse=j == 0)
        lab = batch["argmax"][:, 1 + j:1 + j + n]
        m = _valid(batch, n, j, prompts) & t2d[lab]
        if not m.any():
            break
        logits = head.lm_head(head.norm(out[m]))
        if soft:
            ce = -(target_p[:, 1 + j:1 + j + n][m] * torch.log_softmax(logits.float(), -1)).sum(-1).mean()
        else:
            ce = F.cross_entropy(logits, dmap[lab[m]])
        total = total + (decay ** j) * ce
        parts.append(ce.item())
        rows0 = rows0 or int(m.sum())
        hidden = out
    return total, parts, rows0


def eagle1_loss(head, target, batch: dict, ce_weight: float, noise: float = 0.0,
                prompts: bool = False) -> tuple[torch.Tensor, list[float], int]:
    """EAGLE-1: SmoothL1(head output, the target's feature at i+1) + ce_weight x cross-entropy
    against the target's distribution at i+1 (both through the target's LM head)."""
    n = batch["feats"].shape[1] - 1
    feats = batch["feats"][:, :n]
    if noise:
        feats = feats + (torch.rand_like(feats) - 0.5) * 2 * noise
    with torch.no_grad():
        emb = target.embed(batch["tokens"][:, 1:1 + n])
    pos = torch.arange(n, device=feats.device)[None, :].expand(feats.shape[0], n)
    out = head(emb, feats, pos, TTTAttention())
    m = _valid(batch, n, 0, prompts)
    if not m.any():
        return out.sum() * 0.0, [0.0, 0.0], 0
    pred, want = out[m], batch["feats"][:, 1:1 + n][m]
    vloss = F.smooth_l1_loss(pred, want)
    ce = 0.0
    for c in range(0, pred.shape[0], 1024):                      # [rows, vocab] logits, a slice at a time
        with torch.no_grad():
            p = torch.softmax(target.compute_logits(want[c:c + 1024]).float(), -1)
        lp = torch.log_softmax(target.compute_logits(pred[c:c + 1024]).float(), -1)
        ce = ce - (p * lp).sum()
    ce = ce / pred.shape[0]
    return vloss + ce_weight * ce, [vloss.item(), ce.item()], int(m.sum())
