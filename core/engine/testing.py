"""Helpers for tests and benchmarks: a tokenizer trained offline on text that ships with Python,
tiny random-init HF models saved as real checkpoints, and a minimal greedy loop over a runner."""

from __future__ import annotations

import codecs
import contextlib
import functools
import importlib
import inspect
import io
import json
import os

import torch

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CORPUS_MODULES = ("os", "json", "re", "collections", "functools", "itertools",
                  "argparse", "logging", "textwrap", "string", "pathlib", "dataclasses",
                  "inspect", "unittest", "subprocess", "shutil", "contextlib", "heapq")
CONFIG_CLASSES = {
    "LlamaForCausalLM": "LlamaConfig", "MistralForCausalLM": "MistralConfig",
    "Qwen2ForCausalLM": "Qwen2Config", "Qwen3ForCausalLM": "Qwen3Config",
}


def corpus() -> list[str]:
    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the Zen
        import this
    texts = [codecs.decode(this.s, "rot13")]
    for name in CORPUS_MODULES:
        module = importlib.import_module(name)
        texts.append(module.__doc__ or "")
        for _, obj in sorted(vars(module).items()):
            doc = inspect.getdoc(obj) if callable(obj) else None
            if doc:
                texts.append(doc)
    return [t for t in texts if t]


@functools.lru_cache(maxsize=None)
def _tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)])
    return tok.to_str()


def train_tokenizer(out_dir: str, vocab_size: int = 512) -> str:
    """Write a byte-level BPE tokenizer (HF PreTrainedTokenizerFast files) into ``out_dir``;
    ids 0, 1, 2 are <s>, </s>, <pad>. Trained once per process and vocab size."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "tokenizer.json"), "w") as f:
        f.write(_tokenizer_json(vocab_size))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
              "pad_token": PAD, "add_bos_token": True, "model_max_length": 4096,
              "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}, f, indent=2)
    return out_dir

# name -> (architecture, config overrides): the cases the HF-equivalence tests cover
TINY_CASES = {
    "llama": ("LlamaForCausalLM", {}),
    "mistral_window": ("MistralForCausalLM", {"sliding_window": 12}),
    "qwen2_bias_window": ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 12,
                                               "max_window_layers": 1}),
    "qwen3_qk_norm": ("Qwen3ForCausalLM", {}),
    "llama_tied": ("LlamaForCausalLM", {"tie_word_embeddings": True}),
    "llama3_rope": ("LlamaForCausalLM", {"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}),
}


def tiny_config_kwargs(arch: str, vocab_size: int = 512) -> dict:
    kw = dict(vocab_size=vocab_size, hidden_size=128, intermediate_size=256,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, initializer_range=0.08, rms_norm_eps=1e-6,
              bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False)
    if arch == "Qwen3ForCausalLM":
        kw["head_dim"] = 48  # != hidden/heads, as in real Qwen3 checkpoints
    return kw


def make_tiny_model(out_dir: str, arch: str = "LlamaForCausalLM", *, seed: int = 0,
                    save_dtype: torch.dtype = torch.float32, **config_overrides) -> str:
    """Save a random-init HF ``arch`` checkpoint (safetensors + tokenizer) in ``out_dir``."""
    import transformers

    kw = {**tiny_config_kwargs(arch, config_overrides.pop("vocab_size", 512)), **config_overrides}
    config = getattr(transformers, CONFIG_CLASSES[arch])(**kw)
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).eval()
    # HF initializes norms to 1 and biases to 0; perturb them so loading them is tested
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * config.initializer_range)
            elif "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
    model.to(save_dtype).save_pretrained(out_dir, safe_serialization=True)
    train_tokenizer(out_dir, config.vocab_size)
    return out_dir


def greedy_generate(runner, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Prefill all prompts in one EXTEND batch, then decode them together; ignores EOS.
    Needs ``runner.init_kv_pool`` first; frees everything it allocated."""
    from engine.forward_batch import ForwardBatch

    pool = runner.kv_pool
    rows = [pool.alloc_req() for _ in prompts]
    assert None not in rows, "not enough request rows"
    lens = [0] * len(prompts)
    new = [list(p) for p in prompts]
    outs: list[list[int]] = [[] for _ in prompts]
    for _ in range(max_new_tokens):
        locs = [pool.extend_slots(r, n, len(x)) for r, n, x in zip(rows, lens, new)]
        assert all(loc is not None for loc in locs), "KV pool too small"
        batch = ForwardBatch.build(new, lens, rows, torch.cat(locs), pool.req_to_token,
                                   device=pool.device)
        next_ids = runner.forward(batch).argmax(-1).tolist()
        lens = [n + len(x) for n, x in zip(lens, new)]
        for out, t in zip(outs, next_ids):
            out.append(t)
        new = [[t] for t in next_ids]
    free_requests(pool, rows, lens)
    return outs


