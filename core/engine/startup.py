"""How an Engine starts, step by step (``Engine._build`` calls them in order): the tokenizer,
the runner (the weights; one process, or rank 0 of tp x pp ranks), the memory plan, the
compiled decoder's warm-up, the scheduler; and the lines it logs once ready."""

from __future__ import annotations

import dataclasses
import logging
from typing import NamedTuple

from engine.errors import GRAMMAR_INSTALL
from engine.registry import Entry

logger = logging.getLogger("engine")


class Resolved(NamedTuple):
    """The registry entries an engine starts with (resolved before anything loads)."""

    policy: Entry
    kv: Entry
    attention: Entry
    quant: Entry | None


def load_tokenizer(config, checkpoint):
    """--tokenizer DIR's tokenizer, else the checkpoint's."""
    from engine.models.checkpoint import load_tokenizer_dir

    return load_tokenizer_dir(config.tokenizer) if config.tokenizer else \
        checkpoint.load_tokenizer()


def start_runner(config, checkpoint, model_config, regs, device, resolved: Resolved,
                 parallel) -> tuple:
    """Build the runner (loads the weights); ``parallel``: (strategy, what every node must
    agree on) with tp x pp > 1, else None. Returns (runner, the device as the memory plan sees
    it, the weight bytes and the KV bytes per token the pool is sized for)."""
    from engine.runner import build_runner

    if parallel is None:
        runner = build_runner(config, checkpoint, regs, device, resolved.attention, resolved.kv,
                              resolved.quant, tp=join_dp_attention(config, regs, device))
        return runner, device, runner.weight_bytes, runner.kv_bytes_per_token()
    from engine.ranks.launch import start_rank0  # rank 0 of tp x pp ranks (engine/ranks)

    strategy, agreed = parallel
    runner = start_rank0(config, checkpoint, model_config, regs, device, strategy,
                         {"attention": resolved.attention, "kv": resolved.kv,
                          "quant": resolved.quant}, agreed)
    # the pool is one size on every rank: sized for the rank that needs the most; on a CPU
    # the node's ranks share its memory
    weights = max(w for w, _ in runner.rank_sizes)
    kv_per_token = max(kv for _, kv in runner.rank_sizes)
    if not device.is_cuda:
        share = device.available_memory // runner.topo.per_node
        device = dataclasses.replace(device, available_memory=share)
    return runner, device, weights, kv_per_token


def join_dp_attention(config, regs, device):
    """A data-parallel attention rank's process (``engine serve --enable-dp-attention`` starts
    one per rank): join the other ranks, for the MoE layers (engine/parallel/dp_attention.py);
    None for any other engine."""
    if config.dp_attention_rank is None:
        return None
    from datetime import timedelta

    from engine.parallel.dp_attention import init_dp_attention_group
    from engine.registry import resolve_parallel_strategy

    strategy = resolve_parallel_strategy(regs, config.parallel_strategy, device).obj
    return init_dp_attention_group(
        strategy.backend, config.dp_attention_rank, config.dp_attention_size,
        config.dp_attention_init, config.ep_size,
        device.torch_device if device.is_cuda else None, timedelta(seconds=config.dist_timeout))


def plan_memory(config, runner, device, weights: int, kv_per_token: int, resolved: Resolved):
    """The sizing report (memory/sizing.py: KV pool tokens, running requests, chunk size),
    leaving room for the CUDA graphs (decode and piecewise) and what the attention backend
    holds beside them."""
    import torch

    from engine.cuda_graph import backend_graph_bytes, estimate_graph_bytes
    from engine.memory.sizing import plan
    from engine.piecewise_cuda_graph import estimate_piecewise_bytes

    mc, attn_entry = runner.model_config, resolved.attention
    # a quantized KV cache reports its capacity against a bfloat16 one in the same memory
    reference = (("bfloat16", runner.kv_bytes_per_token(torch.bfloat16))
                 if resolved.kv.obj.needs_scale else None)
    itemsize = torch.empty((), dtype=runner.dtype).element_size()
    # what the attention backend holds beside the pool (graph wrappers, index buffers,
    # workspaces), as its registration reports it
    backend_bytes = backend_graph_bytes(
        attn_entry.obj, getattr(runner, "layer_specs", None) or mc.layer_specs(),
        config.page_size, config.max_model_len or mc.max_position_embeddings,
        config.plugin_options.get(attn_entry.plugin, {}), config.cuda_graph_bs)
    return plan(config, device, weights, kv_per_token,
                config.kv_cache_dtype, mc.max_position_embeddings, reference,
                graph_bytes=lambda bs: estimate_graph_bytes(mc, itemsize, bs, backend_bytes),
                piecewise_bytes=lambda n: estimate_piecewise_bytes(mc, itemsize, n))


def warm_up_compiled(runner, config) -> None:
    """--enable-torch-compile: compile the decoder now, not at the first request."""
    if runner.compiled is None:
        return
    from engine.compile import warm_up

    seconds = warm_up(runner)
    logger.info(f"torch.compile: decoder compiled for forwards of up to "
                f"{config.torch_compile_max_bs} tokens in {seconds:.1f} s (inductor, "
                f"dynamic token dimension; cache {runner.compiled.cache_dir})")


