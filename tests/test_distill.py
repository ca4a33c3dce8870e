"""`spec-runtime distill` on tiny random targets: training, the output as --draft, resume.

The target is a tiny random Llama whose attention and MLP outputs are scaled down and
whose LM head is sharpened, so its next token depends mostly on the current one: a
distribution a one-layer draft can learn in a few dozen steps, unlike the near-uniform
output of an unscaled random model.
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from conftest import save_tiny_model
from protocol.messages import SamplingParams
from spec_runtime import cli
from spec_runtime.distill import DistillConfig
from spec_runtime.distill import train as distill_train
from spec_runtime.distill.shape import count_params, draft_config

WORDS = "the quick brown fox jumps over lazy dog hello world capital paris one two three four five".split()
FAST = ["--max-new-tokens", "32", "--batch-size", "16", "--lr", "1e-2", "--warmup-steps", "5",
        "--hidden-size", "32", "--num-layers", "1", "--gen-batch-size", "48", "--held-out-fraction", "0.25"]


def learnable_target(path) -> str:
    from safetensors.torch import load_file, save_file

    path = save_tiny_model(path, "llama")
    weights = load_file(os.path.join(path, "model.safetensors"))
    for name in weights:
        if "o_proj" in name or "down_proj" in name:
            weights[name] = weights[name] * 0.03
        if "lm_head" in name:
            weights[name] = weights[name] * 4
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


def prompts_file(path, n: int) -> str:
    rng = random.Random(0)
    with open(path, "w") as f:
        f.write("\n".join(" ".join(rng.choice(WORDS) for _ in range(6)) for _ in range(n)))
    return str(path)


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    target = learnable_target(root / "target")
    prompts = prompts_file(root / "prompts.txt", 96)
    out = str(root / "draft")
    gguf = str(root / "draft.gguf")
    rc = cli.main(["distill", target, "--out", out, "--prompts", prompts, "--steps", "40", "--eval-every", "20",
                   "--save-every", "20", "--gguf", gguf, *FAST])
    assert rc == 0
    with open(os.path.join(out, "distill.json")) as f:
        return {"target": target, "draft": out, "gguf": gguf, "summary": json.load(f)}


def test_training_raises_held_out_acceptance_and_lowers_kl(distilled):
    s = distilled["summary"]
    assert s["steps"] == 40 and s["held_out_samples"] > 0
    assert s["held_out_kl"] < s["untrained_held_out_kl"] - 0.5
    assert s["held_out_acceptance"] > s["untrained_held_out_acceptance"] + 0.1
    losses = [h["train_loss"] for h in s["history"] if "train_loss" in h]
    assert losses[-1] < losses[0]


def test_draft_dir_has_target_vocab_and_tied_head(distilled):
    with open(os.path.join(distilled["draft"], "config.json")) as f:
        draft_cfg = json.load(f)
    with open(os.path.join(distilled["target"], "config.json")) as f:
        target_cfg = json.load(f)
    assert draft_cfg["vocab_size"] == target_cfg["vocab_size"]
    assert draft_cfg["num_hidden_layers"] == 1 and draft_cfg["hidden_size"] == 32
    assert draft_cfg["tie_word_embeddings"] is True
    assert os.path.isfile(os.path.join(distilled["draft"], "tokenizer.json"))


def _generate_json(capsys, target: str, mode: str, draft: str = "") -> dict:
    argv = ["generate", "hello world the quick", "--target", target, "--mode", mode, "--k", "3",
            "--max-tokens", "24", "--json", "--raw"]
    if draft:
        argv += ["--draft", draft]
    assert cli.main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_draft_loads_with_draft_flag_and_sd_greedy_equals_ar(distilled, capsys):
    ar = _generate_json(capsys, distilled["target"], "ar")
    sd = _generate_json(capsys, distilled["target"], "sd", distilled["draft"])
    assert sd["token_ids"] == ar["token_ids"]
    assert sd["stats"]["num_draft_tokens"] > 0
    assert sd["stats"]["num_accepted_tokens"] > 0  # the distilled draft is right some of the time


def test_gguf_draft_loads_with_draft_flag_and_sd_greedy_equals_ar(distilled, capsys):
    assert distilled["summary"]["gguf"]["tensor_types"] == {"Q8_0": 8, "F32": 3}  # 1 layer, tied head
    ar = _generate_json(capsys, distilled["target"], "ar")
    sd = _generate_json(capsys, distilled["target"], "sd", distilled["gguf"])
    assert sd["draft"] == distilled["gguf"]
    assert sd["token_ids"] == ar["token_ids"]
    assert sd["stats"]["num_accepted_tokens"] > 0


def test_ssd_greedy_equals_ar(distilled, ar_reference):
    from e2e_util import make_config
    from spec_runtime.client import Client

    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 14, 20], [30, 31, 32, 33, 34, 35, 36]]
    ar = ar_reference(distilled["target"], prompts, greedy.max_tokens)
    with Client(make_config(distilled["target"], distilled["draft"], mode="ssd")) as client:
        ssd = [r.token_ids for r in client.generate_batch(prompts, greedy)]
    assert ssd == ar


def _weights(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def test_resume_continues_from_the_checkpoint(tmp_path, monkeypatch):
    target = learnable_target(tmp_path / "target")
    prompts = prompts_file(tmp_path / "prompts.txt", 24)
    args = ["--prompts", prompts, "--steps", "8", "--save-every", "4", "--eval-every", "4", *FAST]
    straight = str(tmp_path / "straight")
    assert cli.main(["distill", target, "--out", straight, *args]) == 0

    # Interrupt a second run right after its first checkpoint (step 4).
    class Killed(Exception):
        pass

    save = distill_train._save_checkpoint

    def save_then_die(*a, **kw):
        save(*a, **kw)
        raise Killed

    resumed = str(tmp_path / "resumed")
    monkeypatch.setattr(distill_train, "_save_checkpoint", save_then_die)
    with pytest.raises(Killed):
        cli.main(["distill", target, "--out", resumed, *args])
    monkeypatch.setattr(distill_train, "_save_checkpoint", save)
    assert not os.path.isfile(os.path.join(resumed, "model.safetensors"))
    teacher = os.path.join(resumed, ".distill", "teacher.pt")
    mtime = os.stat(teacher).st_mtime_ns

    # Without --resume the half-done directory is refused, with it the run finishes.
    assert cli.main(["distill", target, "--out", resumed, *args]) == 2
    assert cli.main(["distill", "--out", resumed, "--resume"]) == 0
    assert os.stat(teacher).st_mtime_ns == mtime  # the teacher data was reused, not regenerated
    with open(os.path.join(resumed, "distill.json")) as f:
        summary = json.load(f)
    assert summary["steps"] == 8
    assert [h["step"] for h in summary["history"]] == [0, 4, 8]
    a, b = _weights(straight), _weights(resumed)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6)


def test_resume_refuses_a_changed_shape_or_an_empty_dir(tmp_path, capsys):
    out = tmp_path / "d"
    assert cli.main(["distill", "--out", str(out), "--resume"]) == 2
    assert "no distillation run to resume" in capsys.readouterr().err
    (out / ".distill").mkdir(parents=True)
    (out / ".distill" / "config.json").write_text(json.dumps(DistillConfig(target="t", out=str(out),
                                                                           num_layers=2).to_dict()))
    assert cli.main(["distill", "--out", str(out), "--resume", "--num-layers", "3"]) == 2
    assert "num_layers: checkpoint 2, given 3" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [{"steps": 0}, {"held_out_fraction": 1.0}, {"out": ""}, {"num_layers": -1}])
def test_config_rejects_bad_values(bad):
    with pytest.raises(ValueError):
        DistillConfig(**{"target": "t", "out": "o", **bad})


@pytest.mark.parametrize("shape", [
    # SmolLM2-135M, Llama-3-8B
    dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
         num_key_value_heads=3, tie_word_embeddings=True),
    dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
         num_key_value_heads=8, tie_word_embeddings=False),
])
def test_default_draft_is_about_a_tenth_of_the_target(shape):
    from transformers import AutoModelForCausalLM, LlamaConfig

    with torch.device("meta"):
        target = AutoModelForCausalLM.from_config(LlamaConfig(**shape))
        cfg = draft_config(target.config, count_params(target))
        draft = AutoModelForCausalLM.from_config(cfg)
    ratio = count_params(draft) / count_params(target)
    assert 0.07 < ratio < 0.13, ratio
    assert cfg.vocab_size == shape["vocab_size"] and cfg.tie_word_embeddings
    assert cfg.num_attention_heads % cfg.num_key_value_heads == 0


class _ScriptedTarget(torch.nn.Module):
    """Stands in for the target in prompt sampling: `generate` returns scripted user turns."""

    def __init__(self, turns: list[list[int]]):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.turns = turns
        self.calls = 0

    def generate(self, input_ids, max_new_tokens, **kw):
        rows = []
        for r in range(input_ids.shape[0]):
            turn = self.turns[(self.calls * input_ids.shape[0] + r) % len(self.turns)][:max_new_tokens]
            rows.append(input_ids[r].tolist() + turn + [kw["pad_token_id"]] * (max_new_tokens - len(turn)))
        self.calls += 1
        return torch.tensor(rows)


def test_self_prompts_are_finished_distinct_user_turns(tmp_path):
    from conftest import tiny_tokenizer
    from spec_runtime.distill.data import sample_prompts, user_turn_prefix

    tok = tiny_tokenizer()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    prefix = user_turn_prefix(tok)
    rendered = tok.apply_chat_template([{"role": "user", "content": "hello there"}], tokenize=False)
    assert rendered.startswith(tok.decode(prefix)) and "hello there" not in tok.decode(prefix)
    a = tok.encode("What is the tallest mountain?", add_special_tokens=False)
    b = tok.encode("Write a poem about rain.", add_special_tokens=False)
    unfinished = tok.encode("This turn never ends and runs on", add_special_tokens=False)
    short = tok.encode("Hi", add_special_tokens=False)
    target = _ScriptedTarget([a + [eos], unfinished, a + [eos], short + [eos], b + [eos]])
    prompts = sample_prompts(target, tok, [eos], 2, batch_size=5, seed=0, max_tokens=len(unfinished))
    assert prompts == ["What is the tallest mountain?", "Write a poem about rain."]


def test_draft_config_drops_the_targets_quantization(tmp_path):
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=300)
    cfg.quantization_config = {"quant_method": "gguf", "gguf_file": "target.gguf"}
    draft = draft_config(cfg, 10_000_000, 1, 32)
    text = draft.to_json_string()
    assert "quantization_config" not in text and "gguf" not in text
    assert cfg.quantization_config["quant_method"] == "gguf"  # the target's own config is untouched
