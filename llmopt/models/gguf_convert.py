"""GGUF (llama architecture) -> Hugging Face checkpoint folder: config.json, generation_config.json
and the tokenizer files, cached once per file content (a damaged cached folder is detected and
rebuilt: `cached_conversion`). The cache holds no weights: the engine reads them from the GGUF file
(llmopt.models.gguf_weights). `convert_gguf(..., weights=True)` writes a complete float32
safetensors checkpoint instead, for tools that need one (transformers, lm-eval's `hf` model)."""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from pathlib import Path

import numpy as np


from llmopt.errors import ModelLoadError, UserInputError
from llmopt.fsutil import (MARKER, apply_umask, clean_stale, file_sha256, replace_folder, temp_path, write_atomic,
                           write_marker)
from llmopt.models.config import gguf_hf_config
from llmopt.models.gguf_file import read_header
from llmopt.models.gguf_weights import ROPE_FREQS, iter_float_weights

CONVERTER_VERSION = 5   # 3: keyed by the GGUF's content, manifest in llmopt.json; 4: no weights (run as stored);
                        # 5: rope_freqs.weight's factors in the config (Llama 3.x files)

def gguf_config(path: Path) -> dict:
    """The config.json of the converted folder: models/config.py's gguf_hf_config, the mapping
    kv-estimate reads GGUF headers with too."""
    h = read_header(path)
    arch = h.meta.get("general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported: llmopt reads llama-architecture GGUF files")
    d = gguf_hf_config(h.meta, [(t.name, t.shape) for t in h.tensors])
    freqs = next((t for t in h.tensors if t.name == ROPE_FREQS), None)
    if freqs is not None:   # Llama 3.x: llama.cpp's converter stores the llama3 scaling as factors
        if freqs.type_name != "F32" or freqs.shape != (d["head_dim"] // 2,):
            raise ModelLoadError(f"{path.name}: {ROPE_FREQS} must be F32 [{d['head_dim'] // 2}], "
                                 f"not {freqs.type_name} {list(freqs.shape)}")
        raw = np.memmap(path, dtype=np.float32, mode="r", offset=h.data_offset + freqs.offset, shape=freqs.shape)
        d["rope_scaling"] = {"rope_type": "freq_factors", "factors": [float(x) for x in raw]}
    return d


# -- the conversion cache ----------------------------------------------------------------------------
# One folder per GGUF content (copies of a file share it), named by the file's sha256 and
# CONVERTER_VERSION. The sha256 is memoized per (path, size, mtime) in HASH_INDEX, recorded once a
# sound folder exists, so a start does not reread the file. The folder's MANIFEST lists every file
# with its size and sha256, recorded at conversion: each use checks presence and sizes (and the
# small files' hashes), and a damaged entry is converted again with one warning line instead of
# failing every later command.

MANIFEST = MARKER          # llmopt.json: fsutil's "llmopt wrote this" marker, with the file list
HASH_INDEX = "hashes.json"
_HASH_EACH_USE = 16 << 20  # files up to this size are re-hashed on each use (config, tokenizer)
_LEGACY_TMP = re.compile(r"^\..+\.[a-z0-9_]{8}$")   # converter 2's tempfile.mkdtemp leftovers
_OURS = re.compile(r"^\..+\.(tmp|old)\d+$")             # fsutil's PID-named temporaries
_LEGACY_AGE_S = 3600
_OLD_VERSION = re.compile(rf"^gguf-[0-9a-f]+-v(?!{CONVERTER_VERSION}$)\d+$")

log = logging.getLogger("llmopt.models")


def _index(cache_dir: Path) -> dict:
    try:
        index = json.loads((cache_dir / HASH_INDEX).read_text())
        return index if isinstance(index, dict) else {}
    except (OSError, ValueError):
        return {}


def _lookup_hash(path: Path, cache_dir: Path) -> tuple[str, bool]:
    """(sha256 of the file's bytes, whether HASH_INDEX already knew it for this size and mtime)."""
    st = path.stat()
    entry = _index(cache_dir).get(str(path.resolve()))
    if isinstance(entry, dict) and entry.get("size") == st.st_size and entry.get("mtime_ns") == st.st_mtime_ns \
            and isinstance(entry.get("sha256"), str):
        return entry["sha256"], True
    return file_sha256(path), False


def _remember_hash(path: Path, sha: str, cache_dir: Path) -> None:
    """Record a file's hash in HASH_INDEX (one entry per absolute path, vanished files dropped,
    written atomically); a read-only cache just hashes again next time."""
    st = path.stat()
    index = {k: v for k, v in _index(cache_dir).items() if Path(k).exists()}
    index[str(path.resolve())] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha}
    try:
        write_atomic(cache_dir / HASH_INDEX, json.dumps(index, indent=1, sort_keys=True) + "\n")
    except (OSError, UserInputError):
        pass


