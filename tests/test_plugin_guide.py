"""docs/plugins.md cannot rot: every hook has a section, and every marked example is extracted,
registered on a fresh plugin manager and exercised, and installed as a throwaway distribution
that the real `engine` command line must see."""

import json
import os
import re
import shutil
import subprocess
import sys
import types
from types import SimpleNamespace

import click
import pytest
import torch
from click.testing import CliRunner

import engine.plugins as plugins
from engine import hookimpl, hookspecs
from engine.contract import contract_problem
from engine.plugins import load_plugins, registries_with

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUIDE = os.path.join(ROOT, "docs", "plugins.md")
ENGINE = os.path.join(os.path.dirname(sys.executable), "engine")
EXAMPLE_RE = re.compile(r"<!-- example: (\w+) -->\n```python\n(.*?)```", re.S)


def guide() -> str:
    with open(GUIDE) as f:
        return f.read()


def examples() -> dict[str, str]:
    return dict(EXAMPLE_RE.findall(guide()))


def hook_sections() -> dict[str, str]:
    """Each hook spec -> the text of the "### " section whose heading names it."""
    out = {}
    for section in guide().split("\n### ")[1:]:
        heading = section.split("\n", 1)[0]
        for hook in re.findall(r"`(\w+)\(", heading):
            out[hook] = section
    return out


def hook_names() -> list[str]:
    return [n for n in dir(hookspecs) if hasattr(getattr(hookspecs, n), "engine_spec")]


def load(name: str) -> types.ModuleType:
    module = types.ModuleType(f"guide_{name}")
    exec(compile(examples()[name], f"docs/plugins.md example {name}", "exec"), module.__dict__)
    return module


def test_every_hook_has_a_section_with_a_runnable_example_or_a_placeholder():
    sections, found = hook_sections(), examples()
    assert set(hook_names()) <= set(sections), "hooks without a section in docs/plugins.md"
    for hook in hook_names():
        names = re.findall(r"<!-- example: (\w+) -->", sections[hook])
        if not names:  # an interface being rewritten: its example comes later, and runs then
            assert "<!-- lead:" in sections[hook], f"{hook}: no example and no placeholder"
            continue
        assert any(f"def {hook}(" in found[n] for n in names), f"{hook}: example misses it"


@pytest.mark.parametrize("name", sorted(examples()))
def test_each_example_registers_cleanly_and_declares_this_contract(name):
    module = load(name)
    assert contract_problem(module.ENGINE_HOOKS_VERSION) is None
    registries_with(module)  # check_pending (hook names, arguments) and no hook raising


# -- what each example registers, exercised ---------------------------------------------------
def exercise_attention(module, cpu_device, tiny_model_factory):
    from engine_testing.attention import backend_matches_torch_native

    _, regs = registries_with(module)
    for page_size in (1, 4):
        backend_matches_torch_native(regs.attention.get("looped").obj, (4, 2, 8), page_size)


def exercise_select(module, cpu_device, tiny_model_factory):
    class Other:  # a plugin registered before it, whose answer it must pre-empt
        @hookimpl
        def select_attention_backend(self, device, model_config, kv_dtype, page_size,
                                     registries, dtype):
            return "looped"

    pm, regs = registries_with(load("attention"), Other(), module)
    ask = dict(device=cpu_device, model_config=None, kv_dtype="auto", page_size=None,
               registries=regs)
    assert pm.hook.select_attention_backend(**ask, dtype="float32") == "torch_native"
    assert pm.hook.select_attention_backend(**ask, dtype="bfloat16") == "looped"


def exercise_kv_dtype(module, cpu_device, tiny_model_factory):
    from engine.memory.kv_pool import KVPool

    _, regs = registries_with(module)
    kv = regs.kv_dtypes.get("int8_fixed").obj
    pool = KVPool(1, 2, 8, 16, kv.storage, kv_dtype=kv)
    k, v = torch.randn(2, 3, 2, 8, generator=torch.Generator().manual_seed(0)).clamp(-7.5, 7.5)
    loc = torch.tensor([3, 5, 9])
    pool.set_kv(0, loc, k, v)
    assert pool.k_buffer[0].dtype == torch.int8
    k2, v2 = pool.get_kv(0, loc, torch.float32)
    torch.testing.assert_close(k2, k, atol=module.STEP / 2, rtol=0)
    torch.testing.assert_close(v2, v, atol=module.STEP / 2, rtol=0)


