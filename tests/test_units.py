"""llmopt.units: the one byte-size parser (vLLM's letters, SI and IEC units) and the token-count
parser, against values computed by hand."""

import pytest

from llmopt.errors import UserInputError
from llmopt.units import parse_bytes, parse_list, parse_tokens


@pytest.mark.parametrize("text,expected", [
    ("1073741824", 1073741824), (" 512 ", 512), ("512B", 512), (4096, 4096),
    # powers of 10, spelled out, any case
    ("8KB", 8_000), ("8kB", 8_000), ("8MB", 8_000_000), ("8mb", 8_000_000), ("8GB", 8_000_000_000),
    ("8Gb", 8_000_000_000), ("2TB", 2_000_000_000_000), ("1.5GB", 1_500_000_000), ("8 GB", 8_000_000_000),
    # powers of 2, spelled out, any case
    ("8KiB", 8_192), ("8kib", 8_192), ("8MiB", 8_388_608), ("8GiB", 8_589_934_592), ("8gib", 8_589_934_592),
    ("2TiB", 2_199_023_255_552), ("1.5GiB", 1_610_612_736), ("0.5KiB", 512),
    # vLLM's letters: lower case powers of 10 (decimals allowed), upper case powers of 2
    ("8k", 8_000), ("8m", 8_000_000), ("8g", 8_000_000_000), ("2t", 2_000_000_000_000),
    ("25.6k", 25_600), ("1.5g", 1_500_000_000), ("1.001k", 1_001), ("1.0005k", 1_000),
    ("8K", 8_192), ("8M", 8_388_608), ("8G", 8_589_934_592), ("2T", 2_199_023_255_552),
])
def test_sizes(text, expected):
    assert parse_bytes(text) == expected


def test_2g_is_decimal_and_2G_binary():
    """The meaning that changed for `generate --kv-cache-memory` (2g was 2 GiB there)."""
    assert parse_bytes("2g") == 2 * 10 ** 9 and parse_bytes("2G") == 2 * 2 ** 30 == parse_bytes("2GiB")


@pytest.mark.parametrize("text,fragment", [
    ("1.5G", "whole numbers"), ("1.5K", "whole numbers"), ("1.5", "whole number"), ("1.5B", "whole number"),
    ("8X", "unknown unit"), ("8Gi", "unknown unit"), ("8 gigs", "unknown unit"), ("", "bad size"),
    ("-8G", "bad size"), ("G", "bad size"), ("1e9", "bad size"), ("0", "positive"), ("0G", "positive"),
    ("0.0001k", "positive"), (0, "positive"), (True, "bad size"),
])
def test_bad_sizes(text, fragment):
    with pytest.raises(UserInputError) as e:
        parse_bytes(text)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_size_error_names_the_flag():
    with pytest.raises(UserInputError, match="--kv-cache-memory"):
        parse_bytes("lots", "--kv-cache-memory")


@pytest.mark.parametrize("text,expected", [("4096", 4096), ("2k", 2048), ("2K", 2048), ("32k", 32768),
                                           ("1m", 1 << 20), ("1.5k", 1536), (" 8k ", 8192), (7, 7)])
def test_tokens(text, expected):
    assert parse_tokens(text) == expected


@pytest.mark.parametrize("text", ["1.3k", "abc", "0", "2g", "-1", "1.5"])
def test_bad_tokens(text):
    with pytest.raises(UserInputError):
        parse_tokens(text, "--max-model-len")


def test_token_lists():
    assert parse_list("1,8,32", "--batch-sizes") == [1, 8, 32]
    assert parse_list("2k, 8k,", "--seq-lens") == [2048, 8192]
    with pytest.raises(UserInputError):
        parse_list(",", "--seq-lens")


def _find(obj, key):
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        obj = list(obj.values())
    if isinstance(obj, list):
        for v in obj:
            found = _find(v, key)
            if found is not None:
                return found
    return None


def test_commands_read_kv_cache_memory_with_the_one_parser():
    """kv-estimate and generate give --kv-cache-memory the same meaning (vLLM's)."""
    import json
    from typer.testing import CliRunner
    from llmopt.cli.app import app
    run = CliRunner().invoke
    base = ["kv-estimate", "--model", "Qwen/Qwen2.5-7B", "--max-model-len", "4096", "--json"]
    for text, expected in [("2g", 2 * 10 ** 9), ("2G", 2 << 30), ("2GB", 2 * 10 ** 9), ("2GiB", 2 << 30)]:
        r = run(app, base + ["--kv-cache-memory", text])
        assert r.exit_code == 0, r.output
        assert _find(json.loads(r.stdout), "available_bytes") == expected, text
    for args in (base + ["--kv-cache-memory", "1.5G"], ["generate", "--kv-cache-memory", "1.5G", "--quiet", "hi"]):
        r = run(app, args)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.exit_code == 2 and len(lines) == 1 and "bad --kv-cache-memory '1.5G'" in lines[0], r.stderr
