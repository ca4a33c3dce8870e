"""Messages of both links, as msgspec Structs.

Vocabulary (used the same way everywhere):
  - draft_token_ids: the K tokens the draft proposes for one sequence.
  - draft_probs:     q, the distribution each draft token was sampled from, sent sparse as its
                     top-k (q_token_ids, q_probs) so a SpecResponse does not grow with the vocabulary.
  - num_accepted:    j, how many draft tokens the target accepted (0..K).
  - recovery/bonus:  the token the target sampled after the accepted prefix: recovery at the
                     first rejection (j < K), bonus when all K were accepted. Both travel as `token_id`.
  - round:           per-sequence counter; a response whose round does not match
                     the target's current round for that sequence is stale.

Arrays (token ids, probabilities) are numpy arrays inside the Structs; the codec
(`protocol.codec`) sends a small one inside the message and a large one as an extra
zero-copy frame. Every message is array_like=True (positional msgpack arrays, tag
first); hot ones are also gc=False, as vLLM's engine core does.
"""

from __future__ import annotations

import numpy as np
import msgspec

PROTOCOL_VERSION = 3

# Placeholder for "no token" in fixed-shape arrays.
PLACEHOLDER_TOKEN_ID = -1


class _Hot(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, forbid_unknown_fields=True):
    pass


# Cold messages are array_like too: msgspec refuses a tagged union that mixes array_like and
# map-encoded Structs, and ErrorReply sits in unions with hot ones. Unlike _Hot they stay gc-tracked.
class _Cold(msgspec.Struct, array_like=True, omit_defaults=True, forbid_unknown_fields=True):
    pass


# ---------------------------------------------------------------- handshake


class Hello(_Cold, tag="hello"):
    """Child -> parent, first message after connecting."""

    protocol_version: int
    role: str  # "target" | "draft"
    pid: int


class Init(_Cold, tag="init"):
    """Parent -> child: the config. `config` is a RuntimeConfig encoded as a dict."""

    protocol_version: int
    config: dict
    # Address the target connects to for the spec link (target only).
    spec_addr: str = ""
    # Address the target binds for the client link (target only).
    client_addr: str = ""


class Ready(_Cold, tag="ready"):
    """Child -> parent: what the child learned while loading."""

    protocol_version: int
    role: str
    pid: int
    vocab_size: int
    kv_capacity: int  # tokens of KV capacity (all blocks together)
    max_batch_size: int
    max_model_len: int
    eos_token_ids: list[int] = []
    # Batch sizes with captured CUDA graphs (empty on CPU).
    graph_batch_sizes: list[int] = []
    model_name: str = ""
    # Seconds per start-up phase (load, kv_alloc, graph_capture) where the child measures them.
    startup_phases: dict[str, float] = {}


# ---------------------------------------------------------------- client link


STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


class StructuredOutputs(_Cold):
    """A constraint on the output, applied as a token mask to the target's distribution
    at every verified position (spec_runtime.structured)."""

    kind: str  # one of STRUCTURED_KINDS
    # json_schema: the schema as JSON text; regex: the pattern; choice: a JSON list of
    # strings; grammar: a Lark grammar; json_object: empty (any JSON object).
    spec: str = ""