def exercise_quant(module, cpu_device, tiny_model_factory):
    from engine.runner import ModelRunner
    from engine.quality import prefill_logits

    _, regs = registries_with(module)
    method = regs.quantization.get("int8_weight_only").obj
    runners = [ModelRunner(tiny_model_factory(), registries=regs, device=cpu_device,
                           dtype="float32", quant_method=m) for m in (None, method)]
    swapped = [m for m in runners[1].model.modules()
               if isinstance(m, module.Int8WeightOnlyLinear)]
    assert swapped and all(m.weight.dtype == torch.int8 for m in swapped)
    for runner in runners:
        runner.init_kv_pool(256)
    ref, ours = (prefill_logits(r, [[1, 2, 3, 4, 5], [7, 8, 9]]) for r in runners)
    assert not torch.equal(ours, ref)  # really quantized, and still close
    torch.testing.assert_close(ours, ref, atol=0.05, rtol=0.05)


def exercise_policy(module, cpu_device, tiny_model_factory):
    _, regs = registries_with(module)
    policy = regs.policies.get("shortest_first").obj(None)
    waiting = [SimpleNamespace(prompt_ids=[0] * n, arrival=a)
               for a, n in [(0, 9), (1, 2), (2, 5), (3, 2)]]
    assert [r.arrival for r in policy.order(waiting, lambda r: 0)] == [1, 3, 2, 0]
    with registered_globally(module):  # a real engine, scheduled by it
        from engine import Engine

        engine = Engine(tiny_model_factory(), device="cpu", max_total_tokens=256,
                        schedule_policy="shortest_first")
        out = engine.generate(["one two three four", "five"], {"max_new_tokens": 3,
                                                               "ignore_eos": True})
    assert isinstance(engine.scheduler.policy, module.ShortestFirst)
    assert [len(o["output_ids"]) for o in out] == [3, 3]


def exercise_routing(module, cpu_device, tiny_model_factory):
    from engine.router.policy import ReplicaView, RouterOptions

    _, regs = registries_with(module)
    policy = regs.routing.get("prefix_hash").obj(RouterOptions(dp_size=3))
    live = [ReplicaView(0, 4), ReplicaView(1, 0), ReplicaView(2, 9)]
    texts = [f"system prompt {i}: " + "x" * 80 for i in range(30)]
    picks = [policy.choose(t, live) for t in texts]
    assert set(picks) == {0, 1, 2}  # spread over the replicas
    assert [policy.choose(t + " and more", live) for t in texts] == picks  # sticky by prefix
    policy.remove(2)
    assert {policy.choose(t, live[:2]) for t in texts} <= {0, 1}


def exercise_model(module, cpu_device, tiny_model_factory, tmp_path_factory=None):
    from engine.registry import EngineError
    from engine.runner import ModelRunner
    from engine.quality import prefill_logits

    llama = tiny_model_factory()
    aquila = str(tmp_path_factory.mktemp("aquila"))
    shutil.copytree(llama, aquila, dirs_exist_ok=True)
    with open(os.path.join(aquila, "config.json")) as f:
        config = json.load(f)
    config["architectures"] = ["AquilaForCausalLM"]
    with open(os.path.join(aquila, "config.json"), "w") as f:
        json.dump(config, f)
    _, plain = registries_with()
    with pytest.raises(EngineError, match="AquilaForCausalLM"):
        ModelRunner(aquila, registries=plain, device=cpu_device, dtype="float32")
    _, regs = registries_with(module)
    runners = [ModelRunner(p, registries=r, device=cpu_device, dtype="float32")
               for p, r in ((llama, plain), (aquila, regs))]
    for runner in runners:
        runner.init_kv_pool(256)
    ref, ours = (prefill_logits(r, [[1, 2, 3]]) for r in runners)
    torch.testing.assert_close(ours, ref)


