"""Drafts from a model with another tokenizer (universal assisted generation, as transformers ships it).

The text so far is re-encoded with the draft's tokenizer, the draft writes gamma tokens of its own, and
their text is encoded back into the target's ids. At the boundary a tokenizer may merge the new text with
the last tokens (" wor" + "ld" -> " world"), so the last few target tokens are encoded again together
with the draft's text: the proposal is what follows them, and where they no longer come out the same,
the step drafts nothing rather than propose ids the target would not have written that way.

Lossless for greedy and for sampling alike: the draft's tokens are its argmax, a function of the text so
far, so the proposal is one-hot (q = 1 on the proposed id) and the rejection rule keeps exactly the
target's distribution, as it does for prompt lookup. No distribution over the target's vocabulary is
needed, so no vocabulary overlap is either; the overlap only says how often the boundaries will agree.
"""

from __future__ import annotations

from engine.decoding.drafters import Draft, Drafter, DraftModel
from engine.decoding.sampling import SamplingConfig

BOUNDARY = 4  # target tokens re-encoded with the draft's text
GREEDY = SamplingConfig()


class CrossTokenizerDraft(Drafter):
    """A draft model whose tokenizer differs from the target's."""

    name = "draft-model"

    def __init__(self, model, draft_tok, target_tok, max_len: int | None = None, gamma: int = 4,
                 adaptive: bool = False, p_min: float = 0.0):  # fmt: skip
        self.inner = DraftModel(model, model.config.vocab_size, max_len, gamma, p_min=p_min)
        self.draft_tok, self.target_tok = draft_tok, target_tok
        super().__init__(gamma, adaptive)

    def reset(self) -> None:
        super().reset()
        self.inner.reset()
        self.text_of: tuple[int, str] = (0, "")  # (target ids decoded so far, their text)

    def _text(self, ids: list[int]) -> str:
        """The text of the target's ids, decoded incrementally where the earlier ids are unchanged."""
        done, text = self.text_of
        if done > len(ids) or done == 0:
            text = self.target_tok.decode(ids, skip_special_tokens=False)
        elif done < len(ids):
            # decode from a few tokens back so that a multi-byte character split across tokens comes out whole
            back = max(0, done - BOUNDARY)
            head = self.target_tok.decode(ids[back:done], skip_special_tokens=False)
            whole = self.target_tok.decode(ids[back:], skip_special_tokens=False)
            text = text[: len(text) - len(head)] + whole if whole.startswith(head) else \
                self.target_tok.decode(ids, skip_special_tokens=False)  # fmt: skip
        self.text_of = (len(ids), text)
        return text

    def propose(self, ids, limit, cfg, generator) -> Draft:
        gamma = min(self.gamma, limit)
        if gamma <= 0:
            return Draft([])
        draft_ids = self.draft_tok.encode(self._text(ids), add_special_tokens=False)
        if not draft_ids:
            return Draft([])
        own = self.inner.propose(draft_ids, gamma, GREEDY, None)  # its argmax, in its own vocabulary
        if not own.tokens:
            return Draft([], passes=own.passes, note=own.note)
        written = self.draft_tok.decode(own.tokens, skip_special_tokens=True)
        tail = ids[-BOUNDARY:]
        again = self.target_tok.encode(self.target_tok.decode(tail, skip_special_tokens=False) + written,
                                       add_special_tokens=False)  # fmt: skip
        pieces = " ".join(repr(self.draft_tok.decode([t])) for t in own.tokens)
        note = f"the draft's own tokens: {pieces}" + (f"; {own.note}" if own.note else "")
        if again[: len(tail)] != tail:
            return Draft([], passes=own.passes, note=note + " (its text merged with the last target tokens: no draft)")
        return Draft(again[len(tail) :][:limit], passes=own.passes, note=note)