ZEN = ("Now is better than never.", "Flat is better", "Errors should never pass")


def greedy_matches_hf(path: str, registries, attention_factory, cuda_graph: bool = False,
                      device=None, max_new_tokens: int = 12):
    """Greedy decoding of the tiny checkpoint ``path`` through ``attention_factory`` equals HF
    transformers' (float32, eager attention) for three prompts prefilled together, page size
    16. With ``cuda_graph`` every decode step replays the graph runner's size-4 graph (one row
    padding): a real CUDA graph on a CUDA ``device``, else the EagerGraph stand-in. Returns the
    runner."""
    import transformers

    from engine.cuda_graph import EagerGraph
    from engine.device import DeviceInfo
    from engine.runner import ModelRunner

    device = device or DeviceInfo("cpu", "CPU")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    prompts = [tok(t).input_ids for t in ZEN]
    runner = ModelRunner(path, registries=registries, device=device, dtype="float32",
                         attention_factory=attention_factory)
    runner.init_kv_pool(1024, page_size=16)
    if cuda_graph:
        runner.init_cuda_graphs([1, 2, 4], graph_cls=None if device.is_cuda else EagerGraph)
    ours = greedy_generate(runner, prompts, max_new_tokens)
    for p, out in zip(prompts, ours):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False,
                          pad_token_id=2)
        assert out == ref[0, len(p):].tolist()
    if cuda_graph:
        assert runner.cuda_graphs.replays == max_new_tokens - 1 and runner.last_cuda_graph
    return runner


def free_requests(pool, rows: list[int], lens: list[int]) -> None:
    for r, n in zip(rows, lens):
        pool.free_pages(pool.slots_to_pages(pool.req_to_token[r, :n]))
        pool.free_req(r)


def compare_backends_step(pool, backends, rows: list[int], lens: list[int],
                          new_lens: list[int], specs, gen: torch.Generator, tol: float,
                          device="cpu", q_dtype: torch.dtype = torch.float32):
    """One step of attention backends side by side on one pool: requests ``rows`` (holding
    ``lens`` tokens) each bring ``new_lens`` tokens; every layer gets the same random q/k/v
    (``q_dtype``) and each backend's output must equal the last one's (the reference) within
    ``tol``, in dtype and shape too. Returns the batch; the pool keeps the new tokens."""
    from engine.forward_batch import ForwardBatch

    locs = [pool.extend_slots(r, n, e) for r, n, e in zip(rows, lens, new_lens)]
    batch = ForwardBatch.build([[0] * e for e in new_lens], lens, rows, torch.cat(locs),
                               pool.req_to_token, device=device)
    for b in backends:
        b.init_forward_metadata(batch)
    for layer, spec in enumerate(specs):
        q, k, v = (torch.randn(batch.num_tokens, n, spec.head_dim, generator=gen)
                   .to(device, q_dtype)
                   for n in (spec.num_heads, spec.num_kv_heads, spec.num_kv_heads))
        *ours, ref = (b.forward(q, k, v, layer, batch) for b in backends)
        for out in ours:
            assert out.dtype == ref.dtype == q.dtype and out.shape == q.shape
            torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    return batch


def scattered_filler(pool, page_size: int, pages: int = 24):
    """A filler request whose every other page is freed, so that the next requests' pages
    interleave; returns (its row, its pages). Free ``pages[1::2]`` and the row when done."""
    filler = pool.alloc_req()
    held = pool.slots_to_pages(pool.extend_slots(filler, 0, pages * page_size))
    pool.free_pages(held[::2])
    return filler, held


# five requests: prompts (one over two 32-key blocks, one of a single token), two decode steps
# (past a sliding window of 5), then extends over their cached prefixes beside decodes
MIXED_STEPS = ([9, 1, 70, 4, 33], [1] * 5, [1] * 5, [1, 6, 1, 40, 12])
MIXED_MODES = ("extend", "decode", "decode", "mixed")


