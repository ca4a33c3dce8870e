"""spec-runtime: exact speculative decoding with the draft model in its own process.

    from spec_runtime import Client, RuntimeConfig, SamplingParams
    with Client(RuntimeConfig()) as client:
        print(client.generate("Hello", max_tokens=32).text)
"""

from protocol.messages import SamplingParams
from spec_runtime.config import ModelConfig, RuntimeConfig, SchedulerConfig, SpeculativeConfig

__all__ = ["AsyncClient", "Client", "GenerationResult", "ModelConfig", "RuntimeConfig", "SamplingParams", "SchedulerConfig",
           "SpeculativeConfig"]


def __getattr__(name):
    # The client pulls in zmq threads and the launcher; import it only when asked for.
    if name == "Client":
        from spec_runtime.client import Client

        return Client
    if name == "GenerationResult":
        from spec_runtime.results import GenerationResult

        return GenerationResult
    if name == "AsyncClient":
        from spec_runtime.server.async_client import AsyncClient

        return AsyncClient
    raise AttributeError(name)