def eos_ids(model_config, tokenizer) -> set[int]:
    """The ids that end a generation: the model's, and the tokenizer's EOS."""
    ids = set(model_config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def make_scheduler(config, runner, pool, sizing, policy_entry: Entry, eos_token_ids,
                   hicache_storage: Entry | None = None):
    """The scheduler over ``pool`` and the prefix cache (with --enable-hierarchical-cache its
    host and storage tiers: engine/hicache), with its overlap worker under
    --enable-overlap-schedule; each step's stats go to the step_finished observers."""
    from engine.hicache.report import TierStats
    from engine.memory.radix_cache import RadixCache
    from engine.plugins import call_observers, pm
    from engine.scheduler.kv import KVManager
    from engine.scheduler.scheduler import Scheduler

    stats = TierStats()
    if config.enable_hierarchical_cache:
        from engine.hicache.build import build_hicache

        cache = build_hicache(config, runner, pool, hicache_storage, stats)
    else:
        cache = None if config.disable_radix_cache else RadixCache(pool.free_slots_of,
                                                                   config.page_size)
    scheduler = Scheduler(
        runner, KVManager(pool, cache, stats), policy_entry.obj(config),
        policy_entry.extra["cache_aware"], sizing, config, eos_token_ids,
        runner.model_config.vocab_size,
        on_step=lambda stats: call_observers(pm.hook.step_finished, stats=stats))
    if config.enable_overlap_schedule:  # a model-worker thread (scheduler/overlap.py)
        from engine.scheduler.overlap import OverlapSchedule

        scheduler.overlap = OverlapSchedule(scheduler)
    return scheduler


def start_lines(engine, resolved: Resolved) -> list[str]:
    """What the engine logs once ready: how the checkpoint was read, the model and its dtype,
    the kernels, quantization, backends and policies, the sizing report, the ranks, the CUDA
    graphs (decode and piecewise), the KV scales."""
    config, runner, ckpt = engine.config, engine.runner, engine.checkpoint
    lines = list(ckpt.notes)
    lines += [f"model {engine.model_name} ({ckpt.path}): {runner.model_config.architecture}, "
              f"{runner.dtype_reason}", runner.linear_kernel]
    if getattr(runner, "moe_kernel", ""):  # which MoE path runs (layers/moe_fused.py)
        lines.append(runner.moe_kernel)
    quant = resolved.quant
    if quant is not None:
        how = ("--quantization" if config.quantization else
               "detected from the checkpoint's quantization_config")
        # run as a GGUF's blocks (QuantMethod.gguf_blocks): how, e.g. "on the GGUF's q8_0
        # blocks as they are: int8 activations per block of 32 (llama.cpp's arithmetic)"
        note = getattr(runner, "quant_note", None)
        lines.append(f"quantization: {quant.name} ({quant.origin}), {how}"
                     + (f"; {note}" if note else ""))
    attn = resolved.attention
    lines.append(f"attention backend: {attn.name} ({attn.origin}); "
                 f"schedule policy: {resolved.policy.name}; radix cache: "
                 f"{'disabled' if engine.scheduler.kv.cache is None else 'enabled'}; overlap "
                 f"schedule: {'on' if config.enable_overlap_schedule else 'off'}")
    lines.append(grammar_line(engine.grammar_entry, config.grammar_backend))
    lines += engine.sizing.lines()
    if config.enable_hierarchical_cache:
        from engine.hicache.build import hicache_line

        lines.append(hicache_line(engine.scheduler.kv.cache))
    if engine.parallel is not None:
        lines.append(runner.describe())
    if getattr(runner, "dp", None) is not None:
        lines.append(f"dp attention: rank {runner.dp.rank} of {runner.dp.size} (its own "
                     f"requests, KV cache and scheduler); MoE layers over the {runner.dp.size} "
                     f"ranks: {runner.model.experts_placement.describe()}")
    lines += [engine.cuda_graph, engine.piecewise_cuda_graph]
    if engine.cpu_graph:
        lines.append(engine.cpu_graph)
    if engine.scheduler.spec is not None:
        from engine.speculative.build import spec_line

        lines.append(spec_line(engine.scheduler.spec, engine.spec_entry))
    if resolved.kv.obj.needs_scale:
        scales = ("from the checkpoint" if runner.kv_scales_from_checkpoint else
                  "1.0 (none in the checkpoint)")
        lines.append(f"KV cache {config.kv_cache_dtype}: per-layer K/V scales {scales}")
    return lines


def grammar_line(entry, asked: str) -> str:
    """The grammar backend in use (``entry``; None: none) for ``--grammar-backend asked``."""
    if entry is not None:
        return f"grammar backend: {entry.name} ({entry.origin})"
    if asked == "none":
        return "grammar backend: none (--grammar-backend none: structured outputs are off)"
    return (f"grammar backend: none (none installed: structured outputs are off; "
            f"{GRAMMAR_INSTALL})")
