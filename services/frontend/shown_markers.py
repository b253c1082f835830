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
from collections.abc import Callable, Mapping, Sequence

Decode = Callable[[Sequence[int]], str]
DETOKENIZER_CONTEXT = 4  # prompt tokens the instance decodes its output after (engine._DETOKENIZER_CONTEXT)


class MarkerPlacer:
    """Fed each chunk's new ids and the instance's new text for them, in order; keeps no text, so a
    chunk costs its own length (it was given the whole text so far: quadratic in the output)."""

    def __init__(self, markers: Mapping[int, str], decode: Decode, prompt_token_ids: Sequence[int]) -> None:
        self._markers = dict(markers)  # token id -> its text
        self._decode = decode  # special tokens left out, as the instance decodes
        self._context = list(prompt_token_ids[-DETOKENIZER_CONTEXT:])
        self._context_length = len(decode(self._context))
        self._waiting: deque[tuple[int, str]] = deque()  # (position in the instance's text, marker) not out yet
        self._num_placed = 0  # characters of the instance's text that went out (every chunk's text so far)

    def place(self, output_ids: Sequence[int], new_ids: Sequence[int], plain: str) -> str:
        """The text to send for `new_ids` (after `output_ids`): `plain`, the instance's new text, its
        markers in place."""
        for offset, token_id in enumerate(new_ids):
            if token_id in self._markers:
                position = self._text_length([*output_ids, *new_ids[:offset]])
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

    def _text_length(self, output_ids: Sequence[int]) -> int:
        return len(self._decode([*self._context, *output_ids])) - self._context_length
