"""`serve --ray` honours the same serve flags as the local server: one AppOptions, built by
the same code, reaches both; `serve run`'s app_builder takes the same keys.

The first tests need no Ray cluster (run_server / run_ray_server are replaced, the Serve
application is only bound). The last one (slow) serves on a CPU-only local Ray and checks
that a replica applies the metrics prefix, the model's generation_config.json, the chat
template and the API key.
"""

from __future__ import annotations

import dataclasses
import json
import socket

import httpx
import pytest

import ray  # the `test` extra installs ray[serve]

from conftest import save_tiny_model
from e2e_util import make_config
from spec_runtime.cli import main
from spec_runtime.server.app_options import AppOptions
from spec_runtime.server.chat_config import ChatConfig

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    path = save_tiny_model(tmp_path_factory.mktemp("parity") / "t", "llama")
    with open(f"{path}/generation_config.json", "w") as f:
        json.dump({"temperature": 1.0, "top_k": 1}, f)  # sampling that is greedy
    return path


@pytest.fixture
def launched(monkeypatch):
    """main(["serve", ...]) up to the start: (which server, cfg, AppOptions) per call."""
    calls = []
    monkeypatch.setattr("spec_runtime.server.serve.run_server",
                        lambda cfg, options, **kw: calls.append(("local", cfg, options)) or 0)
    monkeypatch.setattr("spec_runtime.ray.launch.run_ray_server",
                        lambda cfg, options, **kw: calls.append(("ray", cfg, options)) or 0)
    return calls


def test_local_and_ray_get_the_same_app_options(target, tmp_path, launched, capsys):
    template = tmp_path / "t.jinja"
    template.write_text(TEMPLATE)
    flags = ["serve", target, "--draft", "ngram", "--metrics-prefix", "vllm", "--generation-config", "auto",
             "--chat-template", str(template), "--tool-call-parser", "hermes", "--served-model-name", "tiny",
             "--api-key", "sk-1", "--max-body-bytes", "4096", "--max-json-depth", "8", "--body-timeout-s", "3",
             "--shutdown-timeout-s", "7", "--port", "8001"]
    assert main(flags) == 0
    assert main([*flags, "--ray", "--ray-gpus-per-actor", "0"]) == 0
    (kind_l, cfg_l, local), (kind_r, cfg_r, remote) = launched
    assert (kind_l, kind_r) == ("local", "ray") and cfg_l == cfg_r
    assert local == remote
    assert remote.metrics_prefix == "vllm" and remote.generation_defaults == {"temperature": 1.0, "top_k": 1}
    assert remote.chat == ChatConfig(chat_template=str(template), tool_call_parser="hermes")
    assert (remote.served_model_name, remote.api_key) == ("tiny", "sk-1")
    assert (remote.http.max_body_bytes, remote.http.max_json_depth, remote.http.body_timeout_s) == (4096, 8, 3.0)
    assert remote.http.shutdown_timeout_s == 7.0
    assert capsys.readouterr().err.count("request defaults from the model's generation_config.json") == 2


@pytest.mark.parametrize("flag", ["--header-timeout-s", "--keep-alive-timeout-s", "--max-header-bytes"])
def test_ray_refuses_what_only_uvicorn_applies(flag, launched, capsys):
    assert main(["serve", "--ray", flag, "2048", "--ray-gpus-per-actor", "0"]) == 2
    assert f"{flag} does not apply with --ray" in capsys.readouterr().err and not launched


def test_ray_keeps_a_hugging_face_id_for_the_nodes(launched):
    """Under --ray the id is resolved where the models load (each node's cache), and is the
    served model name; the command's host need not hold the model."""
    assert main(["serve", "--ray", "--target", "someorg/not-here", "--draft", "ngram",
                 "--ray-gpus-per-actor", "0"]) == 0
    _, cfg, options = launched[-1]
    assert cfg.target.path == "someorg/not-here" and options.generation_defaults is None
    from spec_runtime.server.app import model_name_of

    assert model_name_of(cfg, options.served_model_name) == "someorg/not-here"