def exercise_serve_option(module, cpu_device, tiny_model_factory):
    from engine.interfaces import AttentionLayerSpec, BackendContext
    from engine.memory.kv_pool import KVPool

    _, regs = registries_with(module)
    assert [(p, o.flag, o.dest) for p, o in regs.serve_options] == [
        ("plugin-0", "--tagged-label", "tagged_label")]
    ctx = BackendContext(KVPool(1, 2, 8, 16, torch.float32), [AttentionLayerSpec(2, 2, 8, 0.3)],
                         "cpu", torch.float32, options={"tagged_label": "blue"})
    assert regs.attention.get("tagged").obj(ctx).label == "blue"


def exercise_command(module, cpu_device, tiny_model_factory):
    pm, _ = registries_with(module)
    group = click.Group("engine")
    pm.hook.register_commands(cli=group)
    result = CliRunner().invoke(group, ["hooks-version"])
    assert result.exit_code == 0 and result.output == (
        f"engine hook contract {hookspecs.ENGINE_HOOKS_VERSION}\n")


def exercise_observers(module, cpu_device, tiny_model_factory):
    from engine import Engine

    with registered_globally(module):  # the engine calls the observers of its plugin manager
        engine = Engine(tiny_model_factory(), device="cpu", max_total_tokens=256)
        engine.generate(["one two", "three"], {"max_new_tokens": 4, "ignore_eos": True})
    assert module.TOTALS["engines"] == 1
    assert module.TOTALS["steps"] == engine.scheduler.step_no >= 4
    assert module.TOTALS["generated_tokens"] == 8


def exercise_grammar(module, cpu_device, tiny_model_factory):
    from engine import Engine
    from engine.interfaces import Constraint

    _, regs = registries_with(module)
    assert regs.grammar.get("choices").extra["priority"] == -10
    with registered_globally(module):  # a real engine whose outputs it constrains
        engine = Engine(tiny_model_factory(), device="cpu", max_total_tokens=256,
                        grammar_backend="choices")
    reqs = engine.add_request("pick one", {"max_new_tokens": 30, "temperature": 1.0, "n": 3,
                                           "seed": 0},
                              constraint=Constraint("choice", '["yes", "no"]', "guided_choice"))
    while not all(r.finished for r in reqs):
        engine.step()
    assert {engine.output(r)["text"] for r in reqs} <= {"yes", "no"}
    assert [r.finish_reason for r in reqs] == ["stop"] * 3


def exercise_parallel(module, cpu_device, tiny_model_factory):
    """Picked by name, then joined by one rank in this process (the installed guide runs it
    with two ranks through `engine generate --tp-size 2`, below)."""
    import torch.distributed as dist

    from engine.registry import resolve_parallel_strategy

    _, regs = registries_with(module)
    strategy = resolve_parallel_strategy(regs, "gloo_timed", cpu_device).obj
    assert not dist.is_initialized()
    strategy.init_rank(0, 1, dist.HashStore(), 30)
    try:
        x = torch.ones(3)
        dist.all_reduce(x)
        assert dist.get_backend() == "gloo" and x.tolist() == [1.0, 1.0, 1.0]
    finally:
        dist.destroy_process_group()


def exercise_linear_kernel(module, cpu_device, tiny_model_factory):
    """Picked for a bfloat16 model's linears on a CPU (the only kernel for them in these
    registries), named in the log, and the model's logits are those of the core's path."""
    from engine.runner import ModelRunner
    from engine.quality import prefill_logits

    _, regs = registries_with(module)
    assert regs.linear_kernels.get("bf16_torch").extra["weight_dtype"] == "bfloat16"
    runners = []
    for r in (regs, None):  # None: no plugin kernels, the core's bfloat16 F.linear
        runner = ModelRunner(tiny_model_factory(), registries=r or registries_with()[1],
                             device=cpu_device, dtype="bfloat16")
        runner.init_kv_pool(256)
        runners.append(runner)
    assert "bfloat16 weights, bf16_torch kernel" in runners[0].linear_kernel
    assert "F.linear" in runners[1].linear_kernel
    ours, core = (prefill_logits(r, [[1, 5, 9, 13]]).float() for r in runners)
    assert (ours - core).abs().max() <= 0.03 * max(1.0, core.abs().max().item())


