"""llmopt.data, the one dataset reader: eval-ppl's --dataset and quantize's --calib-data read the
same file, .jsonl and Hugging Face rules, differing only in the default split (test / train)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmopt import defaults
from llmopt.data import hub_dataset, read_dataset, wikitext_documents
from llmopt.errors import DataError
from llmopt.eval.data import load_text_dataset
from llmopt.quant.calib import read_calibration_text

REPO = Path(__file__).resolve().parents[1]


def both(spec: str, text_field: str = "text") -> tuple[str, str]:
    """The text each command's reader gives for the same source."""
    return load_text_dataset(spec, text_field).text, read_calibration_text(spec, text_field).text


def test_text_file_same_for_both_commands(tmp_path):
    p = tmp_path / "t.txt"
    p.write_bytes("line one\r\nline two\rline thr\u00e9e\n\u2028 tail\n".encode())
    ev, cal = both(str(p))
    assert ev == cal == "line one\nline two\nline thr\u00e9e\n\u2028 tail\n"   # universal newlines, nothing else
    assert load_text_dataset(str(p)).as_stored == p.read_bytes().decode()   # what llama.cpp reads


def test_jsonl_same_for_both_commands_with_text_field(tmp_path):
    p = tmp_path / "d.jsonl"
    rows = [{"q": "first \u2028 question", "text": "a"}, {"q": "second", "n": 3}]
    p.write_text(json.dumps(rows[0]) + "\n\n" + json.dumps(rows[1], ensure_ascii=False) + "\r\n")
    ev, cal = both(str(p), "q")
    assert ev == cal == "first \u2028 question\n\nsecond"
    assert load_text_dataset(str(p), "q").documents == ["first \u2028 question", "second"]


@pytest.mark.parametrize("reader", [load_text_dataset, read_calibration_text])
def test_bad_utf8_refused_naming_the_byte(tmp_path, reader):
    for name in ("bad.txt", "bad.jsonl"):
        p = tmp_path / name
        p.write_bytes(b'{"text": "caf\xe9"}\n' if name.endswith("jsonl") else b"ok text \xff more")
        with pytest.raises(DataError) as e:
            reader(str(p))
        msg = str(e.value)
        assert "not UTF-8" in msg and "\n" not in msg
        assert ("byte 13: 0xe9" if name.endswith("jsonl") else "byte 8: 0xff") in msg, msg


@pytest.mark.parametrize("reader", [load_text_dataset, read_calibration_text])
@pytest.mark.parametrize("line2,fragment", [
    ('{"text": 5}', "field 'text' is a int, not a string"),
    ('{"text": null}', "field 'text' is a NoneType, not a string"),
    ('{"body": "x"}', "has no field 'text' (fields: body)"),
    ('"just a string"', "is a JSON str, not an object"),
    ('{"text": "x"', "is not valid JSON"),
])
def test_bad_jsonl_rows_refused_naming_the_line(tmp_path, reader, line2, fragment):
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "fine", "other": "first string"}\n\n' + line2 + "\n")
    with pytest.raises(DataError) as e:
        reader(str(p))
    assert f"{p}:3" in str(e.value) and fragment in str(e.value), str(e.value)


def test_default_split_per_command():
    assert defaults.PPL_SPLIT == "test" and defaults.CALIB_SPLIT == "train"
    assert hub_dataset("wikitext:wikitext-2-raw-v1", defaults.PPL_SPLIT).split == "test"
    assert hub_dataset("wikitext:wikitext-2-raw-v1", defaults.CALIB_SPLIT).split == "train"
    assert hub_dataset("wikitext:wikitext-2-raw-v1:", "train").split == "train"
    h = hub_dataset("org/data::validation", "train")
    assert (h.path, h.config, h.split) == ("org/data", None, "validation")
    h = hub_dataset("org/data", "test")
    assert (h.path, h.config, h.split) == ("org/data", None, "test")
    with pytest.raises(DataError):
        hub_dataset(":cfg:test", "test")


def test_each_command_asks_the_hub_reader_for_its_split(monkeypatch):
    """What each command passes to datasets.load_dataset (a stand-in: nothing is downloaded)."""
    import datasets
    calls = []

    def fake_load_dataset(path, name=None, split=None):
        calls.append((path, name, split))
        return [{"text": f"{split} row", "n": 1}, {"text": "", "n": 2}, {"text": "more", "n": 3}]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    ev = load_text_dataset("org/corpus:cfg")
    cal = read_calibration_text("org/corpus:cfg")
    assert calls == [("org/corpus", "cfg", "test"), ("org/corpus", "cfg", "train")]
    assert ev.text == "test row\n\n\n\nmore" and cal.text == "train row\n\n\n\nmore"
    assert read_calibration_text("org/corpus::validation").text.startswith("validation row")
    assert calls[-1] == ("org/corpus", None, "validation")
    with pytest.raises(DataError) as e:        # a non-string column is refused, naming the row
        load_text_dataset("org/corpus", text_field="n")
    assert "org/corpus row 0: field 'n' is a int" in str(e.value)


def test_shared_data_folder_found_from_any_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)          # ../shared/data is not beside tmp_path: found from the project root
    assert not Path(defaults.CALIB_DATA).exists()
    cal = read_calibration_text(defaults.CALIB_DATA)
    ref = (REPO / defaults.CALIB_DATA).read_bytes().decode("utf-8").replace("\r\n", "\n")
    assert cal.text == ref
    assert load_text_dataset(defaults.CALIB_DATA).text == ref
    assert load_text_dataset(None).name == str(REPO / defaults.PPL_DATASET)


@pytest.mark.parametrize("reader", [load_text_dataset, read_calibration_text])
def test_missing_empty_and_folder_sources(tmp_path, reader):
    (tmp_path / "empty.txt").write_text(" \n")
    for spec, fragment in [(str(tmp_path / "missing.txt"), "not found"), (str(tmp_path), "is a folder"),
                           (str(tmp_path / "empty.txt"), "is empty"), ("a:b:c:d", "not found")]:
        with pytest.raises(DataError) as e:
            reader(spec)
        assert fragment in str(e.value) and "\n" not in str(e.value)


def test_hub_wikitext_rows_regrouped_into_pages(monkeypatch):
    import datasets
    texts = ["", " = A = \n", "", " x y \n", " = = S = = \n", " = B = \n", " z \n"]
    monkeypatch.setattr(datasets, "load_dataset", lambda path, name=None, split=None: [{"text": t} for t in texts])
    d = read_dataset("wikitext:wikitext-2-raw-v1", "text", "test")
    assert d.documents == [" = A = \n x y \n = = S = = ", " = B = \n z \n"]
    assert d.text == "\n\n".join(texts)  # the GPTQ / HF-guide stream
    assert read_dataset("other", "text", "test").documents == [" = A = \n", " x y \n", " = = S = = \n", " = B = \n",
                                                               " z \n"]
    assert wikitext_documents("no headings") == ["no headings"]
