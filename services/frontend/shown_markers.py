"""Special tokens put back into a request's text for its tool-call parser (Mistral's [TOOL_CALLS]
and [ARGS], hermes tags a tokenizer marks special).

The instance's text leaves special tokens out, and holds back its last characters while a
stop string may be starting. So a marker is placed by its position in the instance's text:
the length of the text of the tokens before it, as the instance decodes them (after the
prompt's last tokens), and it goes out once the instance has released the text up to there.
A marker whose text a stop string cut off never goes out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

Decode = Callable[[Sequence[int]], str]
DETOKENIZER_CONTEXT = 4  # prompt tokens the instance decodes its output after (engine._DETOKENIZER_CONTEXT)


class MarkerPlacer:
    def __init__(self, markers: Mapping[int, str], decode: Decode, prompt_token_ids: Sequence[int]) -> None:
        self._markers = dict(markers)  # token id -> its text
        self._decode = decode  # special tokens left out, as the instance decodes
        self._context = list(prompt_token_ids[-DETOKENIZER_CONTEXT:])
        self._waiting: list[tuple[int, str]] = []  # (position in the instance's text, marker) not out yet
        self._num_placed = 0  # characters of the instance's text that went out

    def place(self, output_ids: Sequence[int], new_ids: Sequence[int], plain_text: str) -> str:
        """The text to send for `new_ids` (after `output_ids`): the instance's new text, its markers in
        place; `plain_text` is all the instance's text so far, this chunk's included."""
        for offset, token_id in enumerate(new_ids):
            if token_id in self._markers:
                position = self._text_length([*output_ids, *new_ids[:offset]])
                self._waiting.append((max(position, self._num_placed), self._markers[token_id]))
        pieces, placed = [], self._num_placed
        while self._waiting and self._waiting[0][0] <= len(plain_text):
            position, marker = self._waiting.pop(0)
            pieces += [plain_text[placed:position], marker]
            placed = position
        pieces.append(plain_text[placed:])
        self._num_placed = len(plain_text)
        return "".join(pieces)

    def _text_length(self, output_ids: Sequence[int]) -> int:
        return len(self._decode([*self._context, *output_ids])) - len(self._decode(self._context))
