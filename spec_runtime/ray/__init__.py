"""Ray deployment: the target and the draft as Ray actors placed by a placement group,
and the OpenAI-compatible HTTP front-end as a Ray Serve application (docs/ray.md).

`spec-runtime serve --ray` runs spec_runtime.ray.launch. Imports ray; the rest of spec_runtime never does, so Ray stays an optional extra
(`pip install -e ".[ray]"`).
"""

from spec_runtime.ray.deploy import PlacementError, RayDeployment, deploy

__all__ = ["PlacementError", "RayDeployment", "deploy", "build_openai_app"]


def build_openai_app(configs, **kwargs):
    """Several target/draft pairs behind one OpenAI router (spec_runtime.ray.router)."""
    from spec_runtime.ray.router import build_openai_app as build

    return build(configs, **kwargs)
