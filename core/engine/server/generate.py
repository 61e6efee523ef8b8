"""POST /generate, SGLang's native route: ``text`` or ``input_ids`` (one or a batch),
``sampling_params`` named as in engine.SamplingParams, and a stream of cumulative text."""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import JSONResponse

from engine.sampling import SamplingParams
from engine.sampling.params import CONSTRAINT_FIELDS
from engine.server.body import read_model
from engine.server.constraints import body_constraint, compile_first
from engine.server.handle import Handle
from engine.server.openai import GenerateRequest, GenerateSamplingParams
from engine.server.serving import (
    abort,
    delta_error,
    prepare_prompt,
    state,
    submit,
    submitted,
    unless_disconnected,
)
from engine.server.streaming import DONE, EventStream, all_deltas, sse

DEFAULT_MAX_NEW_TOKENS = SamplingParams().max_new_tokens


async def generate(request: Request):
    st = state(request)
    body: GenerateRequest = await read_model(request, GenerateRequest,
                                             st.settings.max_request_bytes)
    given = body.text if body.text is not None else body.input_ids
    single = isinstance(given, str) or not given or isinstance(given[0], int)
    prompts = [given] if single else list(given)
    sp = body.sampling_params or GenerateSamplingParams()
    sampling = {k: getattr(sp, k) for k in GenerateSamplingParams.model_fields
                if getattr(sp, k) is not None and k not in CONSTRAINT_FIELDS}
    sampling.setdefault("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if body.return_logprob:
        sampling.update(logprobs=True, top_logprobs=body.top_logprobs_num)
    rid = body.rid if len(prompts) == 1 else None
    constraint = body_constraint(sp, prefix="sampling_params.")
    await compile_first(st, constraint)
    items = [(Handle(body.stream, rid=rid, constraint=constraint), prepare_prompt(p, sampling))
             for p in prompts]
    n = sampling.get("n", 1)
    if body.stream:
        handles = await submit(st, items)
        return EventStream(_events(handles, n), on_close=lambda: abort(st, handles))
    async with submitted(st, items) as handles:
        results = await unless_disconnected(
            request, asyncio.gather(*(h.results() for h in handles)))
    outputs = []
    for pi, res in enumerate(results):
        for d in res:
            if d.error:
                raise delta_error(d)
            outputs.append({"text": d.text, "output_ids": d.token_ids, "meta_info": d.meta,
                            "index": pi * n + d.index})
    for pi, h in enumerate(handles):  # max_new_tokens 0: nothing generated
        if not h.reqs:
            outputs[pi * n: pi * n] = [_empty(h, pi * n + j) for j in range(n)]
    return JSONResponse(outputs[0] if single and n == 1 else outputs)


def _empty(h: Handle, index: int) -> dict:
    meta = {"prompt_tokens": len(h.prompt_ids), "completion_tokens": 0, "cached_tokens": 0,
            "finish_reason": {"type": "length", "length": 0}}
    return {"text": "", "output_ids": [], "meta_info": meta, "index": index}


async def _events(handles: list[Handle], n: int):
    texts: dict[int, str] = {}
    ids: dict[int, list[int]] = {}

    for pi, h in enumerate(handles):
        if not h.reqs:
            for j in range(n):
                yield sse(_empty(h, pi * n + j))
    async for pi, d in all_deltas(handles):
        if d.error:
            yield sse(delta_error(d).body())
            continue
        index = pi * n + d.index
        texts[index] = texts.get(index, "") + d.text
        ids.setdefault(index, []).extend(d.token_ids)
        meta = d.meta or {"prompt_tokens": len(handles[pi].prompt_ids),
                          "completion_tokens": d.completion_tokens, "finish_reason": None}
        yield sse({"text": texts[index], "output_ids": ids[index], "meta_info": meta,
                   "index": index})
    yield DONE