def run_mixed_steps(pool, backends, specs, gen, tol: float, device="cpu",
                    q_dtype: torch.dtype = torch.float32, step=None) -> None:
    """MIXED_STEPS through ``step`` (default: :func:`compare_backends_step` on ``device`` with
    ``q_dtype`` queries), asserting each batch's mode; frees the requests."""
    if step is None:
        def step(pool, backends, rows, lens, new, specs, gen, tol):
            return compare_backends_step(pool, backends, rows, lens, new, specs, gen, tol,
                                         device, q_dtype)
    rows = [pool.alloc_req() for _ in MIXED_STEPS[0]]
    lens = [0] * len(rows)
    for new, mode in zip(MIXED_STEPS, MIXED_MODES):
        assert step(pool, backends, rows, lens, new, specs, gen, tol).mode.value == mode
        lens = [n + e for n, e in zip(lens, new)]
    free_requests(pool, rows, lens)


def backend_matches_torch_native(make_backend, shape: tuple[int, int, int], page_size: int,
                                 tol: float = 1e-5, device="cpu") -> None:
    """A backend (``make_backend(ctx)``) against torch_native on one float32 pool whose pages
    interleave with a filler's: MIXED_STEPS through a full and a sliding-window (5) layer of
    ``shape`` (heads, KV heads, head dim); everything freed afterwards."""
    from engine.attention.torch_native import TorchNativeBackend
    from engine.interfaces import AttentionLayerSpec, BackendContext
    from engine.memory.kv_pool import KVPool

    H, KVH, D = shape
    specs = [AttentionLayerSpec(H, KVH, D, D ** -0.5), AttentionLayerSpec(H, KVH, D, 0.3, 5)]
    pool = KVPool(len(specs), KVH, D, 1024, torch.float32, device=device, page_size=page_size,
                  max_reqs=8, max_context_len=512)
    ctx = BackendContext(pool, specs, device, torch.float32)
    filler, pages = scattered_filler(pool, page_size)
    run_mixed_steps(pool, (make_backend(ctx), TorchNativeBackend(ctx)), specs,
                    torch.Generator().manual_seed(0), tol, device)
    pool.free_pages(pages[1::2])
    pool.free_req(filler)
    assert pool.free_slots == pool.size


def refill_batch(fixed, new) -> None:
    """What the CUDA-graph runner does before a replay: ``new``'s tensors and host lists into
    the fixed batch ``fixed`` of the same size, in place (tests of a backend's graph methods)."""
    for name in ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "prefix_lens",
                 "extend_lens", "seq_lens", "logits_indices"):
        getattr(fixed, name).copy_(getattr(new, name))
    fixed.prefix_lens_list[:] = new.prefix_lens_list
    fixed.extend_lens_list[:] = new.extend_lens_list


def prefill_logits(runner, prompts: list[list[int]], return_all_logits: bool = False):
    """Logits of one EXTEND batch over ``prompts`` (at each last token, or at every token);
    frees what it allocated. Needs ``runner.init_kv_pool`` first."""
    from engine.forward_batch import ForwardBatch

    pool = runner.kv_pool
    rows = [pool.alloc_req() for _ in prompts]
    locs = torch.cat([pool.extend_slots(r, 0, len(p)) for r, p in zip(rows, prompts)])
    batch = ForwardBatch.build(prompts, [0] * len(prompts), rows, locs, pool.req_to_token)
    logits = runner.forward(batch, return_all_logits)
    free_requests(pool, rows, [len(p) for p in prompts])
    return logits


