"""Ray deployment: the target and the draft as Ray actors placed by a placement group,
and the OpenAI-compatible HTTP front-end as a Ray Serve application (docs/ray.md).

Imports ray; the rest of spec_runtime never does, so Ray stays an optional extra
(`pip install -e ".[ray]"`).
"""

from spec_runtime.ray.deploy import PlacementError, RayDeployment, deploy

__all__ = ["PlacementError", "RayDeployment", "deploy"]