class SamplingParams(_Cold):
    """Per-request sampling and stop rules. Validated by `validate_sampling`."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: bool = False
    # Alternatives per generated token (needs logprobs): the target's most likely ids.
    top_logprobs: int = 0
    # Logit processors, applied to the target's logits before temperature (min_p after it);
    # the rejection sampler verifies against the processed distribution, so they stay exact.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1.0 = off
    min_p: float = 0.0
    min_tokens: int = 0  # EOS and stop_token_ids are masked before this many tokens
    logit_bias: dict[int, float] = {}
    # Output text.
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # The output follows this grammar; it ends once the grammar is complete.
    structured: StructuredOutputs | None = None
    # The logprob of every prompt token after the first, from the target's prefill, with
    # this many alternatives each (None: none); they come with the request's first output.
    prompt_logprobs: int | None = None


class GenerateRequest(_Hot, tag="gen"):
    request_id: str
    prompt_token_ids: np.ndarray  # [num_prompt_tokens] int64
    sampling: SamplingParams


class AbortRequest(_Hot, tag="abort"):
    request_id: str


class RequestStats(_Cold):
    """Per-request speculation stats, sent with the final output."""

    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_rounds: int = 0  # verify rounds (AR steps count as rounds with 0 drafts)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # accepted_per_position[i]: rounds in which draft token i+1 was accepted.
    accepted_per_position: list[int] = []
    # drafted_per_position[i]: rounds in which a draft token at i+1 was proposed.
    drafted_per_position: list[int] = []
    num_cache_hits: int = 0
    num_cache_misses: int = 0
    num_ar_fallback_rounds: int = 0
    # SSD mode: rounds answered by a chain drafted on request (the round policy chose SD).
    num_sd_rounds: int = 0
    # SD/SSD: rounds the policy ran as plain decoding (no speculation asked for).
    num_plain_rounds: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    # Arrival in target_proc to the request's KV blocks (the rest of ttft_s is its prefill).
    queue_s: float = 0.0
    # Prompt tokens whose KV came from the prefix cache (OpenAI's usage.prompt_tokens_details.cached_tokens).
    num_cached_tokens: int = 0
    # Times the request's KV was freed to make room and recomputed later.
    num_preemptions: int = 0

    @property
    def num_drafts(self) -> int:
        """Rounds in which the draft proposed at least one token."""
        return self.drafted_per_position[0] if self.drafted_per_position else 0


def mean_acceptance_length(num_accepted_tokens: int, num_drafts: int) -> float:
    """vLLM's acceptance length: 1 + accepted / drafts, the tokens a round with a draft
    yields on average, in [1, K + 1]; 1.0 when nothing was drafted. Every output of the
    runtime (CLI, HTTP usage, /metrics, bench) reports this one figure under this name."""
    return 1.0 + num_accepted_tokens / num_drafts if num_drafts else 1.0


_TOTAL_COUNTERS = ("num_prompt_tokens", "num_generated_tokens", "num_rounds", "num_draft_tokens",
                   "num_accepted_tokens", "num_cache_hits", "num_cache_misses", "num_ar_fallback_rounds",
                   "num_sd_rounds", "num_plain_rounds")


def add_totals(totals: RequestStats, st: RequestStats) -> None:
    """Add a finished request's counters to the engine's totals."""
    for name in _TOTAL_COUNTERS:
        setattr(totals, name, getattr(totals, name) + getattr(st, name))
    for i, (a, d) in enumerate(zip(st.accepted_per_position, st.drafted_per_position)):
        totals.accepted_per_position[i] += a
        totals.drafted_per_position[i] += d


class PromptLogprobs(_Cold):
    """The target's raw log-softmax at each prompt position: entry i is about prompt token
    i + 1 given tokens 0..i (the first prompt token has none)."""

    logprobs: list[float] = []  # [num_prompt - 1] of the prompt's own tokens
    ranks: list[int] = []  # [num_prompt - 1] each one's rank in its distribution (1 = most likely)
    top_token_ids: list[list[int]] = []  # [num_prompt - 1][num_top] the most likely tokens
    top_logprobs: list[list[float]] = []  # [num_prompt - 1][num_top] and their logprobs


class RequestOutput(_Hot):
    request_id: str
    new_token_ids: list[int]
    text_delta: str = ""
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    logprobs: list[float] = []
    stats: RequestStats | None = None
    error: str | None = None
    # With top_logprobs: for each new token, the target's most likely ids and their logprobs.
    top_token_ids: list[list[int]] = []
    top_logprobs: list[list[float]] = []
    # What ended the request with finish_reason "stop": the stop string or token id (None for EOS).
    stop_reason: str | int | None = None
    # With SamplingParams.prompt_logprobs: the prompt's logprobs, on the first output only.
    prompt_logprobs: PromptLogprobs | None = None


class TokenOutputs(_Hot, tag="out"):
    """Target -> client: every request that advanced in one step."""

    step: int
    outputs: list[RequestOutput]


class StatsRequest(_Cold, tag="stats?"):
    pass


class EngineStats(_Cold, tag="stats"):
    """Live state of target_proc (and of the draft as last reported)."""

    num_running: int
    num_waiting: int
    num_free_slots: int
    draft_alive: bool
    mode: str
    totals: RequestStats
    draft_num_seqs: int = -1
    draft_num_cache_entries: int = -1
    # Timing totals (s) over num_steps steps: verify (forward + acceptance; a step queued ahead: from the landing
    # before it), speculation wait, reported work-ahead (SSD), loop_s and admit_s of the iterations that ran a
    # step; host_parts: poll, outcomes, accept, record, verify_launch, land; num_steps_ahead and
    # num_verifies_laid_out: docs/metrics.md.
    num_steps: int = 0
    num_steps_ahead: int = 0
    num_verifies_laid_out: int = 0
    verify_s: float = 0.0
    draft_wait_s: float = 0.0
    draft_work_s: float = 0.0
    loop_s: float = 0.0
    admit_s: float = 0.0
    host_parts: dict[str, float] = {}
    num_plain_steps: int = 0  # steps the speculation policy ran as plain decoding (spec_policy="adaptive")
    # SSD: steps after a request with work-ahead (SSD rounds), without (SD rounds), and halves steps.
    num_ssd_rounds: int = 0
    num_sd_rounds: int = 0
    num_halves_steps: int = 0
    # SSD: times the round policy's choice for a batch size changed (probes not counted), its choice
    # per batch-size bucket ("ssd 27 branches, backup jit", "sd", "plain"), its host time (choose + record).
    num_round_switches: int = 0
    round_choices: dict[int, str] = {}
    round_policy_s: float = 0.0
    # The draft's own time to answer SpecRequests (last reported): draft_wait_s less transfer and queueing.
    draft_answer_s: float = 0.0
    draft_num_answers: int = 0
    # SSD (tree_shape auto): times the draft shrank or grew its tree to fit the verify.
    draft_tree_shrinks: int = 0
    draft_tree_grows: int = 0
    # The draft's prefix caching (as last reported), as prefix_cache_queries/hits below.
    draft_prefix_cache_queries: int = 0
    draft_prefix_cache_hits: int = 0
    # SSD tree-cache hits by the depth j of the outcome they answered (index 0..K).
    hits_by_depth: list[int] = []
    # Rounds that stopped waiting for the draft (late or gone; none waits again until it answers).
    num_draft_timeouts: int = 0
    draft_timeout_s: float = 0.0  # the draft timeout in force (s): --draft-timeout-s, or measured when unset
    # The target's paged KV pool: its size and the blocks free now (cached ones nobody uses included),
    # requests preempted, and prompt tokens looked up and found cached (vLLM's prefix_cache_queries/hits).
    num_kv_blocks: int = 0
    num_free_kv_blocks: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # Chunked prefill: pieces that stopped short of their sequence's end (c pieces add c - 1), and the
    # most tokens one step computed (prefills and verify together; --max-num-batched-tokens bounds it).
    num_prefill_chunks: int = 0
    max_step_tokens: int = 0


class ErrorReply(_Cold, tag="error"):
    """Either link: a message that could not be accepted. The sender keeps serving."""

    code: str  # "bad_message" | "bad_request" | "version" | "internal" | ...
    message: str
    request_id: str = ""
    seq_id: int = -1


# ---------------------------------------------------------------- spec link


class AddSequence(_Hot, tag="add"):
    """Target -> draft: a new (or re-synced) sequence; the draft prefills all of
    prompt_token_ids. The next SpecRequest for it carries (0, the token after them)."""

    seq_id: int
    prompt_token_ids: np.ndarray  # [num_prompt_tokens] int64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


class SpecRequest(_Hot, tag="req"):
    """Target -> draft: the outcomes of one verify step for a batch (one that asks for no
    answer, a plain step's, may carry several steps: each sequence's rows in order).

    For row i: num_accepted[i] of its sequence's last speculation were accepted, then
    token_ids[i] (recovery or bonus) was sampled; a fresh sequence's first is (0, t)."""

    step: int
    seq_ids: np.ndarray  # [B] int64
    rounds: np.ndarray  # [B] int64
    num_accepted: np.ndarray  # [B] int32
    token_ids: np.ndarray  # [B] int64, recovery or bonus token
    # Confirmed length of each sequence including token_ids[i]; on a mismatch with its own
    # bookkeeping the draft answers ErrorReply(code="desync") and the target re-adds the sequence.
    seq_lens: np.ndarray  # [B] int64
    # The K the target wants this round (<= configured K).
    k: int
    # SSD: whether the draft works ahead after answering (False: the next answer is a chain
    # drafted on request, a synchronous SD round; with backup "none", a plain step: no answer).
    work_ahead: bool = True
    # SSD: branches per sequence of the work-ahead (0: the draft's own choice), and what answers
    # this request's cache misses ("": the configured backup; "jit"; "jit:N", N tokens; "none").
    branches: int = 0
    backup: str = ""