def exercise_tool_parser(module, cpu_device, tiny_model_factory):
    """Streamed in every split and read whole, the calls and the content are the same; a
    malformed call is content."""
    from engine.parsers import ToolCalls

    _, regs = registries_with(module)
    factory = regs.tool_parsers.get("xml_call").obj
    tools = [{"type": "function", "function": {"name": "f"}}]
    text = 'Hi <call name="f">{"a": 1}</call> <call name="g">{}</call>'
    for i in range(len(text) + 1):
        calls = ToolCalls(factory(tools))
        deltas = calls.feed(text[:i]) + calls.feed(text[i:]) + calls.finish()
        content, made = calls.result()
        assert [(c.name, c.arguments) for c in made] == [("f", '{"a": 1}')]
        assert content == 'Hi  <call name="g">{}</call>'
        streamed = "".join(d.get("content", "") for d in deltas)
        assert streamed == content and "<call name=\"f\"" not in streamed


def exercise_reasoning_parser(module, cpu_device, tiny_model_factory):
    _, regs = registries_with(module)
    factory = regs.reasoning_parsers.get("answer_line").obj
    text = "2 and 2 make 4.ANSWER: 4"
    for i in range(len(text) + 1):
        parser = factory(True)
        parts = [parser.feed(text[:i]), parser.feed(text[i:]), parser.finish()]
        assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == (
            "2 and 2 make 4.", " 4")
    assert factory(False).feed(text) == ("", text)


def exercise_drafter(module, cpu_device, tiny_model_factory):
    """Through an Engine: drafts verified (every one, the policy taken out), outputs those of
    decoding without them."""
    from engine import Engine

    model = tiny_model_factory("llama")
    prompt = [5, 9, 12, 7, 5, 9, 12, 7, 5, 9, 12, 7, 5]
    params = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    plain = Engine(model, max_total_tokens=500).generate(input_ids=prompt,
                                                         sampling_params=params)
    with registered_globally(module):
        engine = Engine(model, max_total_tokens=500, speculative_algorithm="BIGRAM")
        spec = engine.scheduler.spec
        spec.policy.lengths = lambda reqs, drafts: [len(d.tokens) for d in drafts]
        out = engine.generate(input_ids=prompt, sampling_params=params)
    assert out["output_ids"] == plain["output_ids"]
    assert spec.stats.drafted > 0


def exercise_hicache_dict(module, cpu_device, tiny_model_factory):
    """Through two Engines: the first's pages reach the store in the background, the second
    (a restart) serves the prefix from it, with the same output."""
    from engine import Engine

    model = tiny_model_factory("llama")
    prompt = [(7 * i) % 200 + 5 for i in range(150)]
    params = {"temperature": 0, "max_new_tokens": 4}
    flags = dict(max_total_tokens=400, enable_hierarchical_cache=True,
                 hicache_storage_backend="dict", hicache_storage_prefetch_policy="wait_complete")
    with registered_globally(module):
        first = Engine(model, **flags)
        out = first.generate(input_ids=prompt, sampling_params=params)
        first.close()  # the queued pages are written first
        assert len(module.STORE) == 4  # four pages of 32 tokens
        again = Engine(model, **flags).generate(input_ids=prompt, sampling_params=params)
    assert again["output_ids"] == out["output_ids"]
    assert again["meta_info"]["cached_tokens"] == 128


EXERCISES = {name[len("exercise_"):]: fn for name, fn in globals().items()
             if name.startswith("exercise_")}