def _key(sha: str) -> str:
    return f"gguf-{sha[:24]}-v{CONVERTER_VERSION}"


def cache_problem(folder: Path) -> str | None:
    """Why a cached conversion cannot be used (a missing manifest or file, a wrong size or hash), or None."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files = manifest["files"]
        if manifest.get("converter_version") != CONVERTER_VERSION or not isinstance(files, dict) or not files:
            return f"{MANIFEST} is from another converter version"
    except (OSError, ValueError, KeyError, TypeError):
        return f"{MANIFEST} is missing or unreadable"
    for name, rec in sorted(files.items()):
        f = folder / name
        try:
            size = f.stat().st_size
            if size != rec["size"]:
                return f"{name} has {size:,} bytes, {rec['size']:,} expected"
            if size <= _HASH_EACH_USE and file_sha256(f) != rec["sha256"]:
                return f"{name} was modified"
        except (TypeError, KeyError):
            return f"{MANIFEST} is unreadable"
        except OSError:
            return f"{name} is missing or unreadable"
    return None


def _manifest(folder: Path) -> dict:
    return {f.name: {"size": f.stat().st_size, "sha256": file_sha256(f)}
            for f in sorted(folder.iterdir()) if f.is_file() and f.name != MANIFEST}


def _clean_cache_dir(cache_dir: Path) -> None:
    """Leftovers of dead conversions (`.NAME.tmp<PID>`), converter 2's random-named temporaries
    once they are an hour old (a conversion takes minutes; a live one is never that old), and the
    folders of older converter versions."""
    clean_stale(cache_dir)
    now = time.time()
    for p in cache_dir.iterdir():
        try:
            if _LEGACY_TMP.match(p.name) and not _OURS.match(p.name) and p.is_dir() \
                    and now - p.stat().st_mtime > _LEGACY_AGE_S:
                shutil.rmtree(p, ignore_errors=True)
            elif _OLD_VERSION.match(p.name) and p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)   # an older converter's folder (v3's held float weights)
        except OSError:
            continue


def convert_gguf(path: Path, out_dir: Path, progress=None, sha256: str | None = None,
                 weights: bool = False) -> Path:
    """Write `out_dir` and return it: the config and tokenizer (and, with `weights`, the tensors
    dequantized to float32 safetensors, one at a time), built in `.NAME.tmp<PID>` beside it (removed
    on any error, Ctrl-C or SIGTERM; a killed run's is removed by the next start), with the manifest
    and the user's umask, then put in place in one atomic swap (a damaged folder being replaced).
    When a concurrent run has put a sound folder there meanwhile, that one is kept."""
    from types import SimpleNamespace

    cfg = gguf_config(path)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _clean_cache_dir(out_dir.parent)
    tmp = temp_path(out_dir)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        if weights:
            from safetensors.torch import save_file   # deferred: start-up time
            heads = SimpleNamespace(num_attention_heads=cfg["num_attention_heads"],
                                    num_key_value_heads=cfg["num_key_value_heads"])
            tensors = {}
            for name, w in iter_float_weights(path, heads):
                tensors[name] = w
                if progress:
                    progress(1)
            save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            del tensors
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        _convert_tokenizer(path, tmp)
        write_marker(tmp, {"command": "convert-gguf", "converter_version": CONVERTER_VERSION, "gguf": str(path.resolve()),
                           "gguf_sha256": sha256 or file_sha256(path), "weights": weights, "files": _manifest(tmp)})
        apply_umask(tmp)
        if out_dir.exists() and cache_problem(out_dir) is None:
            shutil.rmtree(tmp)          # a concurrent conversion finished first: keep its folder
        else:
            replace_folder(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def cached_conversion(path: Path, cache_dir: Path, progress=None) -> Path:
    """The converted folder of a GGUF under `cache_dir`, converting it when absent or damaged (a
    damaged one is reported with one warning line and rebuilt)."""
    sha, known = _lookup_hash(path, cache_dir)
    out = cache_dir / _key(sha)
    if out.exists() or out.is_symlink():
        problem = cache_problem(out)
        if problem is None:
            if not known:
                _remember_hash(path, sha, cache_dir)
            return out
        log.warning(f"warning: the cached conversion of {path.name} in {out} is damaged ({problem}): converting it again")
    convert_gguf(path, out, progress, sha256=sha)
    _remember_hash(path, sha, cache_dir)
    return out


def _convert_tokenizer(path: Path, dest: Path) -> None:
    from transformers import AutoTokenizer
    import logging
    logging.getLogger("transformers").setLevel(logging.ERROR)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok.save_pretrained(str(dest))
