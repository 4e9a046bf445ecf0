"""The synchronous heart of the engine: one `step` admits, prefills, decodes, samples and retires rows.

The engine describes every forward to the runner (`runners.base.Step`) and decodes in one of two loops:

- eager (`_decode_now`): each step makes room in the K/V pool, runs the running rows' decode step, waits for its
  logits, samples and records the tokens;
- launched ahead (`_decode_ahead`, with `lookahead`: a runner whose steps run asynchronously, as CUDA graphs on a
  GPU): a step reads the logits of the decode step the last one launched, samples, launches the next decode step at
  once and only then records its tokens, so the device computes while the host detokenizes, matches stop strings,
  retires rows and admits new ones. A row that finished meanwhile has its launched token discarded (one wasted row
  of one step); a row admitted meanwhile joins the launch after.

With speculative decoding (`speculator`, eager loop only) a decode step's rows may carry draft tokens, verified in
the same forward: such a row emits its accepted draft tokens and one more, and its table is rolled back past them
(`engine/speculative/`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from transformers_openai.engine.detokenizer import Decoder
from transformers_openai.engine.errors import ConstraintFailed
from transformers_openai.engine.intra_op_threads import IntraOpThreads
from transformers_openai.engine.kv_manager import KVManager
from transformers_openai.engine.prefill import PrefillJob
from transformers_openai.engine.request import EngineRequest, ErrorKind, FinishReason, RequestOutput
from transformers_openai.engine.row_slots import RowSlots
from transformers_openai.engine.sampler import Sampler
from transformers_openai.engine.scheduler import Scheduler
from transformers_openai.engine.sequence import Sequence
from transformers_openai.engine.speculative.speculator import Speculator
from transformers_openai.engine.stats import EngineObserver, NullObserver, PhaseClock, SpecCounts, StepStats
from transformers_openai.engine.stop_matcher import StopAutomata
from transformers_openai.runners.base import DecodeRow, ModelRunner, Step
from transformers_openai.runners.kv.block_table import BlockTable

logger = logging.getLogger(__name__)

Drawn = list[tuple[Sequence, int, tuple[float, list[tuple[int, float]]] | None]]


@dataclass(frozen=True)
class _Launched:
    """A decode step launched ahead (`lookahead`) whose logits are not read yet: its rows' sequences and the block
    tables they held at launch (a row whose table changed since, preempted or re-admitted, is not continued)."""

    seqs: list[Sequence]
    tables: list[BlockTable]
    logits: torch.Tensor  # [rows, vocab], in the order of `seqs`


class EngineCore:
    """Owns the runner, the scheduler and the K/V manager of the runner's pool; only the engine thread calls it."""

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Decoder,
        scheduler: Scheduler,
        stop_token_ids: frozenset[int],
        observer: EngineObserver | None = None,
        threads: IntraOpThreads | None = None,
        lookahead: bool = False,
        speculator: Speculator | None = None,
    ) -> None:
        self.runner = runner
        self.spec = runner.spec
        if speculator is not None and runner.spec.logits_processors:  # a model kind's rules read the tokens before
            logger.warning("speculative decoding is off: this model kind's decoding rules need one token a step")
            speculator = None
        self._speculator = speculator
        self._spec_counts: SpecCounts | None = None  # what this step speculated
        # Launch each decode step before recording the last one (module docstring); not with speculation, whose
        # drafts need the tokens recorded.
        self.lookahead = lookahead and speculator is None
        self._launched: _Launched | None = None
        self._threads = threads  # on a CPU: the engine thread's torch threads
        self.scheduler = scheduler
        self.kv = KVManager(self.spec.kv_pool)
        self.slots = RowSlots(self.spec.max_rows)
        self._tokenizer = tokenizer
        self._stop_token_ids = stop_token_ids
        self._sampler = Sampler(self.spec.logits_processors)
        self._stop_automata = StopAutomata()
        self.observer: EngineObserver = observer or NullObserver()

    def on_engine_thread(self) -> None:
        """Called first on the thread that will run every step."""
        if self._threads is not None:
            self._threads.apply()

    def add(self, request: EngineRequest) -> None:
        spec = self.spec
        limit = spec.output_limit(len(request.prompt_token_ids))
        seq = Sequence(request, self._tokenizer, self._stop_token_ids, limit, self._stop_automata, spec.decoder_prompt)
        seq.prefill.overhead = self.runner.prefill_cost(request.encoder_inputs)
        self.scheduler.add(seq)

    def abort(self, request_id: str, reason: str = "cancelled") -> RequestOutput | None:
        """Ends a request from outside; `reason` is for the log (who ended it says why, once, at its own level)."""
        seq = self.scheduler.remove(request_id)
        if seq is None:
            return None
        self._release(seq)
        output = seq.final_output(FinishReason.ABORT)
        self._finished(seq, aborted=reason)
        return output

    def pause(self, request_id: str) -> bool:
        """Stops stepping a request whose consumer is not taking its outputs: its row and K/V memory are given back,
        its tokens kept; `resume` puts it first in line to be prefilled again. False if it is not in the engine."""
        seq = self.scheduler.remove(request_id)
        if seq is None:
            return False
        self._set_aside(seq)
        self.scheduler.pause(seq)
        logger.info(
            "request %s paused after %d tokens: its client is not reading them",
            request_id,
            len(seq.output_ids),
            extra={"request_id": request_id},
        )
        return True

    def resume(self, request_id: str) -> None:
        if self.scheduler.resume(request_id) is not None:
            logger.info("request %s resumed: its client reads again", request_id, extra={"request_id": request_id})

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self, publish: Callable[[list[RequestOutput]], None] | None = None) -> list[RequestOutput]:
        """Admits what fits, then advances every running row by one token (in the loop the module docstring names).

        Args:
            publish: if given, receives the new requests' first tokens as soon as they are sampled,
                so their time to first token does not include this step's batched decode.
        Returns:
            The outputs not yet published.
        """
        outputs: list[RequestOutput] = []
        gaps: list[float] = []
        clock = PhaseClock()
        planned = self.scheduler.prefill_plan(self._reserve)
        if not planned:
            self._refuse_what_never_fits(outputs)
        with clock("prefill"):
            admitted = self._prefill(planned, outputs)
        if admitted:
            logits = torch.stack([logit for _, logit in admitted])
            self._sample(logits, [seq for seq, _ in admitted], outputs, gaps, clock)
        if publish is not None and outputs:
            publish(outputs)
            outputs = []
        decode = self._decode_ahead if self.lookahead else self._decode_now
        drawn, batch_size, preempted = decode(outputs, clock)
        with clock("output"):
            self._record(drawn, outputs, gaps)
        phase_s = clock.done()
        threads = self._threads.after_step(0 if planned else batch_size, phase_s["total"]) if self._threads else None
        self.observer.on_step(
            StepStats(
                running=len(self.scheduler.running) + len(self.scheduler.prefilling),
                waiting=len(self.scheduler.waiting),
                batch_size=batch_size,
                rows_in_use=self.slots.in_use,
                max_rows=self.spec.max_rows,
                prompt_tokens=sum(take for _, take in planned),
                generation_tokens=len(admitted) + len(drawn),
                inter_token_latencies_s=gaps,
                phase_s=phase_s,
                kv=self.kv.usage(),
                preemptions=preempted,
                threads=threads,
                spec=self._spec_counts,
            )
        )
        self._spec_counts = None
        return outputs

    def _decode_now(self, outputs: list[RequestOutput], clock: PhaseClock) -> tuple[Drawn, int, int]:
        """The eager loop's decode: room for every running row, one decode step, its tokens drawn.

        Returns:
            (the tokens drawn, the rows stepped, the requests preempted to make room).
        """
        preempted = self._make_room(outputs) if self.scheduler.running else 0
        running = self.scheduler.running
        if not running:
            return [], 0, preempted
        by_slot = {seq.slot: seq for seq in running.values() if seq.slot is not None}
        batch_size = len(by_slot)
        drafts = self._drafts(by_slot) if self._speculator is not None else {}
        with clock("forward"):
            decoded = self._decode(by_slot, outputs, drafts)
        if decoded is None:
            return [], batch_size, preempted
        slots, logits = decoded
        with clock("sample"):
            if any(slot in drafts for slot in slots):
                return self._verify(slots, logits, by_slot, drafts, outputs), batch_size, preempted
            return self._draw(logits, [by_slot[slot] for slot in slots], outputs), batch_size, preempted

    def _drafts(self, by_slot: dict[int, Sequence]) -> dict[int, tuple[int, ...]]:
        """The rows' drafts by slot (rows without one left out), each cut to the room its table can get without
        taking another row's: a short pool speculates less, never preempts."""
        assert self._speculator is not None
        seqs = list(by_slot.values())
        drafts: dict[int, tuple[int, ...]] = {}
        for seq, draft in zip(seqs, self._speculator.drafts(seqs), strict=True):
            if draft:
                fits = self.kv.room(_table(seq), 1 + len(draft)) - 1
                if fits > 0:
                    drafts[_slot(seq)] = tuple(draft[:fits])
        return drafts

    def _verify(
        self,
        slots: list[int],
        logits: torch.Tensor,
        by_slot: dict[int, Sequence],
        drafts: dict[int, tuple[int, ...]],
        outputs: list[RequestOutput],
    ) -> Drawn:
        """The tokens of a step whose rows carried drafts: rows without one drawn as usual, the others verified
        (`Speculator.verify`); each verified row records the K/V of its fed and accepted tokens and gives back the
        blocks of the rejected ones."""
        assert self._speculator is not None
        parts = torch.split(logits, [1 + len(drafts.get(slot, ())) for slot in slots])
        plain = [i for i, slot in enumerate(slots) if slot not in drafts]
        drawn: Drawn = []
        if plain:
            plain_logits = torch.cat([parts[i] for i in plain])
            drawn = self._draw(plain_logits, [by_slot[slots[i]] for i in plain], outputs)
        counts = self._spec_counts = SpecCounts()
        for i, slot in enumerate(slots):
            draft = drafts.get(slot)
            if draft is None:
                continue
            seq = by_slot[slot]
            try:
                (tokens,) = self._speculator.verify(
                    [parts[i]], [list(draft)], [seq.sampler_row], counts, [seq.request_id]
                )
            except Exception as exc:  # that row's failure only
                logger.exception("request %s failed verifying its draft", seq.request_id)
                outputs.extend(self._fail([seq], exc))
                continue
            table = _table(seq)
            self.kv.written(table, [seq.output_ids[-1], *tokens[:-1]])
            self.kv.rolled_back(table)
            drawn.extend((seq, token, None) for token in tokens)
        return drawn

    def _decode_ahead(self, outputs: list[RequestOutput], clock: PhaseClock) -> tuple[Drawn, int, int]:
        """The launched-ahead loop's decode: the tokens of the step the last one launched are drawn (an eager decode
        when none was), then the next decode step is launched before they are recorded."""
        launched, self._launched = self._launched, None
        if launched is not None:  # launched by the last step: its rows that are still running as they were
            drawn = self._read_launched(launched, outputs, clock)
            batch_size, preempted = len(drawn), 0
        else:
            drawn, batch_size, preempted = self._decode_now(outputs, clock)
        if self.scheduler.running:
            with clock("forward"):
                self._launched = self._launch(drawn)
        return drawn, batch_size, preempted

    def fail_all(self, exc: BaseException) -> list[RequestOutput]:
        scheduler = self.scheduler
        seqs = [
            *scheduler.running.values(),
            *scheduler.prefilling.values(),
            *scheduler.waiting.values(),
            *scheduler.paused.values(),
        ]
        return self._fail(seqs, exc)

    def _make_room(self, outputs: list[RequestOutput]) -> int:
        """Frees K/V blocks until every running row has room for its next token: the request with the largest
        (priority, arrival), the least urgent and of those the newest, is preempted (its blocks freed, its tokens
        kept; it waits first in line among its priority and is prefilled again). A request
        that is alone and still does not fit fails. Returns how many were preempted."""
        preempted = 0
        while not self.kv.grow(self._tables()):
            holders = self.scheduler.kv_holders()
            if not holders:
                break
            victim = max(holders, key=lambda seq: (seq.request.priority, seq.arrival))
            if len(holders) == 1:
                outputs.extend(self._fail([victim], MemoryError("the K/V cache cannot hold this request")))
                continue
            logger.info(
                "request %s preempted after %d tokens: K/V cache full", victim.request_id, len(victim.output_ids)
            )
            self._set_aside(victim)
            self.scheduler.requeue(victim)
            preempted += 1
        return preempted

    def _refuse_what_never_fits(self, outputs: list[RequestOutput]) -> None:
        """With nothing else holding K/V memory, a waiting request the runner cannot take never will be: it fails."""
        scheduler = self.scheduler
        if scheduler.running or scheduler.prefilling or not scheduler.waiting:
            return
        head = next(iter(scheduler.waiting.values()))
        outputs.extend(self._fail([head], MemoryError("the K/V cache cannot hold this request's prompt")))

    def _prefill(
        self, planned: list[tuple[Sequence, int]], outputs: list[RequestOutput]
    ) -> list[tuple[Sequence, torch.Tensor]]:
        """Runs this step's prefill chunks, all in one step; returns the sequences whose prompt is now fully in."""
        admitted: list[tuple[Sequence, torch.Tensor]] = []
        if not planned:
            return admitted
        now = time.monotonic()
        rows = []
        for seq, take in planned:
            seq.scheduled_at = seq.scheduled_at or now
            rows.append(seq.prefill.next_row(_slot(seq), take, self.spec.whole_prompt))
        results = self.runner.execute(Step(prefills=rows)).prefills
        for (seq, _), row, result in zip(planned, rows, results, strict=True):
            if isinstance(result, Exception):
                logger.error("prefill failed for request %s", seq.request_id, exc_info=result)
                self.scheduler.remove(seq.request_id)
                self._release(seq)
                outputs.append(seq.final_output(FinishReason.ERROR, f"prefill failed: {result}"))
                self._finished(seq)
                continue
            logits = seq.prefill.took(row, result.logits, result.info)
            self.kv.prefilled(seq.prefill)
            if not row.last:
                continue  # more chunks in the next steps
            assert logits is not None, "a runner returns the logits of a prompt's last position"
            if seq.request.params.max_tokens == 0:  # only the prompt's scores were asked for
                self.scheduler.remove(seq.request_id)
                outputs.append(seq.prompt_only_output())
                self._release(seq)
                self._finished(seq)
                continue
            self.scheduler.start(seq)
            admitted.append((seq, logits))
        return admitted

    def _decode(
        self,
        by_slot: dict[int, Sequence],
        outputs: list[RequestOutput],
        drafts: dict[int, tuple[int, ...]] | None = None,
    ) -> tuple[list[int], torch.Tensor] | None:
        """One batched step, rows with `drafts` carrying them. A row that makes it fail is ended alone and the step
        is redone for the others.

        `by_slot` loses the rows that were ended. Returns None when no row is left.
        """
        drafts = drafts or {}
        while by_slot:
            rows = [
                DecodeRow(slot, _table(seq), seq.output_ids[-1], drafts.get(slot, ()), seq.request.lora)
                for slot, seq in by_slot.items()
            ]
            try:
                decoded = self._execute(rows)
            except Exception as exc:
                logger.exception("decode step failed; probing its %d rows one by one", len(by_slot))
                failing = self._failing_alone(rows)
                if not failing:  # no single row reproduces it: a failure of the step itself
                    failing = dict.fromkeys(by_slot, exc)
                for slot, error in failing.items():
                    outputs.extend(self._fail([by_slot.pop(slot)], error))
                continue
            return decoded
        return None

    def _execute(self, rows: list[DecodeRow]) -> tuple[list[int], torch.Tensor]:
        """One decode step of `rows`, recorded in their tables (a row with a draft once verified): (slots in the
        order of the logits, logits)."""
        out = self.runner.execute(Step(decodes=rows))
        for row in rows:
            if not row.draft:
                self.kv.written(row.table, [row.token])
        if out.logits is None:
            raise RuntimeError("the runner returned no logits for a decode step")
        return list(out.slots), out.logits

    def _read_launched(self, launched: _Launched, outputs: list[RequestOutput], clock: PhaseClock) -> Drawn:
        """Draws the next token of each row of a decode launched ahead that is still running with the table it had;
        the others' logits are dropped (finished, aborted or preempted since)."""
        running = self.scheduler.running
        live = [
            i
            for i, (seq, table) in enumerate(zip(launched.seqs, launched.tables, strict=True))
            if running.get(seq.request_id) is seq and seq.prefill.kv is table
        ]
        if not live:
            return []
        logits = launched.logits if len(live) == len(launched.seqs) else launched.logits[live]
        with clock("sample"):
            return self._draw(logits, [launched.seqs[i] for i in live], outputs)

    def _launch(self, drawn: Drawn) -> _Launched | None:
        """Launches the decode step of every running row before `drawn` is recorded: each row fed its token just
        drawn, a row admitted this step its first. None (the next step decodes as usual) when a row would need
        another's memory (preemption waits for the records) or the launch fails (the next step isolates the row)."""
        fed = {id(seq): token for seq, token, _ in drawn}
        seqs = [seq for seq in self.scheduler.running.values() if seq.slot is not None]
        tables = [_table(seq) for seq in seqs]
        if not seqs or not self.kv.grow(tables):
            return None
        rows = [
            DecodeRow(_slot(seq), table, fed[id(seq)] if id(seq) in fed else seq.output_ids[-1], lora=seq.request.lora)
            for seq, table in zip(seqs, tables, strict=True)
        ]
        try:
            slots, logits = self._execute(rows)
        except Exception:  # decoded again by the next step, which ends the row at fault alone
            logger.debug("a decode step launched ahead failed; the next step runs it again", exc_info=True)
            return None
        by_slot = {seq.slot: (seq, table) for seq, table in zip(seqs, tables, strict=True)}
        return _Launched([by_slot[slot][0] for slot in slots], [by_slot[slot][1] for slot in slots], logits)

    def _failing_alone(self, rows: list[DecodeRow]) -> dict[int, Exception]:
        failing: dict[int, Exception] = {}
        for row in rows:
            try:
                self.runner.execute(Step(decodes=[row], probe=True))
            except Exception as exc:
                failing[row.slot] = exc
        return failing

    def _sample(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        outputs: list[RequestOutput],
        gaps: list[float],
        clock: PhaseClock,
    ) -> None:
        with clock("sample"):
            drawn = self._draw(logits, seqs, outputs)
        with clock("output"):
            self._record(drawn, outputs, gaps)

    def _record(self, drawn: Drawn, outputs: list[RequestOutput], gaps: list[float]) -> None:
        """Appends each row's new token: its output (text, stop strings), and the end of rows that finished."""
        for seq, token_id, logprob in drawn:
            if seq.finish_reason is not None:  # a verified draft's tokens after the one that ended it
                continue
            try:
                output = seq.append(token_id, logprob)
            except Exception as exc:  # e.g. detokenizing: that row's failure only
                logger.exception("request %s failed after sampling", seq.request_id)
                outputs.extend(self._fail([seq], exc))
                continue
            outputs.append(output)
            if seq.last_gap_s is not None:
                gaps.append(seq.last_gap_s)
            if output.finished:
                self.scheduler.remove(seq.request_id)
                self._release(seq)
                self._finished(seq)

    def _draw(self, logits: torch.Tensor, seqs: list[Sequence], outputs: list[RequestOutput]) -> Drawn:
        """Samples every row at once; if that fails, row by row, ending only the rows that fail alone.

        The random generators are rewound before the retry, so a seeded row draws what it would have drawn.
        """
        rows = [seq.sampler_row for seq in seqs]
        states = [None if row.params.greedy else row.generator.get_state() for row in rows]
        try:
            result = self._sampler(logits, rows)
            return list(zip(seqs, result.token_ids, result.logprobs, strict=True))
        except Exception:
            logger.exception("sampling failed; sampling its %d rows one by one", len(rows))
        drawn = []
        for i, (seq, row, state) in enumerate(zip(seqs, rows, states, strict=True)):
            if state is not None:
                row.generator.set_state(state)
            try:
                alone = self._sampler(logits[i : i + 1], [row])
            except Exception as exc:
                outputs.extend(self._fail([seq], exc))
                continue
            drawn.append((seq, alone.token_ids[0], alone.logprobs[0]))
        return drawn

    def _set_aside(self, seq: Sequence) -> None:
        """Gives back a request's row and K/V memory, keeping its tokens: it is prefilled again when it next runs."""
        self._release(seq)
        seq.preempt()
        seq.prefill.overhead = self.runner.prefill_cost(seq.request.encoder_inputs)

    def _reserve(self, seq: Sequence) -> bool:
        """Gives a request about to start its prefill a row and its block table (see `KVManager.reserve`)."""
        slot = self.slots.take()
        if slot is None:
            return False
        job: PrefillJob = seq.prefill
        if not self.kv.reserve(job, len(job.decoder_prompt) + 1, len(self.scheduler.running)):
            self.slots.give_back(slot)
            return False
        seq.slot = slot
        return True

    def _tables(self) -> list[BlockTable]:
        """The block tables of the running rows."""
        return [_table(seq) for seq in self.scheduler.running.values()]

    def _release(self, seq: Sequence) -> None:
        if seq.slot is not None:  # admitted: its prompt in, or part of it
            self.runner.release(seq.slot)
            self.slots.give_back(seq.slot)
            seq.slot = None
        self.kv.release(seq.prefill)

    def _finished(self, seq: Sequence, aborted: str | None = None) -> None:
        stats = seq.stats(aborted is not None)
        self.observer.on_finished(stats)
        if aborted is not None:
            logger.info(
                "request %s aborted after %d tokens (%s)",
                seq.request_id,
                stats.completion_tokens,
                aborted,
                extra={"request": asdict(stats), "request_id": seq.request_id},
            )
            return
        logger.info(
            "request %s finished: prompt_tokens=%d completion_tokens=%d queue=%.3fs ttft=%.3fs "
            "tokens_per_s=%.1f finish_reason=%s",
            seq.request_id,
            stats.prompt_tokens,
            stats.completion_tokens,
            stats.queue_time_s,
            stats.time_to_first_token_s or 0.0,
            stats.decode_tokens_per_s,
            stats.finish_reason,
            extra={"request": asdict(stats), "request_id": seq.request_id},
        )

    def _fail(self, seqs: list[Sequence], exc: BaseException) -> list[RequestOutput]:
        outputs = []
        for seq in seqs:
            self.scheduler.remove(seq.request_id)
            self._release(seq)
            output = seq.final_output(FinishReason.ERROR, f"{type(exc).__name__}: {exc}")
            if isinstance(exc, ConstraintFailed):  # the request's own grammar gave up, not the engine
                output.error, output.error_kind = str(exc), ErrorKind.CONSTRAINT
            outputs.append(output)
            self._finished(seq)
        return outputs


def _slot(seq: Sequence) -> int:
    """An admitted request's row (given at its admission, held until it leaves)."""
    if seq.slot is None:
        raise RuntimeError(f"request {seq.request_id} runs without a row")
    return seq.slot


def _table(seq: Sequence) -> BlockTable:
    """A running row's block table (held from its admission until it leaves)."""
    if seq.prefill.kv is None:
        raise RuntimeError(f"request {seq.request_id} runs without a block table")
    return seq.prefill.kv
