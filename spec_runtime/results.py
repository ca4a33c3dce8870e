"""What a generation call returns, shared by the local client and the HTTP client."""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.messages import PromptLogprobs, RequestStats, mean_acceptance_length


class RequestFailed(RuntimeError):
    """The runtime rejected or could not finish a request."""


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stats: RequestStats
    logprobs: list[float] = field(default_factory=list)
    # With SamplingParams.prompt_logprobs: the target's logprobs of the prompt's tokens.
    prompt_logprobs: PromptLogprobs | None = None

    def stats_dict(self) -> dict:
        """The request's figures; docs/metrics.md defines each."""
        s = self.stats
        return {
            "num_prompt_tokens": s.num_prompt_tokens,
            "num_cached_tokens": s.num_cached_tokens,
            "num_generated_tokens": s.num_generated_tokens,
            "num_rounds": s.num_rounds,
            "num_drafts": s.num_drafts,
            "num_draft_tokens": s.num_draft_tokens,
            "num_accepted_tokens": s.num_accepted_tokens,
            "mean_acceptance_length": round(mean_acceptance_length(s.num_accepted_tokens, s.num_drafts), 4),
            "acceptance_rate": round(s.num_accepted_tokens / s.num_draft_tokens, 4) if s.num_draft_tokens else 0.0,
            "acceptance_per_position": [
                round(a / d, 4) if d else 0.0 for a, d in zip(s.accepted_per_position, s.drafted_per_position)
            ],
            "num_cache_hits": s.num_cache_hits,
            "num_cache_misses": s.num_cache_misses,
            "num_ar_fallback_rounds": s.num_ar_fallback_rounds,
            "num_sd_rounds": s.num_sd_rounds,
            "num_plain_rounds": s.num_plain_rounds,
            "ttft_s": round(s.ttft_s, 4),
            "e2e_s": round(s.e2e_s, 4),
        }
