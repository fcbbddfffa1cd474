"""The official openai client's `chat.completions.parse(response_format=PydanticModel)` against
`llmopt serve` on the default model (SmolLM2-135M-Instruct): the client sends the model's strict
JSON schema, the server constrains the output to it, and the client hands back a parsed object.
pydantic, not llmopt, is the judge of the text."""

from __future__ import annotations

import sys
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from serve_util import API_KEY, free_port, spawn, stop
from llmopt import defaults


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population: int = Field(ge=0, le=100_000_000)
    continent: Literal["Africa", "Asia", "Europe", "North America", "South America", "Oceania"]


class Trip(BaseModel):
    traveller: str = Field(max_length=20)
    stops: list[City] = Field(min_length=1, max_length=2)
    by_train: bool


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    import openai
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("parse") / "server.log"
    cmd = [sys.executable, "-m", "llmopt", "serve", defaults.DEFAULT_MODEL, "--port", str(port),
           "--served-model-name", "smol", "--api-key", API_KEY, "--max-model-len", "1024",
           "--uvicorn-log-level", "warning"]
    proc = spawn(cmd, log, url, timeout=300)
    try:
        yield openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
    finally:
        stop(proc)


@pytest.mark.parametrize("schema, question", [
    (City, "Describe Paris as JSON."),
    (Trip, "Plan a trip to two cities in Japan, as JSON."),
])
def test_parse_returns_the_pydantic_object(client, schema, question):
    done = client.chat.completions.parse(
        model="smol", messages=[{"role": "user", "content": question}], response_format=schema,
        temperature=0, max_tokens=300)
    choice = done.choices[0]
    assert choice.finish_reason == "stop", choice
    parsed = choice.message.parsed
    assert isinstance(parsed, schema)
    # the text itself is the schema's JSON (pydantic re-validates it) and the parsed object is that text
    assert schema.model_validate_json(choice.message.content) == parsed
    assert choice.message.refusal is None and done.usage.completion_tokens > 0


def test_parse_while_sampling_stays_valid(client):
    """Sampled (not greedy) outputs are held to the schema too, for several seeds."""
    for seed in range(3):
        done = client.chat.completions.parse(
            model="smol", messages=[{"role": "user", "content": "A city, as JSON."}], response_format=City,
            temperature=1.0, seed=seed, max_tokens=200)
        assert done.choices[0].finish_reason == "stop"
        assert isinstance(done.choices[0].message.parsed, City)