class SpecResponse(_Hot, tag="resp"):
    """Draft -> target: the next speculation for each sequence of a SpecRequest."""

    step: int
    seq_ids: np.ndarray  # [B] int64
    rounds: np.ndarray  # [B] int64
    draft_token_ids: np.ndarray  # [B, K] int64, PLACEHOLDER_TOKEN_ID past num_draft_tokens
    num_draft_tokens: np.ndarray  # [B] int32 (a miss with backup=none gives 0)
    cache_hit: np.ndarray  # [B] bool (SD mode: all False)
    # Sparse q: for draft token i of sequence b, q is zero outside q_token_ids[b, i].
    # Absent (empty) when every sequence is greedy.
    q_token_ids: np.ndarray | None = None  # [B, K, top_k] int64
    q_probs: np.ndarray | None = None  # [B, K, top_k] float32
    draft_work_s: float = 0.0  # seconds the draft spent working ahead since the previous request (SSD)
    hits_by_depth: list[int] = []
    hit_rank: np.ndarray | None = None  # [B] int32: the rank of a hit's branch (DraftTokens.hit_rank), -1 else


class Release(_Hot, tag="rel"):
    """Target -> draft: free the KV and tree cache of these sequences."""

    seq_ids: np.ndarray  # [N] int64


class DraftStatsRequest(_Cold, tag="dstats?"):
    pass


class DraftStats(_Cold, tag="dstats"):
    num_seqs: int
    num_cache_entries: int
    num_requests: int
    num_hits: int
    num_misses: int
    # Seconds from receiving a SpecRequest to sending its answer, summed over num_answers.
    answer_s: float = 0.0
    num_answers: int = 0
    # SSD: TreeBudget's moves to fewer / more branches per sequence.
    num_tree_shrinks: int = 0
    num_tree_grows: int = 0
    # The draft's KV pool, blocks free now, prefix caching in prompt tokens (as EngineStats).
    num_kv_blocks: int = 0
    num_free_kv_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


class Shutdown(_Cold, tag="bye"):
    pass


HandshakeMessage = Hello | Init | Ready | ErrorReply
# No Shutdown on the client link: any local client could stop the target with it; the
# launcher stops its children with signals.
ClientMessage = GenerateRequest | AbortRequest | StatsRequest
TargetToClientMessage = TokenOutputs | EngineStats | ErrorReply
SpecLinkToDraft = AddSequence | SpecRequest | Release | DraftStatsRequest | Shutdown
SpecLinkToTarget = SpecResponse | DraftStats | ErrorReply
