"""target_proc main loop: continuous batching, chain verification, acceptance, streaming.

One step:
  1. collect the speculations the draft sent for the running sequences (SD/SSD), with the
     verify forward laid out while they come (target_proc/verify_forward.py);
  2. one verify forward over [x_n, d_1..d_m] per sequence (m = 0 is a plain decode);
  3. rejection-sample: accepted prefix j and a recovery/bonus token t per sequence;
  4. send the outcomes (j, t) to the draft at once, before any host post-processing,
     so the draft's next answer overlaps with 5 and 6 (overlap-scheduled acceptance);
  5. apply stop rules token by token inside the accepted chunk, detokenize, stream;
  6. admit waiting requests (prefill, first token) and release finished ones.
AR mode is the same loop with m = 0 for every sequence; a halves step (SSD) runs 1 to 5
over one half of the running sequences, in turn (target_proc/halves.py). A plain step
may be queued ahead: its forward and sampling go to the GPU before the step before it
lands on the host, whose steps 4 to 6 then run while the GPU computes (target_proc/ahead.py).
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque

import torch

from protocol.messages import (PLACEHOLDER_TOKEN_ID, EngineStats, RequestOutput, RequestStats, TokenOutputs,
                               add_totals)
from protocol.sparse_q import DraftTokens
from spec_runtime.config import RuntimeConfig, step_token_budget
from spec_runtime.engine.kv_blocks import KVBlocks
from spec_runtime.rejection import rejection_sample
from spec_runtime.structured import Grammars
from target_proc.ahead import (Launched, ahead_of, allows_ahead, ends_by_length, fill_tokens, request_plan,
                               to_host)
from target_proc.draft_link import DraftLink
from target_proc.drain import batch_drain
from target_proc.halves import Halves
from target_proc.kv_schedule import KVScheduler
from target_proc.no_draft import NoDraft
from target_proc.outputs import merge_outputs, record_round, take_output
from target_proc.prompt_logprobs import add_prompt_logprobs, split_prefill_logits
from target_proc.requests import ClientRequests
from target_proc.sequence import Sequence, StopChecker
from target_proc.round_policy import PLAIN, SD, STEADY_AFTER_ROUNDS, RoundPlan, RoundPolicy
from target_proc.spec_policy import SpecPolicy
from target_proc.verify import (SamplingCache, device_logprobs, logits_process, logprobs_at, logprobs_lists,
                                output_logprobs, sampling_tensors, transform_rows)
from target_proc.verify_forward import LaidOut, forward_laid_out, forward_after_answer, lay_out

logger = logging.getLogger(__name__)


class TargetWorker(ClientRequests):
    def __init__(self, cfg: RuntimeConfig, runner, client_channel, draft_link: DraftLink | None,
                 logits_transform=None):
        """logits_transform(logits [N, V], seqs, positions [N]) -> logits, applied to every
        forward's logits (row i predicts position positions[i] of seqs[i]): the synthetic
        acceptance oracle in benchmarks (spec_runtime.bench.oracle); None otherwise."""
        self.cfg = cfg
        self.runner = runner
        self.clients = client_channel
        self.draft = draft_link if draft_link is not None else NoDraft()
        self.logits_transform = logits_transform
        self.k = cfg.spec.k if cfg.spec.mode != "ar" else 0
        self.max_model_len = runner.layout.max_model_len
        self.stop_checker = StopChecker(runner.eos_token_ids, self.max_model_len)
        self.grammars = Grammars(runner.tokenizer, runner.vocab_size, runner.eos_token_ids)
        layout = runner.layout
        self.kv = KVBlocks(layout.num_blocks, layout.block_size, cfg.sched.enable_prefix_caching)
        self.sched = KVScheduler(self.kv, self.k, self.max_model_len, cfg.sched.max_batch_size,
                                 step_token_budget(cfg.sched, self.max_model_len))
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}
        self.by_request: dict[tuple[bytes, str], Sequence] = {}
        self.next_seq_id = 0
        self.step_id = 0
        self.rng = random.Random(cfg.seed)
        self.totals = RequestStats(accepted_per_position=[0] * self.k, drafted_per_position=[0] * self.k)
        self.outputs: dict[bytes, list[RequestOutput]] = {}
        self.timing = dict.fromkeys(("verify_s", "draft_wait_s", "draft_work_s", "loop_s", "admit_s"), 0.0)
        self.timing["num_steps"] = self.timing["num_steps_ahead"] = self.timing["num_verifies_laid_out"] = 0
        self.timing["host_parts"] = dict.fromkeys(("poll", "outcomes", "accept", "record", "verify_launch", "land"),
                                                  0.0)
        self.policy = SpecPolicy(cfg.sched.spec_policy, cfg.sched.spec_policy_probe_every)
        self._context = 0
        # SSD: each step's plan (SSD round, SD round, halves step or plain step) from measured costs.
        self.rounds = RoundPolicy.for_config(cfg) if cfg.spec.mode == "ssd" else None
        # The work_ahead flags of the last three requests: a step's answer comes from the cache built
        # after the request two back, or a chain when that one had no work-ahead (record_round).
        self._last_flags = (True, True, True)
        self._halves, self.sampling_cache = Halves(), SamplingCache(runner)
        # A plain step queued but not landed (target_proc/ahead.py), and when the last step landed.
        self._ahead: Launched | None = None
        self._landed_at, self._landed_step = 0.0, -1
        overlap = cfg.sched.overlap_schedule
        self._overlap = runner.tp is None and (overlap == "on" or overlap == "auto" and runner.device.type == "cuda")

    # ------------------------------------------------------------------ loop

    def run_forever(self) -> None:
        """Serve until the process is stopped (the launcher signals its children)."""
        while True:
            t0 = time.perf_counter()
            if idle := not self.running and not self.waiting:
                self._landed_step = -1  # the wait for a request is no step's lead
            self.poll_clients(block=idle)
            self.draft.check()
            t1 = time.perf_counter()
            self.admit()
            t2 = time.perf_counter()
            ran = self.step() if self.running or self._ahead else False
            self.flush_outputs()
            if ran:  # the parts of a step's iteration that verify_s and draft_wait_s leave out
                self.timing["loop_s"] += time.perf_counter() - t0
                self.timing["admit_s"] += t2 - t1
                self.timing["host_parts"]["poll"] += t1 - t0

    # ------------------------------------------------------------------ admission

    def admit(self) -> None:
        """Prefill the waiting requests the KV pool can take (kv_schedule.py) and sample
        the first token of the new ones; preempted ones recompute their KV only."""
        adm = self.sched.admit(self.waiting, self.running)
        new = adm.new
        if new:  # Tell the draft first: it prefills (SSD: and works ahead) while the target prefills.
            self.draft.admit(new)
        flat = self.runner.run(adm.items) if adm.items else None
        if adm.piece is not None and adm.piece[1].logits == "all":  # its rows come last
            seq, it = adm.piece
            add_prompt_logprobs(seq, it.start_pos, flat[flat.shape[0] - len(it.token_ids):], last=False)
        if not new:
            return
        # Logits rows: per new item (they come first), 1 ("last") or one per token ("all").
        logits, prompt_rows = split_prefill_logits(
            flat, [len(it.token_ids) if it.logits == "all" else 1 for it in adm.items[:len(new)]])
        for seq, rows, it in zip(new, prompt_rows, adm.items):
            if seq.sampling.prompt_logprobs is not None:
                add_prompt_logprobs(seq, it.start_pos, rows, last=True)
        logits = transform_rows(self.logits_transform, logits, new, [1] * len(new))  # [B, V]
        st = sampling_tensors(new, self.runner.device)
        positions = torch.tensor([s.num_tokens for s in new], dtype=torch.int64, device=logits.device)
        proc = logits_process(new, self.runner)
        res = rejection_sample(
            self.grammars.mask([s.grammar for s in new],
                               proc.apply(logits[:, None, :]) if proc is not None else logits[:, None, :]),
            torch.full((len(new), 0), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=logits.device),
            torch.zeros(len(new), dtype=torch.int64, device=logits.device),
            None,
            None,
            st,
            positions,
        )
        tokens = res.output_token_ids[:, 0].cpu().tolist()  # sync: the host streams the first token
        logprobs = output_logprobs(new, logits[:, None, :], res.output_token_ids[:, :1])
        now = time.monotonic()
        for i, (seq, tok) in enumerate(zip(new, tokens)):
            seq.stats.num_rounds += 1
            seq.stats.ttft_s = now - seq.arrival_s
            if self.stop_checker.append(seq, tok, *logprobs_at(logprobs, i, 0)) or self._grammar_commit(seq, [tok]):
                self.finish(seq)
            else:
                self.sched.commit(seq)
        self.draft.send_first_tokens(new)
        self._emit(new)

    # ------------------------------------------------------------------ one round

    def step(self) -> bool:
        """One round over every running sequence (the module docstring's steps 1 to 5);
        False when preemption left none to run. A plain step that may run ahead
        (target_proc/ahead.py) is only queued: the next call lands it."""
        self.step_id += 1
        prev, self._ahead = self._ahead, None
        ahead = {s.seq_id for s in prev.seqs if not ends_by_length(s, self.max_model_len)} if prev else ()
        for seq in self.sched.reserve(self.running, self.waiting, ahead):
            self.draft.preempt(seq.seq_id)  # re-synced when it runs again
        seqs = list(self.running.values())
        if not seqs:
            return prev is not None and self._land(prev) is None
        t0 = time.perf_counter()
        # Plain steps keep the draft in sync: it gets each outcome as (0, t), answering nothing.
        self._context = sum(s.num_tokens for s in seqs) // len(seqs)  # the round policy's cost bucket
        plan, batch = self._plan(seqs), len(seqs)
        early = self._overlap and not plan.speculate and allows_ahead(seqs)
        if prev is not None and early:  # those prev ends by length run no more
            seqs = [s for s in seqs if s.seq_id in ahead or s.seq_id not in prev.row_of]
        elif prev is not None:
            self._land(prev, plan)  # a plain step before a speculating one: its request goes now
            seqs, t0, prev = [s for s in seqs if self.running.get(s.seq_id) is s], time.perf_counter(), None
        if not seqs:  # prev ended every sequence
            if prev is not None:
                self._land(prev)
            return True
        seqs = self._halves.next(seqs) if plan.kind == "halves" else seqs
        # A speculating step's forward is laid out while the draft answers (target_proc/verify_forward.py).
        laid = lay_out(self, seqs) if plan.speculate else None
        specs = self.draft.collect(seqs) if plan.speculate else {}
        run = self._launch(seqs, specs, plan, batch, t0, prev if early else None, laid)
        # The lead: the host's work since the last step landed, in the call before (outputs, clients,
        # admission), busy time of this step. One queued behind another is timed from that one's landing.
        if prev is None and self._landed_step == self.step_id - 1:
            run.lead = max(0.0, t0 - self._landed_at)
        if early:
            if prev is not None:
                self._land(prev)  # while `run` computes
            self._ahead = run
            self.timing["num_steps_ahead"] += prev is not None
        else:
            self._land(run)
        return True

    def _land(self, run: Launched, upcoming: RoundPlan | None = None) -> None:
        """Read a queued step's tokens to the host (the sync), then tell the draft, apply
        them, feed the round policy and stream. Sequences that ended or left (finished,
        aborted, preempted) since it was queued are skipped. upcoming: the next step's plan,
        when chosen already (target_proc/ahead.py's request_plan)."""
        t2 = time.perf_counter()
        if run.done is not None:
            run.done.synchronize()  # sync: the accepted prefix decides what the host does next
        num_accepted, out_tokens = run.host[0].tolist(), run.host[1].tolist()
        seqs, num_draft = run.seqs, run.num_draft
        logprobs = logprobs_lists(run.host[2:]) if len(run.host) > 2 else None  # (logprobs, top ids, top logprobs)
        if any(self.running.get(s.seq_id) is not s for s in seqs):
            keep = [i for i, s in enumerate(seqs) if self.running.get(s.seq_id) is s]
            seqs, num_draft = [seqs[i] for i in keep], [num_draft[i] for i in keep]
            num_accepted, out_tokens = [num_accepted[i] for i in keep], [out_tokens[i] for i in keep]
            logprobs = logprobs and tuple(None if x is None else [x[i] for i in keep] for x in logprobs)
        tm = self.timing
        start = max(run.t1, self._landed_at)  # a step queued ahead counts from the landing before it
        tm["num_steps"] += 1
        tm["draft_wait_s"] += run.t1 - run.t0
        tm["verify_s"] += (t3 := time.perf_counter()) - start
        draft_work_s = self.draft.take_draft_work_s()
        tm["draft_work_s"] += draft_work_s
        # Overlap-scheduled acceptance: tell the draft first, post-process after. SSD:
        # the plan says whether the draft works ahead for the next round (at which tree
        # shape, with which backup) or answers it with a chain (SD); plain steps wait for nothing.
        plan, specs = run.plan, run.specs
        sent = request_plan(plan, upcoming)
        self.draft.send_outcomes(seqs, specs, num_accepted, out_tokens, plan.speculate, lambda n: sent)
        t4 = time.perf_counter()
        self._accept(seqs, specs, num_draft, num_accepted, out_tokens, logprobs, plan.speculate)
        t5 = time.perf_counter()
        self._record_step(seqs, plan, specs, num_draft, num_accepted, run.t1 - run.t0, t5 - start + run.lead,
                          draft_work_s, run.batch, sent)
        parts = tm["host_parts"]
        parts["outcomes"] += t4 - t3
        parts["accept"] += t5 - t4
        parts["record"] += time.perf_counter() - t5
        parts["land"] += t3 - t2
        self._landed_at, self._landed_step = t5, self.step_id  # queued back to back: timed landing to landing
        self._emit(seqs)

    def _plan(self, seqs: list[Sequence]) -> RoundPlan:
        if not self.draft.present:
            return PLAIN
        if self.rounds is not None:  # steady: the step's record will measure (_record_step)
            steady = all(s.stats.num_rounds >= STEADY_AFTER_ROUNDS for s in seqs)
            drain = None if self.waiting else batch_drain(  # the tokens each may still decode; none while one waits
                [min(s.sampling.max_tokens - s.num_generated, self.max_model_len - s.num_tokens) for s in seqs], 0)
            return self.rounds.choose(len(seqs), self._context, steady, drain=drain)
        return SD if self.policy.use_speculation(len(seqs)) else PLAIN

    def _accept(self, seqs, specs, num_draft, num_accepted, out_tokens, logprobs, speculate: bool) -> None:
        """Count each round, then append its accepted and recovery/bonus tokens one by one (a stop cuts there)."""
        ssd = self.cfg.spec.mode == "ssd"
        sd_round = ssd and speculate and not self._last_flags[-2]
        append, speculating = self.stop_checker.append, bool(self.k and speculate)
        for i, seq in enumerate(seqs):
            j, toks = num_accepted[i], out_tokens[i]
            record_round(seq.stats, num_draft[i], j, specs.get(seq.seq_id), ssd=ssd, sd_round=sd_round,
                         speculating=speculating, plain=bool(self.k) and not speculating)
            tokens_only = logprobs is None and seq.grammar is None  # the usual request
            for t in range(j + 1):
                # A complete grammar ends the sequence at its last token, as in AR decoding.
                if (append(seq, toks[t]) if tokens_only else (append(seq, toks[t], *logprobs_at(logprobs, i, t))
                                                              or self._grammar_commit(seq, toks[t:t + 1]))):
                    break
            if seq.finished:
                self.finish(seq)
            else:
                self.sched.commit(seq)

    def _record_step(self, seqs, plan: RoundPlan, specs, num_draft, num_accepted, wait_s: float, busy_s: float,
                     draft_work_s: float, batch: int, sent: RoundPlan) -> None:
        """Feed the step's timings to the policy that chose its plan (batch: every running sequence;
        sent: the plan whose request went with its outcomes); a step that finished a sequence
        measures nothing (releasing it is a one-off host cost)."""
        if self.rounds is not None:
            steady = all(s.stats.num_rounds > STEADY_AFTER_ROUNDS and not s.finished for s in seqs)
            self.rounds.record_step(plan, specs, num_draft, num_accepted, wait_s, busy_s,
                                    draft_work_s, steady=steady, context=self._context, batch=batch, sent=sent)
        elif self.draft.present:
            self.policy.record(len(seqs), plan.speculate, sum(n + 1 for n in num_accepted), wait_s + busy_s)
        self._last_flags = self._last_flags[1:] + (sent.work_ahead,)

    def _launch(self, seqs: list[Sequence], specs: dict[int, DraftTokens], plan: RoundPlan, batch: int, t0: float,
                prev: Launched | None, laid: LaidOut | None = None) -> Launched:
        """Queue one verify forward over [x_n, d_1..d_m] per sequence (m = 0: a plain step),
        then rejection sampling; nothing waits on the GPU. prev: the plain step still on the
        device whose sampled tokens feed the sequences it ran (target_proc/ahead.py); laid: the
        forward laid out while the draft answered (target_proc/verify_forward.py)."""
        t1 = time.perf_counter()
        fwd = forward_laid_out(self, laid, specs) if laid is not None else None
        self.timing["num_verifies_laid_out"] += fwd is not None
        if fwd is None:
            rows = ahead_of(prev, seqs)
            fwd = forward_after_answer(self, seqs, specs, rows, fill_tokens(prev, rows) if prev is not None else None)
        self.sched.count_step_tokens(sum(fwd.q_lens))
        flat_logits, inputs, num_draft = fwd.flat_logits, fwd.inputs, fwd.num_draft
        target_logits = flat_logits[inputs.gather]  # [sum(q_lens), V] -> [B, k_max + 1, V]
        proc = logits_process(seqs, self.runner)
        if proc is not None:
            target_logits_p = proc.apply(target_logits, inputs.draft_token_ids)
        else:
            target_logits_p = target_logits
        if any(s.grammar is not None for s in seqs):
            drafts = [specs[s.seq_id].draft_token_ids[:m] if m else () for s, m in zip(seqs, num_draft)]
            target_logits_p = self.grammars.mask([s.grammar for s in seqs], target_logits_p, drafts)
        res = rejection_sample(target_logits_p, inputs.draft_token_ids, inputs.num_draft_tokens, inputs.q_token_ids,
                               inputs.q_probs, inputs.st, inputs.positions)
        self.timing["host_parts"]["verify_launch"] += time.perf_counter() - t1
        logprobs = device_logprobs(seqs, target_logits, res.output_token_ids)
        return Launched(seqs, plan, specs, num_draft, res.output_token_ids,
                        *to_host(res.num_accepted, res.output_token_ids, *(logprobs or ())), batch, t0, t1,
                        {s.seq_id: i for i, s in enumerate(seqs)})

    # ------------------------------------------------------------------ helpers

    def _grammar_commit(self, seq: Sequence, token_ids: list[int]) -> bool:
        """Commit a structured sequence's new tokens to its grammar; True (and the sequence
        finished) once the grammar is complete."""
        if seq.grammar is None or seq.finished or not self.grammars.advance(seq.grammar, token_ids, seq.request_id):
            return False
        seq.finished, seq.finish_reason = True, "stop"
        return True

    def finish(self, seq: Sequence) -> None:
        """Free the KV blocks and the draft's state; the final output goes out with this step's."""
        self.running.pop(seq.seq_id, None)
        self.by_request.pop((seq.client, seq.request_id), None)
        self.sched.release(seq)
        self.draft.finish(seq.seq_id)
        seq.stats.num_generated_tokens = seq.num_generated
        seq.stats.e2e_s = time.monotonic() - seq.arrival_s
        add_totals(self.totals, seq.stats)
        self._emit([seq])

    def _emit(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            out = take_output(seq)
            if out is not None:
                self.outputs.setdefault(seq.client, []).append(out)

    def flush_outputs(self) -> None:
        # One message per client per step; a finished request appears exactly once.
        for ident, outs in self.outputs.items():
            self.clients.send_to(ident, TokenOutputs(step=self.step_id, outputs=merge_outputs(outs)))
        self.outputs.clear()

    def engine_stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_free_slots=self.sched.max_num_seqs - len(self.running),
            mode=self.cfg.spec.mode,
            totals=self.totals,
            **(self.rounds.engine_fields() if self.rounds else {"num_plain_steps": self.policy.num_plain_steps}),
            **self.draft.engine_fields(),
            **{**self.timing, "host_parts": dict(self.timing["host_parts"])},  # a copy: the loop adds on
            num_kv_blocks=self.kv.num_blocks,
            num_free_kv_blocks=self.kv.num_free_blocks,
            num_preemptions=self.sched.num_preemptions,
            num_prefill_chunks=self.sched.num_prefill_chunks,
            max_step_tokens=self.sched.max_step_tokens,
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
        )

