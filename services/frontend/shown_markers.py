"""Special tokens put back into a request's text for its tool-call parser (Mistral's [TOOL_CALLS]
and [ARGS], hermes tags a tokenizer marks special).

The instance's text leaves special tokens out, and holds back its last characters while a
stop string may be starting. So a marker is placed by its position in the instance's text:
the length of the text of the tokens before it, as the instance decodes them (after the
prompt's last tokens), and it goes out once the instance has released the text up to there.
A marker whose text a stop string cut off never goes out.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence

from services.instance.engine.tokenizer import IncrementalDetokenizer, Tokenizer  # tokenizers, no torch


class MarkerPlacer:
    """Fed each chunk's new ids and the instance's new text for them, in order; keeps no text. A marker's
    position comes from an incremental detokenizer (the instance's) fed the ids since the marker before:
    placing it costs those ids, not the whole output so far (each marker decoded all of it: markers x
    length). A chunk without a marker decodes nothing."""

    def __init__(self, markers: Mapping[int, str], tokenizer: Tokenizer, prompt_token_ids: Sequence[int]) -> None:
        self._markers = dict(markers)  # token id -> its text
        # the instance's text of the output (special tokens left out), fed only up to each marker
        self._detokenizer = IncrementalDetokenizer(tokenizer, context_ids=tokenizer.detokenizer_context(prompt_token_ids))
        self._num_fed = 0  # output ids given to the detokenizer
        self._num_decoded = 0  # characters it emitted for them
        self._waiting: deque[tuple[int, str]] = deque()  # (position in the instance's text, marker) not out yet
        self._num_placed = 0  # characters of the instance's text that went out (every chunk's text so far)

    def place(self, output_ids: Sequence[int], new_ids: Sequence[int], plain: str) -> str:
        """The text to send for `new_ids` (after `output_ids`): `plain`, the instance's new text, its
        markers in place."""
        for offset, token_id in enumerate(new_ids):
            if token_id in self._markers:
                position = self._text_length(output_ids, new_ids[:offset])
                self._waiting.append((max(position, self._num_placed), self._markers[token_id]))
        start, end = self._num_placed, self._num_placed + len(plain)
        pieces, placed = [], start
        while self._waiting and self._waiting[0][0] <= end:
            position, marker = self._waiting.popleft()
            pieces += [plain[placed - start:position - start], marker]
            placed = position
        pieces.append(plain[placed - start:])
        self._num_placed = end
        return "".join(pieces)

    def _text_length(self, output_ids: Sequence[int], new_ids: Sequence[int]) -> int:
        """Characters of the instance's text of `output_ids` then `new_ids` (what decoding them after the
        prompt's last tokens gives), from the ids not fed yet."""
        not_fed = [*output_ids[self._num_fed:], *new_ids[max(0, self._num_fed - len(output_ids)):]]
        self._num_decoded += len(self._detokenizer.feed(not_fed))
        self._num_fed += len(not_fed)
        return self._num_decoded + len(self._detokenizer.held_back())
