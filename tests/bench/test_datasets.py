"""Workloads: the random dataset's exact token lengths (checked with the tokenizer), ranges and shared
prefix; ShareGPT's filter; Spec-Bench's first turns and categories; prompts files."""

from __future__ import annotations

import json

import pytest

from llmopt.bench.datasets import (Workload, count_tokens, length_range, load_tokenizer, random_requests,
                                   sample_requests)
from llmopt.errors import DataError, UserInputError


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("smollm2-135m")


def test_random_prompts_have_exactly_the_drawn_lengths(tok):
    reqs = random_requests(tok, 40, input_len=100, output_len=20, range_ratio=0.5, seed=0)
    lo, hi = length_range(100, 0.5)
    assert (lo, hi) == (50, 150)
    lens = [r.prompt_len for r in reqs]
    assert all(count_tokens(tok, r.prompt) == r.prompt_len for r in reqs)       # exact, as the server counts
    assert all(lo <= n <= hi for n in lens) and len(set(lens)) > 10             # drawn over the range
    assert all(10 <= r.expected_output_len <= 30 for r in reqs)
    fixed = random_requests(tok, 5, input_len=64, output_len=7, seed=1)
    assert [r.prompt_len for r in fixed] == [64] * 5 and [r.expected_output_len for r in fixed] == [7] * 5
    assert len({r.prompt for r in fixed}) == 5
    assert [r.prompt for r in random_requests(tok, 5, 64, 7, seed=1)] == [r.prompt for r in fixed]   # seeded


def test_random_prefix_is_shared_and_added_to_the_length(tok):
    reqs = random_requests(tok, 12, input_len=40, output_len=4, prefix_len=48, seed=2)
    assert all(r.prompt_len == 88 == count_tokens(tok, r.prompt) for r in reqs)
    heads = {tuple(tok(r.prompt).input_ids[:48]) for r in reqs}
    assert len(heads) == 1                                                      # the same 48 tokens first
    assert len({tuple(tok(r.prompt).input_ids[48:]) for r in reqs}) == 12


def test_prefix_repetition_shares_each_prefix_among_its_prompts(tok):
    """vLLM's prefix_repetition: 3 prefixes of 40 tokens over 10 prompts (4, 3, 3), each prompt
    exactly 40 + 24 tokens, shuffled by the seed; the CLI's flags reach the workload."""
    w = Workload("prefix_repetition", num_prompts=10, seed=3, prefix_repetition=(40, 24, 3, 5))
    reqs = sample_requests(w, tok)
    assert all(r.prompt_len == 64 == count_tokens(tok, r.prompt) and r.expected_output_len == 5 for r in reqs)
    heads = [tuple(tok(r.prompt).input_ids[:40]) for r in reqs]
    assert sorted(heads.count(h) for h in set(heads)) == [3, 3, 4]
    assert len({r.prompt for r in reqs}) == 10
    assert heads != sorted(heads, key=heads.index)   # shuffled, not grouped by prefix
    assert [r.prompt for r in sample_requests(w, tok)] == [r.prompt for r in reqs]
    with pytest.raises(UserInputError, match="at least 1"):
        Workload("prefix_repetition", prefix_repetition=(40, 24, 0, 5))


def test_sharegpt_first_turns_filtered_and_shuffled(tok, tmp_path):
    long = "word " * 1200
    data = [{"conversations": [{"from": "human", "value": f"Question number {i} about something?"},
                               {"from": "gpt", "value": f"An answer {i} that is long enough to count."}]}
            for i in range(6)]
    data += [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "a fine long answer"}]},
             {"conversations": [{"from": "human", "value": long}, {"from": "gpt", "value": "a fine long answer"}]},
             {"conversations": [{"from": "human", "value": "only one turn here"}]}, {"id": 3}]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    reqs = sample_requests(Workload("sharegpt", str(path), num_prompts=6, seed=0), tok)
    assert sorted(r.prompt for r in reqs) == sorted(f"Question number {i} about something?" for i in range(6))
    assert [r.prompt for r in reqs] != [f"Question number {i} about something?" for i in range(6)]   # shuffled
    assert all(r.expected_output_len == len(tok(f"An answer {r.prompt.split()[2]} that is long enough to count.",
                                                add_special_tokens=False).input_ids) for r in reqs)
    fixed = sample_requests(Workload("sharegpt", str(path), num_prompts=8, sharegpt_output_len=5), tok)
    assert len(fixed) == 8 and {r.expected_output_len for r in fixed} == {5}       # repeated to --num-prompts
    path.write_text("{not json")
    with pytest.raises(DataError, match="not a ShareGPT"):
        sample_requests(Workload("sharegpt", str(path)), tok)


def test_spec_bench_keeps_first_turns_and_categories(tok, shared_data):
    reqs = sample_requests(Workload("spec_bench", num_prompts=480, spec_bench_output_len=32), tok)
    rows = [json.loads(line) for line in (shared_data / "spec-bench" / "question.jsonl").read_text().splitlines()]
    first = {r["turns"][0]: r["category"] for r in rows}
    assert len(reqs) == 480 and all(first[r.prompt] == r.category for r in reqs)
    assert len({r.category for r in reqs}) == 13 and {r.expected_output_len for r in reqs} == {32}
    math = sample_requests(Workload("spec_bench", num_prompts=5, spec_bench_category="math"), tok)
    assert {r.category for r in math} == {"math"}
    with pytest.raises(UserInputError, match="not in"):
        sample_requests(Workload("spec_bench", spec_bench_category="poetry"), tok)


def test_prompts_file_text_and_jsonl(tok, tmp_path):
    txt = tmp_path / "p.txt"
    txt.write_text("first prompt\n\nsecond prompt\n")
    reqs = sample_requests(Workload("prompts", str(txt), custom_output_len=9), tok)
    assert [r.prompt for r in reqs] == ["first prompt", "second prompt"] and reqs[0].expected_output_len == 9
    assert reqs[1].prompt_len == count_tokens(tok, "second prompt")
    jl = tmp_path / "p.jsonl"
    jl.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    assert [r.prompt for r in sample_requests(Workload("custom", str(jl), num_prompts=3), tok)] == ["a", "b", "a"]
    jl.write_text('{"text": "a"}\n')
    with pytest.raises(DataError, match="prompt"):
        sample_requests(Workload("prompts", str(jl)), tok)
    with pytest.raises(UserInputError, match="needs --dataset-path"):
        Workload("prompts")
    with pytest.raises(UserInputError, match="--dataset-name"):
        Workload("sonnet")