def assert_close_logits(ours: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """max |ours - ref| <= tol * max(1, max |ref|): a tolerance relative to the logit scale."""
    diff = (ours - ref).abs().max().item()
    assert diff <= tol * max(1.0, ref.abs().max().item()), diff


def compare_prompt_logits(runner, reference, prompts: list[list[int]], tol: float) -> None:
    """Every prompt token's logits from one extend batch of ``prompts`` equal, within ``tol``
    (``assert_close_logits``), those of ``reference`` (an HF causal LM) run on each prompt."""
    every = prefill_logits(runner, prompts, return_all_logits=True)
    start = 0
    with torch.no_grad():
        for p in prompts:
            assert_close_logits(every[start:start + len(p)],
                                reference(torch.tensor([p])).logits[0], tol)
            start += len(p)


def load_float_weight(layer, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """Feed a float ``weight`` [out, in] (and ``bias``) to a quantized layer (RowQuantLinear)
    as the loader would: one tensor per projection when the layer packs several. The caller
    finishes loading."""
    if layer.shards:
        start = 0
        for name, rows in layer.shards.items():
            layer.load_tensor("weight", weight[start:start + rows], name)
            start += rows
    else:
        layer.load_tensor("weight", weight, None)
    if bias is not None:
        layer.load_tensor("bias", bias, None)
    return layer


def dense_state_dict(model) -> dict:
    """``model.state_dict()`` with oneDNN-prepacked weights turned back into plain tensors."""
    return {k: v.to_dense() if v.is_mkldnn else v for k, v in model.state_dict().items()}


def teacher_forced_logits(runner, prompts: list[list[int]], prefill: int) -> torch.Tensor:
    """float32 logits [prompts, len - 1, V] predicting each next prompt token: the first
    ``prefill`` tokens of every prompt in one extend step, then one token per decode step, so
    both attention paths read the KV pool. The prompts share one length. Runs on one thread."""
    from engine.forward_batch import ForwardBatch

    length = len(prompts[0])
    pool = runner.kv_pool
    rows = [pool.alloc_req() for _ in prompts]
    steps = [[p[:prefill] for p in prompts]] + [[[p[i]] for p in prompts]
                                                for i in range(prefill, length - 1)]
    out, done = [], 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # also in module fixtures, which run before single_torch_thread
    try:
        for new in steps:
            n = len(new[0])
            locs = torch.cat([pool.extend_slots(r, done, n) for r in rows])
            batch = ForwardBatch.build(new, [done] * len(rows), rows, locs, pool.req_to_token)
            out.append(runner.forward(batch, return_all_logits=True).view(len(rows), n, -1))
            done += n
    finally:
        torch.set_num_threads(threads)
    free_requests(pool, rows, [done] * len(rows))
    return torch.cat(out, dim=1)


class ServerProcess:
    """A real ``engine serve`` subprocess on 127.0.0.1 and a free port, for tests and
    benchmarks; every wait is bounded. ``env``: variables added to this process's."""

    def __init__(self, args: list[str], log_path, api_key: str | None = None,
                 env: dict[str, str] | None = None):
        import subprocess
        import sys

        from engine.net import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = log_path
        engine = os.path.join(os.path.dirname(sys.executable), "engine")
        cmd = [engine, "serve", "--port", str(self.port), *args]
        if api_key:
            cmd += ["--api-key", api_key]
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def wait_ready(self, timeout: float = 90.0) -> "ServerProcess":
        """Until /health answers 200; RuntimeError (with the log) if it exits or times out."""
        import time

        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log()[-4000:]}")

    def stop(self, timeout: float = 30.0) -> int:
        import signal
        import subprocess

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


class InProcessServer:
    """``engine serve``'s server for an Engine built in this process, on uvicorn in a thread,
    on 127.0.0.1 and a free port: for tests that inject faults into the engine or its runtime
    (``.engine``, ``.runtime``) and talk to it with a real HTTP client. A context manager."""

    def __init__(self, engine, served_model_name: str = "tiny", grace_period: float = 5.0):
        import socket
        import threading

        from engine.server.launch import build_server
        from engine.server.serving import ServerSettings

        self.engine = engine
        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        port = self._socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        settings = ServerSettings(str(engine.checkpoint.path), served_model_name, port=port,
                                  shutdown_grace_period=grace_period)
        self.server = build_server(engine, settings, log_level="warning")
        self.runtime = self.server.runtime
        self._thread = threading.Thread(target=self.server.run,
                                        kwargs={"sockets": [self._socket]}, daemon=True)

    def __enter__(self) -> "InProcessServer":
        import time

        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.02)
        return self

    def on_engine(self, fn, timeout: float = 30.0):
        """``fn(engine)`` run on the engine thread between two steps (as the routes do); its
        result. Call it from any thread but the server's."""
        import asyncio

        future = asyncio.run_coroutine_threadsafe(self.runtime.call(fn), self.runtime.loop)
        return future.result(timeout)

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self._thread.join(30)
        self._socket.close()


def assert_all_free(engine) -> None:
    """Nothing queued or running, the slot accounting consistent, and (once the prefix cache
    is flushed) every KV slot and request row free again."""
    s = engine.scheduler
    assert not s.running and not s.waiting
    s.check_invariants()
    assert engine.flush_cache() or s.kv.cache is None
    assert s.kv.pool.free_slots == s.kv.pool.size
    assert s.kv.pool.free_reqs == s.kv.pool.max_reqs
