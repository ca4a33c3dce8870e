"""The Python client library: AsyncClient in-process, and Client.connect / AsyncClient.connect over HTTP.

One runtime (tiny llama, draft = a perturbed copy, SSD, K = 3) serves both: the test's
AsyncClient drives it directly, and a uvicorn server on 127.0.0.1 exposes it to the
HTTP clients, so greedy results of the two paths must agree token for token.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal

import httpx
import pytest

from e2e_util import make_config, serve_in_thread, wait_until
from protocol.messages import SamplingParams
from spec_runtime import AsyncClient, Client
from spec_runtime.server.app import build_app
from spec_runtime.server.http_client import ServerError

K = 3
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def rt(tiny_pair):
    target, draft = tiny_pair
    aclient = AsyncClient(make_config(target, draft, mode="ssd", k=K))
    assert aclient.client.engine_stats().draft_alive  # the spec link is up when start-up returns
    with serve_in_thread(build_app(aclient, served_model_name="m")) as url:
        yield aclient, url
    aclient.client.close()


def test_async_client_in_process(rt):
    ac, _ = rt

    async def main():
        res = await ac.generate([5, 6, 7], GREEDY)
        chunks = [o async for o in ac.stream([5, 6, 7], GREEDY)]
        batch = await ac.generate_batch([[5, 6, 7], [9, 10]], GREEDY)
        chat = await ac.chat([{"role": "user", "content": "Hi"}], GREEDY)
        return res, chunks, batch, chat, await ac.engine_stats()

    res, chunks, batch, chat, st = asyncio.run(main())
    assert len(res.token_ids) == 10 and res.finish_reason == "length"
    assert [t for c in chunks for t in c.new_token_ids] == res.token_ids and chunks[-1].stats is not None
    assert batch[0].token_ids == res.token_ids and len(batch[1].token_ids) == 10
    assert len(chat.token_ids) == 10 and chat.stats.num_prompt_tokens == len(ac.client.encode_chat(
        [{"role": "user", "content": "Hi"}]))
    assert res.stats.num_draft_tokens > 0 and res.stats.num_accepted_tokens <= res.stats.num_draft_tokens
    assert st.num_running == 0


def test_async_stream_stopped_early_aborts(rt):
    ac, _ = rt

    async def main():
        async for out in ac.stream([11, 12, 13], SamplingParams(max_tokens=200, ignore_eos=True)):
            assert out.new_token_ids
            break  # leaving the loop closes the generator, which aborts the request

    asyncio.run(main())
    def idle():
        st = ac.client.engine_stats()
        return not (st.num_running or st.num_waiting)

    assert wait_until(idle, 60), ac.client.engine_stats()


def test_http_client_matches_in_process(rt):
    ac, url = rt
    ref = asyncio.run(ac.generate("Hello there", GREEDY))
    with Client.connect(url) as hc:
        assert hc.model == "m"
        res = hc.generate("Hello there", GREEDY)
        assert (res.token_ids, res.text, res.finish_reason) == (ref.token_ids, ref.text, "length")
        # Speculation stats survive the trip (as usage.spec_decode).
        for f in ("num_draft_tokens", "num_accepted_tokens", "accepted_per_position", "drafted_per_position",
                  "num_prompt_tokens", "num_generated_tokens"):
            assert getattr(res.stats, f) == getattr(ref.stats, f), f
        chunks = list(hc.stream("Hello there", GREEDY))
        assert [t for c in chunks for t in c.new_token_ids] == ref.token_ids
        assert chunks[-1].finished and chunks[-1].stats.num_draft_tokens == ref.stats.num_draft_tokens
        chat = hc.chat([{"role": "user", "content": "Hi"}], GREEDY)
        assert len(chat.token_ids) == 10
        batch = hc.generate_batch(["a", "b", "c"], max_tokens=4, ignore_eos=True)
        assert [len(r.token_ids) for r in batch] == [4, 4, 4]
        assert hc.engine_stats().mode == "ssd"
        with pytest.raises(ServerError, match="HTTP 400.*max_tokens"):
            hc.generate("x", max_tokens=0)


def test_async_http_client(rt):
    ac, url = rt
    ref = asyncio.run(ac.generate([5, 6, 7], GREEDY))

    async def main():
        async with AsyncClient.connect(url, model="m") as hc:
            res = await hc.generate([5, 6, 7], GREEDY)
            chunks = [o async for o in hc.stream([5, 6, 7], GREEDY)]
            batch = await hc.generate_batch([[5, 6, 7]] * 3, GREEDY)
            return res, chunks, batch, await hc.engine_stats()

    res, chunks, batch, st = asyncio.run(main())
    assert res.token_ids == ref.token_ids and res.stats.num_accepted_tokens == ref.stats.num_accepted_tokens
    assert [t for c in chunks for t in c.new_token_ids] == ref.token_ids
    assert all(b.token_ids == ref.token_ids for b in batch)
    assert st.num_running == 0


def test_http_client_forwards_every_sampling_param_and_logprobs(rt):
    """SamplingParams over HTTP mean what they mean in-process: processors, logprobs."""
    ac, url = rt
    sp = SamplingParams(max_tokens=10, ignore_eos=True, repetition_penalty=1.6, presence_penalty=0.4,
                        frequency_penalty=0.3, min_tokens=2, logit_bias={50: 3.0}, logprobs=True, top_logprobs=2)
    local = ac.client.generate([5, 6, 7], sp)
    with Client.connect(url) as http:
        remote = http.generate([5, 6, 7], sp)
        streamed = list(http.stream([5, 6, 7], sp))
    assert remote.token_ids == local.token_ids != ac.client.generate([5, 6, 7], GREEDY).token_ids
    assert remote.logprobs == pytest.approx(local.logprobs, abs=1e-5) and len(remote.logprobs) == 10
    assert [x for o in streamed for x in o.logprobs] == remote.logprobs


def test_health_503_and_requests_fail_when_target_dies(rt):
    # Last in the module: it kills the runtime's target process.
    ac, url = rt
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    body = {"model": "m", "prompt": [4, 5, 6], "max_tokens": 240, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data:")
        os.kill(ac.client.launcher.pids()["target"], signal.SIGKILL)
        rest = [ln for ln in lines if ln]
    # The in-flight stream ends with an OpenAI error event, then [DONE], instead of hanging.
    assert rest[-1] == "data: [DONE]"
    assert any("error" in json.loads(ln[5:]) for ln in rest[:-1]), rest[-3:]
    assert wait_until(lambda: httpx.get(url + "/health").status_code == 503, 60, 0.1)
    h = httpx.get(url + "/health")
    assert h.json()["status"] == "dead" and "target" in h.json()["reason"]
    r = httpx.post(url + "/v1/completions", json=dict(body, stream=False), timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"



def test_sse_error_event_gives_an_int_http_status_and_keeps_the_code():
    from spec_runtime.server.http_client import _SSEParser

    cases = [({"message": "boom", "type": "server_error", "code": "internal_error"}, 500, "internal_error"),
             ({"message": "bad", "type": "invalid_request_error", "code": "unsupported_parameter"}, 400,
              "unsupported_parameter"),
             ({"message": "vLLM's shape", "type": "BadRequestError", "code": 400}, 400, 400),
             ({"message": "no code"}, 500, None)]
    for err, status, code in cases:
        with pytest.raises(ServerError) as e:
            _SSEParser().feed("data: " + json.dumps({"error": err}))
        assert e.value.status == status and isinstance(e.value.status, int) and e.value.code == code
        assert str(e.value) == f"HTTP {status}: {err['message']}"
