"""Settings of one distillation run (`spec-runtime distill`), validated once."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

# Kept here (not imported from export.py) so the CLI's flags import no numpy or gguf.
GGUF_TYPES = ("q8_0", "q5_1", "f16", "f32")

# Fields that fix the draft's shape or its training data: a resumed run must not change them.
RESUME_FIXED = ("target", "num_layers", "hidden_size", "intermediate_size", "top_k_logits", "max_new_tokens",
                "samples_per_prompt", "gen_temperature", "prompts", "self_prompts", "held_out_fraction", "seed")


@dataclass(frozen=True)
class DistillConfig:
    target: str
    out: str
    # Draft shape; 0 picks the default (about 1/10 of the target's parameters).
    num_layers: int = 0
    hidden_size: int = 0
    intermediate_size: int = 0
    # Teacher data: the target's own continuations of the prompts, with its top-k log-probs.
    prompts: str = ""  # a file with one prompt per line; "" = the prompts shipped with the package
    num_prompts: int = 0  # 0 = all of them
    self_prompts: int = 0  # user turns the target writes itself, added to the prompt set
    max_new_tokens: int = 128
    samples_per_prompt: int = 1  # the first is greedy, the others sampled at gen_temperature
    gen_temperature: float = 0.8
    gen_batch_size: int = 16
    top_k_logits: int = 64
    held_out_fraction: float = 0.05
    # Training.
    steps: int = 1000
    batch_size: int = 8
    lr: float = 1e-3
    warmup_steps: int = 50
    weight_decay: float = 0.0
    eval_every: int = 50
    save_every: int = 100
    device: str = ""  # "" = cuda if available, else cpu
    seed: int = 0
    resume: bool = False
    # Also write the draft as one GGUF file (spec_runtime.distill.export); "" = do not.
    gguf: str = ""
    gguf_type: str = "q8_0"

    def __post_init__(self) -> None:
        if not self.out:
            raise ValueError("--out is required: the directory the draft is written to")
        for name in ("num_layers", "hidden_size", "intermediate_size", "num_prompts", "self_prompts"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 = default), got {getattr(self, name)}")
        for name in ("max_new_tokens", "samples_per_prompt", "gen_batch_size", "top_k_logits", "steps",
                     "batch_size", "eval_every", "save_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 < self.held_out_fraction < 1.0:
            raise ValueError(f"held_out_fraction must be in (0, 1), got {self.held_out_fraction}")
        if self.gen_temperature <= 0.0:
            raise ValueError(f"gen_temperature must be > 0, got {self.gen_temperature}")
        if self.gguf_type not in GGUF_TYPES:
            raise ValueError(f"gguf_type must be one of {', '.join(GGUF_TYPES)}, got {self.gguf_type!r}")
        if self.gguf and not self.gguf.endswith(".gguf"):
            raise ValueError(f"gguf must name a .gguf file, got {self.gguf!r}")
        if self.lr <= 0.0 or self.weight_decay < 0.0:
            raise ValueError(f"lr must be > 0 and weight_decay >= 0, got {self.lr}, {self.weight_decay}")

    def to_dict(self) -> dict:
        return asdict(self)

    def check_resumable(self, saved: dict) -> None:
        """ValueError naming every field that differs from the checkpoint's run."""
        known = {f.name for f in fields(self)}
        diff = [f"{k}: checkpoint {saved[k]!r}, given {getattr(self, k)!r}"
                for k in RESUME_FIXED if k in saved and k in known and saved[k] != getattr(self, k)]
        if diff:
            raise ValueError("--resume with settings that change the draft or its data: " + "; ".join(diff))