def test_options_cross_to_a_replica_as_plain_data(target, tmp_path):
    from spec_runtime.ray.serve_app import app_builder, build_application

    template = tmp_path / "t.jinja"
    template.write_text(TEMPLATE)
    options = AppOptions(metrics_prefix="vllm", chat=ChatConfig(chat_template=str(template)))
    app = build_application(make_config(target, mode="ar"), options, gpus_per_actor=0, cpus_per_actor=1)
    deployment = app._bound_deployment
    _, sent = deployment.init_args
    json.dumps(sent)  # plain data
    got = AppOptions.from_dict(sent)
    assert got.chat.chat_template == TEMPLATE  # the text: the file need not exist on the replica's node
    assert got == dataclasses.replace(options, chat=ChatConfig(chat_template=TEMPLATE))
    assert deployment._deployment_config.graceful_shutdown_timeout_s == options.http.shutdown_timeout_s
    # serve run's app_builder: the same keys as the flags.
    app = app_builder({"target": target, "mode": "ar", "gpus_per_actor": "0", "cpus_per_actor": "1",
                       "metrics_prefix": "vllm", "generation_config": "none", "chat_template": TEMPLATE,
                       "served_model_name": "tiny", "max_json_depth": "9"})
    got = AppOptions.from_dict(app._bound_deployment.init_args[1])
    assert (got.metrics_prefix, got.generation_config, got.served_model_name, got.http.max_json_depth) == (
        "vllm", "none", "tiny", 9)
    assert got.chat.chat_template == TEMPLATE
    with pytest.raises(ValueError, match="header_timeout_s does not apply under Ray Serve"):
        app_builder({"target": target, "header_timeout_s": "3"})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_replica_applies_the_options(target):
    from ray import serve

    from spec_runtime.ray.serve_app import build_application

    cfg = make_config(target, mode="ar")
    options = AppOptions(served_model_name="tiny", api_key="sk-1", metrics_prefix="vllm",
                         chat=ChatConfig(chat_template=TEMPLATE))  # generation_config.json read by the replica
    ray.init(num_cpus=3, num_gpus=0, include_dashboard=False, log_to_driver=False)
    port = _free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_application(cfg, options, gpus_per_actor=0, cpus_per_actor=1), name="spec",
                  route_prefix="/")
        base = f"http://127.0.0.1:{port}"
        auth = {"authorization": "Bearer sk-1"}
        body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 12, "ignore_eos": True,
                "return_token_ids": True, "seed": 3}
        assert httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 401
        sampled = httpx.post(f"{base}/v1/completions", json=body, headers=auth, timeout=60)
        greedy = httpx.post(f"{base}/v1/completions", json={**body, "temperature": 0}, headers=auth, timeout=60)
        assert sampled.status_code == 200, sampled.text
        # generation_config.json's top_k 1 applies where the request is silent: greedy.
        assert sampled.json()["choices"][0]["token_ids"] == greedy.json()["choices"][0]["token_ids"]
        other = httpx.post(f"{base}/v1/completions", json={**body, "top_k": 0}, headers=auth, timeout=60)
        assert other.json()["choices"][0]["token_ids"] != greedy.json()["choices"][0]["token_ids"]
        r = httpx.post(f"{base}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}],
                                                 "return_token_strs": True}, timeout=60)
        assert r.status_code == 200, r.text
        assert "".join(r.json()["token_strs"]).replace("Ġ", " ").replace("Ċ", "\n").startswith("<|im_start|>user")
        metrics = httpx.get(f"{base}/metrics", timeout=30).text
        assert "vllm:request_success_total" in metrics and "spec_runtime:request_success_total" not in metrics
    finally:
        serve.shutdown()
        ray.shutdown()
