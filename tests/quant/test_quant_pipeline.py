"""The layer-by-layer pipeline: what it writes equals the in-memory quantization of the whole model,
the folder is complete, and peak memory does not grow with depth."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from llmopt.errors import UserInputError
from llmopt.models.attention import DenseCausalAttention
from llmopt.models.llama import rope_cos_sin, rope_inv_freq
from llmopt.models.loader import load_model, load_tokenizer
from llmopt.quant.calib import load_calibration
from llmopt.layers.formats import unpack_linear
from llmopt.quant.layerwise import LINEARS, LayerContext, quantize_layer
from llmopt.quant.pipeline import quantize_model
from llmopt.layers.runtime import ct_group_for
from llmopt.quant.config import QuantConfig
from quant_pipeline_util import write_checkpoint

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def tiny(tiny_factory, tmp_path_factory):
    folder = tiny_factory(tokenizer=True, dtype=torch.float16)
    calib = tmp_path_factory.mktemp("calib") / "calib.txt"
    calib.write_text("The quick brown fox jumps over the lazy dog. " * 40 + "Pack my box with five dozen liquor jugs. " * 40)
    return folder, calib


def in_memory(folder: Path, qconfig: QuantConfig) -> dict:
    """The whole float model in memory, quantized layer after layer: name -> dequantized weight."""
    qconfig = qconfig.resolved()
    lm = load_model(str(folder), dtype="float32", device="cpu")
    n = qconfig.num_samples if qconfig.needs_calibration else max(1, qconfig.error_tokens // qconfig.seq_len)
    ids = load_calibration(qconfig.calib_data, load_tokenizer(folder), n, qconfig.seq_len, qconfig.seed).ids
    ctx = LayerContext(*rope_cos_sin(rope_inv_freq(lm.config), torch.arange(qconfig.seq_len), torch.float32),
                       DenseCausalAttention())
    x = F.embedding(ids, lm.model.model.embed_tokens.weight)
    out = {}
    for i, layer in enumerate(lm.model.model.layers):
        res = quantize_layer(layer, x, max(1, qconfig.error_tokens // qconfig.seq_len), ctx, qconfig)
        out.update({f"model.layers.{i}.{k}": qt.dequantize() for k, qt in res.quantized.items()})
        out.update({f"model.layers.{i}.{k}": v for k, v in layer.state_dict().items() if "norm" in k})
        x = res.next_x
    return out


def read_folder(folder: Path) -> dict:
    tensors = {}
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            tensors.update({k: h.get_tensor(k) for k in h.keys()})
    return tensors


@pytest.mark.parametrize("method,fmt,sym", [("rtn", "compressed-tensors", True), ("gptq", "gptq", True),
                                            ("awq", "awq", False), ("int8", "compressed-tensors", True)])
def test_written_checkpoint_equals_in_memory_quantization(tiny, tmp_path, method, fmt, sym):
    folder, calib = tiny
    qconfig = QuantConfig(method=method, bits=8 if method == "int8" else 4, group_size=32, sym=sym, format=fmt,
                     calib_data=str(calib), num_samples=4, seq_len=32, error_tokens=64, awq_search_tokens=64,
                     scale_dtype="float16")
    reports = []
    res = quantize_model(str(folder), tmp_path / "out", qconfig, on_layer=reports.append)
    out = Path(res.output)
    assert [r.layer for r in reports] == [0, 1] and all(r.rel_error > 0 for r in res.layers)
    assert not list(tmp_path.glob(".out.tmp*"))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "model.safetensors.index.json"):
        assert (out / f).is_file(), f
    cfg = json.loads((out / "config.json").read_text())
    qcfg = cfg["quantization_config"]
    assert qcfg["quant_method"] == {"awq": "awq", "gptq": "gptq"}.get(fmt, "compressed-tensors")
    stored = read_folder(out)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(stored)
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= set(stored)
    expected = in_memory(folder, qconfig)
    for i in range(2):
        for lin in LINEARS:
            name = f"model.layers.{i}.{lin}"
            local = {k[len(name) + 1:]: v for k, v in stored.items() if k.startswith(name + ".")}
            group = ct_group_for(qcfg, name) if fmt == "compressed-tensors" else None
            qt = unpack_linear(local, qcfg, group)
            torch.testing.assert_close(qt.dequantize(), expected[name], rtol=0, atol=1e-6, msg=name)
        for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            name = f"model.layers.{i}.{norm}"
            torch.testing.assert_close(stored[name].float(), expected[name].half().float())


def test_bad_group_size_is_one_clear_error(tiny, tmp_path):
    folder, calib = tiny
    with pytest.raises(UserInputError, match="--group-size 48 does not divide"):
        quantize_model(str(folder), tmp_path / "o", QuantConfig(method="rtn", group_size=48, calib_data=str(calib)))
    assert not (tmp_path / "o").exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(UserInputError, match="not empty"):
        quantize_model(str(folder), tmp_path / "full", QuantConfig(method="rtn", group_size=32, calib_data=str(calib)))


PEAK_SCRIPT = textwrap.dedent("""
    import sys, threading, time
    from llmopt.quant.pipeline import quantize_model
    from llmopt.quant.config import QuantConfig

    def rss_anon():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    peak, done = [rss_anon()], []
    def watch():
        while not done:
            peak[0] = max(peak[0], rss_anon())
            time.sleep(0.005)
    threading.Thread(target=watch, daemon=True).start()
    qconfig = QuantConfig(method="rtn", bits=4, group_size=128, calib_data=sys.argv[3], seq_len=16, error_tokens=16)
    quantize_model(sys.argv[1], sys.argv[2], qconfig)
    done.append(1)
    print(max(peak[0], rss_anon()))
