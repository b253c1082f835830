"""The output text of one request: detokenized as tokens come, cut at the first stop string.

Stop strings may span tokens. So that a client never sees the start of a stop string
that later completes, the last `len(longest stop) - 1` characters are held back until
more text shows they are not a stop string, or the request finishes. Text the detokenizer
holds back to the end (a run of raw bytes, an incomplete character) is looked through for stop
strings too when it comes out (`finish`). With `min_tokens`,
stop strings count only in text that tokens after the first `min_tokens` add (vLLM's rule).
"""

from __future__ import annotations

from typing import Protocol


class Detokenizer(Protocol):
    def feed(self, token_ids: list[int]) -> str:
        """Text the tokens add to what was fed before (may be empty mid-character)."""
        ...

    def flush(self) -> str:
        """Text still held back (an incomplete character) at the end."""
        ...


class TextOutput:
    def __init__(self, detokenizer: Detokenizer, stop: tuple[str, ...], min_tokens: int = 0) -> None:
        self._detokenizer = detokenizer
        self._stop = stop
        self._min_tokens = min_tokens
        self._num_tokens = 0  # fed so far, primed ones included
        self._hold_back = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # every character so far, cut before the stop string once one is found
        self.num_emitted_chars = 0  # text[:num_emitted_chars] was handed out already
        self.is_stopped = False  # a stop string was found; text ends before it
        self._is_flushed = False  # the detokenizer's held-back text was added (finish)

    def prime(self, token_ids: list[int]) -> None:
        """Feed tokens generated (and streamed) elsewhere before a resume, one at a time as their
        engine did (fed at once, tokens that end inside a character would hold back all their text)."""
        for token_id in token_ids:
            self.text += self._detokenizer.feed([token_id])
        self._num_tokens += len(token_ids)
        self.num_emitted_chars = len(self.text)

    def restore(self, token_ids: list[int], num_resumed: int, text_sent: str) -> bool:
        """Rebuild the state of a request that ran elsewhere: its resumed tokens primed, the rest
        appended one by one (as its engine did), `text_sent` already handed out. False if the
        text does not start with `text_sent` (a different tokenizer)."""
        self.prime(token_ids[:num_resumed])
        for token_id in token_ids[num_resumed:]:
            self.append(token_id)
        if not self.text.startswith(text_sent):
            return False
        self.num_emitted_chars = len(text_sent)
        return True

    def append(self, token_id: int) -> bool:
        """Add one token's text; True when a stop string appeared (the text is then cut before it)."""
        num_old_chars = len(self.text)
        self.text += self._detokenizer.feed([token_id])
        self._num_tokens += 1
        if not self._stop or len(self.text) == num_old_chars or self._num_tokens <= self._min_tokens:
            return False
        return self._cut_at_stop(num_old_chars)

    def finish(self) -> bool:
        """Add the text the detokenizer still holds back; True when a stop string appeared in it (the
        text is then cut before it). Before, that text was added without a look for stop strings."""
        if self._is_flushed or self.is_stopped:
            return False
        self._is_flushed = True
        num_old_chars = len(self.text)
        self.text += self._detokenizer.flush()
        if not self._stop or len(self.text) == num_old_chars or self._num_tokens <= self._min_tokens:
            return False
        return self._cut_at_stop(num_old_chars)

    def take_delta(self, is_final: bool) -> str:
        """Text not handed out yet; all of it once the request is final."""
        if is_final:
            self.finish()
        end = len(self.text) if is_final else len(self.text) - self._hold_back
        if end <= self.num_emitted_chars:
            return ""
        delta = self.text[self.num_emitted_chars:end]
        self.num_emitted_chars = end
        return delta

    def _cut_at_stop(self, num_old_chars: int) -> bool:
        found = [
            index
            for stop in self._stop
            if (index := self.text.find(stop, max(num_old_chars - len(stop) + 1, 0))) >= 0
        ]
        if not found:
            return False
        self.text = self.text[:min(found)]
        self.is_stopped = True
        return True
