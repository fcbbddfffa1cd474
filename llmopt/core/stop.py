"""When a request stops: the one check after each accepted output token (vLLM's check_stop).

Order: nothing may stop the request before `min_tokens` outputs except the length limit; then EOS
(unless ignore_eos), a stop token id, a structured-output grammar that allows nothing more, a stop
string completed by the newest text (the text is cut before it, or after it with
include_stop_str_in_output); finally `max_tokens` (already capped by the model length). A stop
string that ends on the token that also reaches max_tokens reports "stop", as vLLM does, since the
text was cut there."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmopt.core.request import RequestStatus

if TYPE_CHECKING:
    from llmopt.core.request import Request


def find_stop_string(text: str, new_chars: int, stops: list[str]) -> tuple[str, int] | None:
    """The earliest stop string that ends inside the last `new_chars` characters of `text`:
    (stop string, its start index), or None."""
    if not stops or new_chars <= 0:
        return None
    longest = max(len(s) for s in stops)
    search_from = max(0, len(text) - new_chars - longest + 1)
    best = None
    for s in stops:
        i = text.find(s, search_from)
        if i >= 0 and (best is None or i < best[1]):
            best = (s, i)
    return best


def check_stop(req: "Request", new_text: str = "") -> RequestStatus | None:
    """After one output token was appended (and `new_text` detokenized from it): the finished
    status it causes, or None. Sets stop_reason (and cuts the text at a stop string); the scheduler
    sets the status and frees the request."""
    p = req.params
    n = req.num_output_tokens
    tok = req.output_token_ids[-1]
    if n >= p.min_tokens:
        if tok in req.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if tok in req.stop_token_ids:
            req.stop_reason = tok
            return RequestStatus.FINISHED_STOPPED
        if req.grammar is not None and req.grammar.is_terminated:
            return RequestStatus.FINISHED_STOPPED
        det = req.detokenizer
        hit = find_stop_string(det.text, len(new_text), p.stop) if det is not None and p.stop else None
        if hit is not None:
            s, i = hit
            det.text = det.text[:i + len(s)] if p.include_stop_str_in_output else det.text[:i]
            req.stop_reason = s
            return RequestStatus.FINISHED_STOPPED
    if n >= req.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    return None
