"""The bundled demo model: the CLI's default, loads, and writes English-like text."""

import re

from click.testing import CliRunner

from engine import Engine
from engine_cli.demo import DEMO_MODEL
from engine_cli.main import cli


def test_serve_and_generate_default_to_the_demo_model():
    for command in ("serve", "generate"):
        help_text = " ".join(CliRunner().invoke(cli, [command, "--help"]).output.split())
        assert "the bundled demo model" in help_text
    param = next(p for p in cli.commands["serve"].params if p.name == "model")
    assert param.default == DEMO_MODEL


def test_demo_model_generates_english_like_text():
    engine = Engine(DEMO_MODEL, max_total_tokens=2048)
    out = engine.generate("The meaning of life is", {"temperature": 0, "max_new_tokens": 24})
    words = re.findall(r"[A-Za-z]+", out["text"])
    assert len(words) >= 4, out["text"]
    known = {"the", "a", "is", "of", "to", "and", "not", "be", "in", "it", "you", "i", "man"}
    assert known & {w.lower() for w in words}, out["text"]
    chat = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}],
                                                add_generation_prompt=True, tokenize=False)
    assert chat.endswith("<|assistant|>\n")
    engine.scheduler.check_invariants()
