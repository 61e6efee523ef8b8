"""The overlap scheduler under mixed real traffic: echo + logprobs requests (prompt logprobs)
next to plain ones. Every forward goes through the scheduler, so the overlap worker is the only
caller of the runner; before, the echo job ran a forward from the engine thread while the worker
could be inside one (24 of 48 requests failed)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from engine.server.process import ServerProcess


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("llama")


def _bodies(n: int = 32) -> list[dict]:
    out = []
    for i in range(n):
        body = {"model": "m", "prompt": f"request {i}: the quick brown fox " + "jumps " * (i % 7),
                "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        if i % 3 == 0:
            body.update(echo=True, logprobs=2)
            if i % 6 == 0:
                body["max_tokens"] = 0  # scoring only
        out.append(body)
    return out


async def _run(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=120) as client:
        return await asyncio.gather(*(client.post(url + "/v1/completions", json=b)
                                      for b in bodies))


def _serve(model, tmp_path, name: str, *flags: str) -> list[dict]:
    server = ServerProcess(["--model", model, "--max-total-tokens", "3000",
                            "--served-model-name", "m", *flags], tmp_path / f"{name}.log")
    try:
        server.wait_ready(120)
        responses = asyncio.run(_run(server.url, _bodies()))
    finally:
        server.stop()
    bad = [(r.status_code, r.text[:300]) for r in responses if r.status_code != 200]
    assert not bad, f"{len(bad)} of {len(responses)} failed ({name}): {bad[:3]}"
    return [r.json()["choices"][0] for r in responses]


def test_echo_logprobs_next_to_plain_requests_with_overlap(model, tmp_path):
    off = _serve(model, tmp_path, "off")
    on = _serve(model, tmp_path, "on", "--enable-overlap-schedule")
    for a, b, body in zip(off, on, _bodies()):
        assert a["text"] == b["text"]
        if body.get("logprobs") is None:
            continue
        assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
        assert a["logprobs"]["token_logprobs"][0] is None
        assert a["logprobs"]["token_logprobs"][1:] == pytest.approx(
            b["logprobs"]["token_logprobs"][1:], abs=1e-4)
