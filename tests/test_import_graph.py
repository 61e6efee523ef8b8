"""The import graph stays a ladder (scripts/import_graph.py): no import cycles, no subpackage
importing a module that depends on it, no product module importing the test kit; and the
script finds each of those in a small tree built to have them."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
import_graph = importlib.util.module_from_spec(spec)
spec.loader.exec_module(import_graph)


def test_the_repository_has_no_cycles_no_arrows_back_up_and_no_test_kit_in_the_product():
    result = import_graph.analyse(import_graph.discover())
    report = import_graph.report(result, counts_only=False)
    assert not result["cycles"] and not result["upward"] and not result["test_kit"], report


def write(root: Path, files: dict[str, str]) -> dict[str, Path]:
    modules = {}
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        parts = Path(rel).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def test_it_finds_each_kind_of_cycle_an_arrow_back_up_and_a_test_kit_import(tmp_path):
    modules = write(tmp_path, {
        "engine/__init__.py": "",
        "engine/a.py": "import engine.b\n",
        "engine/b.py": "def f():\n    from engine import a\n",
        "engine/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                       "    from engine.d import D\n",
        "engine/d.py": "from engine.c import C\n",
        "engine/e.py": "from engine import f\n",
        "engine/f.py": "from . import e\n",
        "engine/runner.py": "from engine.low import shard\n",
        "engine/low/__init__.py": "",
        "engine/low/shard.py": "",
        "engine/low/launch.py": "def start():\n    from engine.runner import run\n",
        "engine/bench.py": "from engine_testing.servers import InProcessServer\n",
        "engine_testing/__init__.py": "",
        "engine_testing/servers.py": "import engine.runner\n",
    })
    result = import_graph.analyse(modules)
    levels = {tuple(c["modules"]): c["level"] for c in result["cycles"]}
    assert levels == {("engine.a", "engine.b"): "function",
                      ("engine.c", "engine.d"): "type-checking",
                      ("engine.e", "engine.f"): "module"}
    [up] = result["upward"]
    assert up["package"] == "engine.low" and up["edge"] == ("engine.low.launch", "engine.runner")
    assert up["back"] == ["engine.runner", "engine.low.shard"]
    assert [t["edge"] for t in result["test_kit"]] == [("engine.bench", "engine_testing.servers")]
    assert import_graph.report(result, counts_only=True) == (
        "import cycles: 3 (module-level 1, function-level 1, type-checking-level 1); arrows back "
        "up: 1; product imports of the test kit: 1")
