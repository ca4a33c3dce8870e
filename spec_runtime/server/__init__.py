"""The OpenAI-compatible HTTP front-end of spec-runtime.

    app.py             FastAPI app factory: /v1/completions, /v1/chat/completions, /v1/models,
                       /health, /metrics (+ /v1/engine_stats, a spec-runtime extension)
    openai_protocol.py request models and their validation into SamplingParams (nothing ignored)
    openai_responses.py response bodies: choices, logprobs, usage
    metrics.py         prometheus_client metrics (speculation counters, latency histograms)
    async_client.py    AsyncClient: the in-process runtime bridged to asyncio
    http_client.py     HTTPClient / AsyncHTTPClient: the same API against a running server
"""
