"""Where an SD round's time goes against an AR step, on the embedded SmolLM2 pair (CPU).

For `ar` and `sd` (K=4, the shipped draft, greedy, chat template): tokens/s of one
128-token request after a 16-token warm-up, and from the engine stats the target's verify
(or decode) time per step, the wait for the draft per step and the draft's answer time.

    python scripts/cpu_sd_split.py
"""

import time
from spec_runtime.client import Client
from spec_runtime.config import RuntimeConfig, SpeculativeConfig
from protocol.messages import SamplingParams
P = "Write a short story about a robot who learns to paint."
for mode in ("ar", "sd"):
    with Client(RuntimeConfig(spec=SpeculativeConfig(mode=mode, k=4))) as c:
        ids = c.encode_prompt(P, chat=True)
        c.generate(ids, SamplingParams(max_tokens=16))
        b = c.engine_stats(); t = time.perf_counter()
        r = c.generate(ids, SamplingParams(max_tokens=128))
        w = time.perf_counter() - t; a = c.engine_stats()
        n = a.num_steps - b.num_steps
        print(mode, f"{len(r.token_ids)/w:.1f} tok/s, steps {n}, verify {1e3*(a.verify_s-b.verify_s)/n:.1f} ms/step, "
              f"draft wait {1e3*(a.draft_wait_s-b.draft_wait_s)/n:.1f} ms/step, draft answer "
              f"{1e3*(a.draft_answer_s-b.draft_answer_s)/max(1,a.draft_num_answers-b.draft_num_answers):.1f} ms", flush=True)
