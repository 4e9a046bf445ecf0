"""Which running rows speculate in a step, with which drafts, and what their verification emits."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from transformers_openai.engine.sampler import SamplerRow
from transformers_openai.engine.sequence import Sequence
from transformers_openai.engine.speculative.config import SpeculativeConfig
from transformers_openai.engine.speculative.ngram import NgramProposer
from transformers_openai.engine.speculative.rejection import verify_greedy, verify_sampled
from transformers_openai.engine.stats import SpecCounts

# A row whose drafts have been accepted less than this (a moving average of accepted / proposed) stops drafting
# for a while: its rejected drafts cost every row of its step the verify step's width, and a text that does not copy
# its prompt keeps proposing what is rejected. The pause doubles each time it is earned again, up to MAX_PAUSE steps.
MIN_ACCEPTANCE = 0.3
# The verify step runs every row of the step at the width of the longest draft (rows right-aligned, eager): a step
# speculates only when at least this share of its rows have a draft.
MIN_DRAFTED_SHARE = 0.5
FIRST_PAUSE = 4
MAX_PAUSE = 64


@dataclass
class _RowRecord:
    """How a row's drafts fared: the moving average of its acceptance, and the steps it sits out."""

    acceptance: float = 1.0
    pause: int = 0  # steps left without drafting
    backoff: int = 0  # the next pause's length (0: the first)


class Speculator:
    """Proposes drafts for the rows that may speculate (`speculates`) and verifies them (`verify`)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._proposer = NgramProposer(
            config.num_speculative_tokens, config.prompt_lookup_max, config.prompt_lookup_min
        )
        self._records: dict[str, _RowRecord] = {}  # by request id, for the rows of the last step

    @staticmethod
    def speculates(seq: Sequence) -> bool:
        """A row speculates unless it opted out or a sampling rule of its depends on the tokens before each position
        (a grammar, penalties, min_tokens still holding back its stop tokens, logprobs reported per token)."""
        row = seq.sampler_row
        params = row.params
        return (
            params.speculative
            and row.constraint is None
            and params.logprobs is None
            and not params.has_penalties
            and len(seq.output_ids) >= params.min_tokens
        )

    def drafts(self, seqs: list[Sequence]) -> list[list[int]]:
        """Each row's draft ([] for none): never more tokens than the row may still emit less the one its
        verification always adds. A step of more rows than `disable_by_batch_size`, or where fewer than
        `MIN_DRAFTED_SHARE` of the rows have a draft, drafts nothing."""
        records = self._records = {seq.request_id: self._records.get(seq.request_id) or _RowRecord() for seq in seqs}
        limit = self.config.disable_by_batch_size
        if limit is not None and len(seqs) > limit:
            return [[] for _ in seqs]
        drafts: list[list[int]] = []
        for seq in seqs:
            room = seq.remaining_tokens - 1
            record = records[seq.request_id]
            if record.pause > 0:
                record.pause -= 1
            if room <= 0 or not seq.output_ids or record.pause > 0 or not self.speculates(seq):
                drafts.append([])
                continue
            history = np.fromiter((*seq.request.prompt_token_ids, *seq.output_ids), dtype=np.int64)
            drafts.append(self._proposer.propose(history, room))
        if sum(1 for draft in drafts if draft) < MIN_DRAFTED_SHARE * len(seqs):
            return [[] for _ in seqs]  # a few drafted rows would widen every row's step: not worth it
        return drafts

    def verify(
        self,
        logits: list[torch.Tensor],
        drafts: list[list[int]],
        rows: list[SamplerRow],
        counts: SpecCounts,
        request_ids: list[str] | None = None,
    ) -> list[list[int]]:
        """The tokens each row emits (accepted draft tokens, then one more); `logits[r]` `[len(drafts[r]) + 1,
        vocab]`. Adds what was proposed and accepted to `counts`, and to the rows' records (`request_ids`): a row
        whose drafts are mostly rejected pauses drafting (`MIN_ACCEPTANCE`)."""
        emitted: list[list[int]] = [[] for _ in rows]
        greedy = [i for i, row in enumerate(rows) if row.params.greedy]
        if greedy:
            chosen = verify_greedy([logits[i] for i in greedy], [drafts[i] for i in greedy], [rows[i] for i in greedy])
            for i, tokens in zip(greedy, chosen, strict=True):
                emitted[i] = tokens
        for i, row in enumerate(rows):
            if not row.params.greedy:
                emitted[i] = verify_sampled(logits[i], drafts[i], row)
        k = self.config.num_speculative_tokens
        if len(counts.accepted_per_pos) < k:
            counts.accepted_per_pos.extend([0] * (k - len(counts.accepted_per_pos)))
        for i, (draft, tokens) in enumerate(zip(drafts, emitted, strict=True)):
            accepted = len(tokens) - 1
            if request_ids is not None and draft:
                self._fared(request_ids[i], accepted / len(draft))
            counts.drafts += 1
            counts.draft_tokens += len(draft)
            counts.accepted += accepted
            for pos in range(accepted):
                counts.accepted_per_pos[pos] += 1
        return emitted

    def _fared(self, request_id: str, rate: float) -> None:
        record = self._records.setdefault(request_id, _RowRecord())
        record.acceptance = 0.5 * record.acceptance + 0.5 * rate
        if record.acceptance >= MIN_ACCEPTANCE:
            if rate >= 0.5:
                record.backoff = 0
            return
        record.backoff = min(2 * record.backoff, MAX_PAUSE) if record.backoff else FIRST_PAUSE
        record.pause = record.backoff + 1  # counted down from the next step's drafts on
        record.acceptance = 0.5  # after the pause, a few drafts decide again