""")


def shallow_copy(src: Path, dst: Path, layers: int) -> Path:
    """The first `layers` layers of a checkpoint written one layer per shard, by symlinks."""
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(dict(cfg, num_hidden_layers=layers)))
    index = json.loads((src / "model.safetensors.index.json").read_text())
    keep = {k: f for k, f in index["weight_map"].items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": keep}))
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            (dst / f.name).write_bytes(f.read_bytes())
    for f in set(keep.values()):
        (dst / f).symlink_to(src / f)
    return dst


def test_peak_memory_does_not_grow_with_depth(tmp_path):
    calib = tmp_path / "calib.txt"
    calib.write_text("calibration text for a synthetic model. " * 20)
    deep = write_checkpoint(tmp_path / "m10", hidden=2048, inter=4096, layers=10, heads=16, kv_heads=16)
    layer_bytes = (deep / "model-00001-of-00010.safetensors").stat().st_size
    assert 2 * layer_bytes > 150e6       # bf16 on disk, float32 in memory: a layer dominates the interpreter
    peaks = {}
    for layers, src in ((4, shallow_copy(deep, tmp_path / "m4", 4)), (10, deep)):
        r = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(src), str(tmp_path / f"q{layers}"), str(calib)],
                           capture_output=True, text=True, cwd=TESTS, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        peaks[layers] = int(r.stdout.split()[-1])
        assert len(list((tmp_path / f"q{layers}").glob("model-*.safetensors"))) == layers + 1
    print(peaks)
    assert peaks[10] < 1.5 * peaks[4], peaks   # (growing with depth: ~2x, a float32 layer ~336 MB)


def test_cli_recipe_with_flag_override_and_one_line_errors(tiny, tmp_path):
    from typer.testing import CliRunner
    from llmopt.cli.app import app
    folder, calib = tiny
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"method: rtn\ngroup-size: 16\nformat: gptq\ncalib-data: {calib}\nseq-len: 32\n")
    r = CliRunner().invoke(app, ["quantize", "--model", str(folder), "--recipe", str(recipe), "--group-size", "32",
                                 "--output", str(tmp_path / "out"), "--json", "--quiet"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout.strip().splitlines()[-1])
    assert (d["method"], d["format"], d["group_size"], d["bits"]) == ("rtn", "gptq", 32, 4)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["group_size"] == 32
    r = CliRunner().invoke(app, ["quantize", "--model", str(folder), "--method", "gptq", "--group-size", "48",
                                 "--output", str(tmp_path / "bad"), "--quiet"])
    assert r.exit_code == 2 and "--group-size 48 does not divide" in r.output
    assert not (tmp_path / "bad").exists()


def test_calibration_text_field_from_spec_and_flag(tiny, tmp_path):
    """QuantConfig.text_field picks the .jsonl field the windows come from (the same windows as the
    joined text in a plain file); quantize --text-field sets it; a row without it is refused by line."""
    from typer.testing import CliRunner
    from llmopt.cli.app import app
    from llmopt.quant.pipeline import _calibration
    folder, calib = tiny
    rows = calib.read_text().split(". ")
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text("".join(json.dumps({"q": r, "text": "unused"}) + "\n" for r in rows))
    joined = tmp_path / "joined.txt"
    joined.write_text("\n\n".join(rows))
    qconfig = QuantConfig(method="gptq", calib_data=str(jsonl), text_field="q", num_samples=3, seq_len=16)
    torch.testing.assert_close(_calibration(folder, qconfig), _calibration(folder, QuantConfig(
        method="gptq", calib_data=str(joined), num_samples=3, seq_len=16)), rtol=0, atol=0)
    def cli(data, out):
        return CliRunner().invoke(app, ["quantize", "--model", str(folder), "--method", "rtn", "--group-size", "32",
                                        "--seq-len", "16", "--quiet", "--calib-data", str(data), "--text-field", "q",
                                        "--output", str(tmp_path / out)])
    r = cli(jsonl, "ok")
    assert r.exit_code == 0, r.output
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"q": "fine"}) + "\n" + json.dumps({"q": 7}) + "\n")
    r = cli(bad, "bad")
    assert r.exit_code == 2 and f"{bad}:2: field 'q' is a int, not a string" in r.output, r.output
