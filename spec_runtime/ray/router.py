"""Several target/draft pairs behind one OpenAI router, by model name (as Ray Serve LLM's
`build_openai_app` does for its engines).

    from ray import serve
    from spec_runtime.ray import build_openai_app
    from spec_runtime.ray.router import ModelServeConfig

    app = build_openai_app([
        ModelServeConfig(llama_cfg, model_name="llama-8b", num_replicas=2),
        ModelServeConfig(qwen_cfg, model_name="qwen-7b", placement="spread"),
    ])
    serve.run(app, route_prefix="/")

Each model is its own deployment of the replica class of spec_runtime.ray.serve_app (its replicas, placement groups,
autoscaling and health checks, spec_runtime.ray.serve_app). The router is one more
deployment, the app's HTTP ingress: it reads `model` from the body of /v1/completions and
/v1/chat/completions and passes the request, headers included, to that model's
deployment, which answers it with the same FastAPI app as `spec-runtime serve`, streamed
back chunk by chunk. GET /v1/models lists every model; GET /health is 200 while every
model is healthy. There is no /metrics on the router: the sums over every replica of
every model are Ray's `ray_spec_runtime_*` metrics, labelled by model_name.
"""

import dataclasses
import json
import re

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve

from spec_runtime.config import RuntimeConfig
from spec_runtime.server.app_options import AppOptions


@dataclasses.dataclass(frozen=True)
class ModelServeConfig:
    """One model of the router: its runtime config, the name clients send, and how Serve
    runs it (the keyword arguments of spec_runtime.ray.serve_app.build_application)."""

    runtime: RuntimeConfig
    model_name: str
    placement: str = "pack"
    gpus_per_actor: float | None = None  # None: auto (a GPU where the cluster has any)
    cpus_per_actor: float | None = None
    replica_cpus: float = 1.0
    num_replicas: int = 1
    max_replicas: int | None = None
    # The HTTP app's settings, as `spec-runtime serve` has them (served_model_name is model_name).
    app: AppOptions = dataclasses.field(default_factory=AppOptions)

    def __post_init__(self):
        if not self.model_name:
            raise ValueError("model_name must not be empty")


def _error(status: int, message: str, code: str | None = None, param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress()
class OpenAIRouter:
    """The HTTP ingress of several models: passes each request to its model's deployment."""

    def __init__(self, models: dict):
        self._models = models  # model name -> DeploymentHandle of its model deployment

    def __serve_build_asgi_app__(self):
        app = FastAPI(title="spec-runtime router", docs_url=None, redoc_url=None)

        async def forward(request: Request):
            body = await request.body()
            try:
                name = json.loads(body).get("model")
            except (ValueError, AttributeError):
                return _error(400, "the request body is not a valid JSON object")
            if name not in self._models:
                return _error(404, f"The model `{name}` does not exist; this server serves {sorted(self._models)}.",
                              code="model_not_found", param="model")
            return await self._pass(self._models[name], request, body)

        app.post("/v1/completions")(forward)
        app.post("/v1/chat/completions")(forward)

        @app.get("/v1/models")
        async def models(request: Request):
            data = []
            for handle in self._models.values():
                status, _, body = await self._call(handle, request)
                if status != 200:
                    return JSONResponse(json.loads(body), status_code=status)
                data += json.loads(body)["data"]
            return {"object": "list", "data": data}

        @app.get("/health")
        async def health(request: Request):
            results = {}
            for name, handle in self._models.items():
                status, _, body = await self._call(handle, request)
                results[name] = json.loads(body) if status in (200, 503) else {"status": f"HTTP {status}"}
            ok = all(r.get("status") == "ok" for r in results.values())
            return JSONResponse({"status": "ok" if ok else "unhealthy", "models": results},
                                status_code=200 if ok else 503)

        return app

    @staticmethod
    def _request(request: Request, body: bytes = b"") -> dict:
        return {"method": request.method, "path": request.url.path, "query": request.url.query.encode(),
                "headers": [(k.encode(), v.encode()) for k, v in request.headers.items()], "body": body}

    async def _call(self, handle, request: Request) -> tuple[int, list, bytes]:
        """A whole (non-streamed) response of the model's app."""
        gen = handle.options(stream=True).handle_request.remote(self._request(request))
        status, headers = await gen.__anext__()
        body = b"".join([chunk async for chunk in gen])
        return status, headers, body

    async def _pass(self, handle, request: Request, body: bytes):
        gen = handle.options(stream=True).handle_request.remote(self._request(request, body))
        status, headers = await gen.__anext__()
        keep = {k: v for k, v in headers if k.lower() not in ("content-length", "transfer-encoding")}

        async def chunks():
            try:
                async for chunk in gen:
                    yield chunk
            finally:
                gen.cancel()  # the client went away: the model's app aborts the request

        return StreamingResponse(chunks(), status_code=status, headers=keep)


def _deployment_name(model_name: str) -> str:
    return "SpecRuntimeServer-" + re.sub(r"[^A-Za-z0-9_.-]", "_", model_name)


def build_openai_app(configs: list[ModelServeConfig]):
    """A bound Serve application: one model deployment (RoutedModelServer) per model and the
    router in front of them (for `serve.run`)."""
    from spec_runtime.ray.serve_app import build_application

    names = [c.model_name for c in configs]
    if not configs or len(set(names)) != len(names):
        raise ValueError(f"need one or more models with distinct names, got {names}")
    models = {}
    for c in configs:
        models[c.model_name] = build_application(
            c.runtime, dataclasses.replace(c.app, served_model_name=c.model_name), placement=c.placement,
            gpus_per_actor=c.gpus_per_actor, cpus_per_actor=c.cpus_per_actor, replica_cpus=c.replica_cpus,
            num_replicas=c.num_replicas, max_replicas=c.max_replicas, name=_deployment_name(c.model_name),
            ingress=False)
    return OpenAIRouter.bind(models)
