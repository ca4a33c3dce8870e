"""`spec-runtime distill`: train a small draft for a target on the target's own text.

The draft shares the target's tokenizer and vocabulary, starts from the target's
embeddings, and learns the target's next-token distribution (forward KL on its top-k
log-probs) at every position of continuations the target generated from a prompt set.
The result is a Hugging Face directory that `--draft DIR` loads.
"""

from spec_runtime.distill.config import DistillConfig

__all__ = ["DistillConfig", "distill"]


def distill(cfg: DistillConfig) -> dict:
    from spec_runtime.distill.train import distill as run

    return run(cfg)