class registered_globally:
    """The example on the process-wide plugin manager, with the registries rebuilt, for as long
    as the block runs (the Engine reads those)."""

    def __init__(self, module):
        self.module = module

    def __enter__(self):
        self.saved = plugins._registries
        load_plugins().register(self.module, name=self.module.__name__)
        plugins._registries = None

    def __exit__(self, *exc):
        load_plugins().unregister(name=self.module.__name__)
        plugins._infos.pop(self.module.__name__, None)
        plugins._registries = self.saved


def test_every_example_is_exercised():
    assert set(examples()) == set(EXERCISES), (
        "add an exercise_<name> for each example in docs/plugins.md (and nothing else)")


@pytest.mark.parametrize("name", sorted(EXERCISES))
def test_example_works(name, cpu_device, tiny_model_factory, tmp_path_factory,
                       single_torch_thread):
    fn = EXERCISES[name]
    extra = {"tmp_path_factory": tmp_path_factory} if name == "model" else {}
    fn(load(name), cpu_device, tiny_model_factory, **extra)


# -- all of them installed as one throwaway distribution, seen by the real command line -------
@pytest.fixture(scope="module")
def installed_guide(tmp_path_factory):
    where = tmp_path_factory.mktemp("guide-dist")
    dist = where / "engine_guide_examples-0.0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: engine-guide-examples\n"
                                   "Version: 0.0.0\n")
    lines = ["[engine]"]
    for name, code in examples().items():
        (where / f"engine_guide_{name}.py").write_text(code)
        lines.append(f"guide_{name} = engine_guide_{name}")
    (dist / "entry_points.txt").write_text("\n".join(lines) + "\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(where), *filter(None, [os.environ.get("PYTHONPATH")])])}

    def run(*args, stderr=False):
        out = subprocess.run([ENGINE, *args], capture_output=True, text=True, env=env,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout + out.stderr if stderr else out.stdout

    return run


def test_installed_examples_are_listed_and_available(installed_guide):
    data = json.loads(installed_guide("plugins", "--json"))
    assert not [e for e in data["errors"] if e["dist"] == "engine-guide-examples"]
    assert not data["incompatible"]
    for key, name in [("attention", "looped"), ("attention", "tagged"), ("kv_dtypes",
                      "int8_fixed"), ("quantization", "int8_weight_only"),
                      ("policies", "shortest_first"), ("routing", "prefix_hash"),
                      ("parallel", "gloo_timed"),
                      ("models", "AquilaForCausalLM")]:
        row = next(r for r in data[key] if r["name"] == name)
        assert row["dist"] == "engine-guide-examples" and row["available"], row
    hooks = {p["name"]: p["hooks"] for p in data["plugins"]}
    assert hooks["guide_observers"] == ["engine_started", "step_finished"]
    assert hooks["guide_select"] == ["select_attention_backend"]


def test_installed_serve_option_and_command_reach_the_command_line(installed_guide):
    help_text = installed_guide("serve", "--help")
    assert "--tagged-label" in help_text and "guide_serve_option" in help_text
    assert installed_guide("hooks-version") == (
        f"engine hook contract {hookspecs.ENGINE_HOOKS_VERSION}\n")


def test_installed_parallel_strategy_runs_two_ranks(installed_guide, tiny_model_factory, tmp_path):
    """Both ranks (this engine's and the worker it starts) load the plugin and join with it."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps({"id": "a", "prompt": "hello", "sampling_params": {
        "max_new_tokens": 3, "ignore_eos": True}}) + "\n")
    log = installed_guide("generate", "--model", tiny_model_factory(), "--device", "cpu",
                          "--input", str(inp), "--output", str(out), "--tp-size", "2",
                          "--parallel-strategy", "gloo_timed", "--max-total-tokens", "256",
                          "--dist-timeout", "60", "--log-level", "info", stderr=True)
    assert len(json.loads(out.read_text())["output_ids"]) == 3
    assert "gloo_timed: rank 0 of 2 joined" in log and "gloo_timed: rank 1 of 2 joined" in log
