"""schemathesis hooks for tests/serve/test_openapi.py (loaded by the CLI it runs, through
SCHEMATHESIS_HOOKS): generated requests ask for few tokens and samples, so the tiny model answers
quickly, and every status each operation got is written to $FUZZ_SEEN (JSON), so the test can
tell that valid requests were served, not only refused."""

from __future__ import annotations

import json
import os

import schemathesis

SMALL_TOKENS, SMALL_N = 8, 2
CHAT = "/v1/chat/completions"
SEEN: dict[str, dict[str, int]] = {}


def small(path: str, body, max_model_len: int):
    """A generated body, with max_tokens and n that the model would spend long on (in range, up to
    the context) cut to SMALL_TOKENS and SMALL_N; values out of range are kept: their 400 is under test."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    for key, cap in (("max_tokens", SMALL_TOKENS), ("max_completion_tokens", SMALL_TOKENS), ("n", SMALL_N)):
        value = body.get(key)
        if type(value) is int and cap < value <= max_model_len:
            body[key] = cap
    if path == CHAT and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = SMALL_TOKENS   # chat's default is the rest of the context
    return body


@schemathesis.hook
def before_call(context, case, kwargs):
    case.body = small(case.operation.path, case.body, int(os.environ["FUZZ_MAX_MODEL_LEN"]))


@schemathesis.hook
def after_call(context, case, response):
    counts = SEEN.setdefault(f"{case.method.upper()} {case.operation.path}", {})
    counts[str(response.status_code)] = counts.get(str(response.status_code), 0) + 1
    with open(os.environ["FUZZ_SEEN"], "w") as f:
        json.dump(SEEN, f)
