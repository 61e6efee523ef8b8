"""`engine generate`: JSONL in, JSONL out, in order or by id, resumable, clear input errors."""

import json

import pytest
from click.testing import CliRunner

from engine_cli.main import cli


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("llama")


def write_lines(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def run(model, inp, out, *extra):
    return CliRunner().invoke(cli, ["generate", "--model", model, "--input", str(inp), "--output",
                                    str(out), "--max-total-tokens", "2000", "--temperature", "0",
                                    "--max-new-tokens", "6", *extra])


def read(out):
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_writes_one_result_per_line_with_ids_and_resumes(model, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(inp, [{"id": "a", "prompt": "hello"}, {"id": "b", "input_ids": [5, 6, 7]},
                      "a bare string", {"prompt": "with params",
                                        "sampling_params": {"max_new_tokens": 3}}])
    result = run(model, inp, out)
    assert result.exit_code == 0, result.output
    rows = read(out)
    assert sorted(r["id"] for r in rows) == ["3", "4", "a", "b"]  # line numbers when no id
    by_id = {r["id"]: r for r in rows}
    assert len(by_id["4"]["output_ids"]) == 3 and len(by_id["a"]["output_ids"]) == 6
    assert "done: 4 requests" in result.output and "tok/s" in result.output

    # interrupted: the last result is lost and a torn line is left behind
    kept = out.read_text().splitlines()[:2]
    out.write_text("\n".join(kept) + "\n" + '{"id": "torn", "te')
    again = run(model, inp, out)
    assert again.exit_code == 0, again.output
    assert "resuming: 2 of 4 already in" in again.output and "done: 2 requests" in again.output
    rows2 = read(out)
    assert [r["id"] for r in rows2[:2]] == [r["id"] for r in rows[:2]]  # untouched
    assert sorted(r["id"] for r in rows2) == sorted(r["id"] for r in rows)
    assert {r["id"]: r["output_ids"] for r in rows2} == {r["id"]: r["output_ids"] for r in rows}


@pytest.mark.parametrize("line, message", [
    ("{not json", "not valid JSON"),
    ('{"id": 1}', 'no "prompt"'),
    ('{"prompt": "x", "sampling_params": {"temperature": -1}}', "temperature"),
])
def test_bad_input_lines_are_named(model, tmp_path, line, message):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text('{"prompt": "fine"}\n' + line + "\n")
    result = run(model, inp, out)
    assert result.exit_code == 2
    assert "2" in result.output and message in result.output
    assert not out.exists() or out.read_text() == ""


def test_ids_keep_their_json_value_and_7_is_not_seven_in_quotes(model, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(inp, [{"id": 7, "prompt": "a"}, {"id": "7", "prompt": "b"},
                      {"id": [1, "x"], "prompt": "c"}])
    result = run(model, inp, out, "--max-new-tokens", "2")
    assert result.exit_code == 0, result.output
    ids = [r["id"] for r in read(out)]
    assert sorted(ids, key=json.dumps) == sorted([7, "7", [1, "x"]], key=json.dumps)
    again = run(model, inp, out, "--max-new-tokens", "2")  # all done: resumes with nothing
    assert again.exit_code == 0 and "done: 0 requests" in again.output, again.output
    write_lines(inp, [{"id": 7, "prompt": "a"}, {"id": 7, "prompt": "b"}])
    dup = run(model, inp, tmp_path / "out2.jsonl")
    assert dup.exit_code == 2 and "duplicate id 7" in dup.output
