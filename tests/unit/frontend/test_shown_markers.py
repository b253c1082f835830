"""Special tool-call markers put back into a request's text for its parser, in place even where the
instance holds text back for a stop string, and never in what a resume sends back (shown_markers.py)."""

from __future__ import annotations

import random
import shutil

import pytest
from tokenizers import AddedToken, Tokenizer as HfTokenizer

from services.frontend.generation import FinishReason, TokenChunk
from services.frontend.req_state import ReqState
from services.frontend.served_model import ServedModel
from services.frontend.tool_calls import ToolCallFormat, ToolCallParser
from services.instance.engine.text_output import TextOutput
from services.instance.engine.tokenizer import IncrementalDetokenizer

pytestmark = pytest.mark.timeout(30)

PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def model(tiny_model_dir, tmp_path_factory) -> ServedModel:
    folder = tmp_path_factory.mktemp("special") / "model"
    shutil.copytree(tiny_model_dir, folder)
    backend = HfTokenizer.from_file(str(folder / "tokenizer.json"))
    backend.add_special_tokens([AddedToken("<tool_call>", special=True), AddedToken("</tool_call>", special=True)])
    (folder / "tokenizer.json").write_text(backend.to_str())
    return ServedModel.load(folder, "special").with_tool_calls(ToolCallFormat.HERMES)


def stream(model: ServedModel, answer: list[int], stop: tuple[str, ...]) -> tuple[ReqState, list]:
    """The answer token by token through the instance's text output (stop strings held back) into the
    frontend's state and parser, as a stream runs; the state, and what the parser read."""
    instance_text = TextOutput(IncrementalDetokenizer(model.tokenizer, context_ids=PROMPT[-4:]), stop)
    state = ReqState("r", PROMPT, model.decode, dict(model.shown_marker_ids))
    parser = ToolCallParser(ToolCallFormat.HERMES, hidden_markers=tuple(tag for _, tag in model.shown_marker_ids))
    parsed = []
    for index, token_id in enumerate(answer):
        is_stopped = instance_text.append(token_id)
        is_last = is_stopped or index == len(answer) - 1
        delta = state.accept(TokenChunk(index, (token_id,), instance_text.take_delta(is_last),
                                        FinishReason.STOP if is_last else None))
        parsed.append(parser.feed(delta.text, is_last=is_last))
        if is_last:
            break
    return state, parsed


def test_markers_go_out_in_place_even_while_a_stop_string_holds_text_back(model):
    """Found by a review: the text the instance held back before a marker came out after it, and the
    chunk's held-back text was lost (a stop string with tools: a broken call sent as content)."""
    encode = lambda text: model.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    tags = {tag: token_id for token_id, tag in model.shown_marker_ids}
    answer = [*encode("Let me check."), tags["<tool_call>"],
              *encode('\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'), tags["</tool_call>"]]
    for stop in ((), ("STOP!",)):
        state, parsed = stream(model, answer, stop)
        assert state.text == 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n' \
                             '</tool_call>', stop
        assert state.plain_text == model.decode(answer)  # what a resume sends back: the instance's own text
        assert "".join(p.content for p in parsed) == "Let me check."
        assert [(c.name, c.arguments) for p in parsed for c in p.tool_calls] == [("get_weather", '{"city": "Paris"}')]


def test_a_marker_after_a_stop_string_never_goes_out(model):
    encode = lambda text: model.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    tags = {tag: token_id for token_id, tag in model.shown_marker_ids}
    answer = [*encode("Done. ST"), tags["<tool_call>"], *encode("OP! more")]  # the stop string spans the marker
    state, _ = stream(model, answer, ("STOP!",))
    assert state.text == state.plain_text == "Done. " and state.finish_reason is FinishReason.STOP


# ---- cost and placement of markers, on a toy vocabulary -----------------------------------------------------

MARKERS = {90: "<tool_call>", 91: "</tool_call>"}  # special tokens: the instance's text leaves them out


def toy_decode(ids) -> str:
    """Token i (not a marker) is the letter chr(ord('a') + i % 26), written 1 + i % 3 times."""
    return "".join(chr(ord("a") + i % 26) * (1 + i % 3) for i in ids if i not in MARKERS)


class WholeTextPlacer:
    """The placement MarkerPlacer made before it was fed pieces: given the instance's whole text at every chunk
    (the reference for what each chunk must send)."""

    def __init__(self, prompt) -> None:
        self._context = list(prompt[-4:])
        self._waiting: list[tuple[int, str]] = []
        self._num_placed = 0

    def place(self, output_ids, new_ids, plain_text: str) -> str:
        for offset, token_id in enumerate(new_ids):
            if token_id in MARKERS:
                ids = [*self._context, *output_ids, *new_ids[:offset]]
                position = len(toy_decode(ids)) - len(toy_decode(self._context))
                self._waiting.append((max(position, self._num_placed), MARKERS[token_id]))
        pieces, placed = [], self._num_placed
        while self._waiting and self._waiting[0][0] <= len(plain_text):
            position, marker = self._waiting.pop(0)
            pieces += [plain_text[placed:position], marker]
            placed = position
        pieces.append(plain_text[placed:])
        self._num_placed = len(plain_text)
        return "".join(pieces)


def instance_chunks(rng, answer: list[int], cut: int | None):
    """The answer in chunks of 1-4 tokens, each with the text the instance releases by then: a prefix of the
    answer's text, held back by 0-6 characters (a stop string starting), all of it (or up to `cut`, where a
    stop string ended it) with the last chunk."""
    text = toy_decode(answer) if cut is None else toy_decode(answer)[:cut]
    released, index = 0, 0
    while index < len(answer):
        ids = answer[index:index + rng.randint(1, 4)]
        is_last = index + len(ids) == len(answer)
        upto = len(text) if is_last else max(released, min(len(text), len(toy_decode(answer[:index + len(ids)]))
                                                             - rng.randint(0, 6)))
        yield TokenChunk(index, tuple(ids), text[released:upto], FinishReason.STOP if is_last else None)
        released, index = upto, index + len(ids)


@pytest.mark.parametrize("seed", range(20))
def test_each_chunk_sends_what_placing_in_the_whole_text_sent(seed):
    """Markers in chunks of their own or with other tokens, side by side, first or last, while the instance holds
    text back before them, and after a stop string's cut (never sent)."""
    rng = random.Random(seed)
    answer = [rng.choice([rng.randrange(26), 90, 91]) if rng.random() < 0.3 else rng.randrange(26)
              for _ in range(rng.randint(1, 60))]
    cut = rng.randint(0, len(toy_decode(answer))) if rng.random() < 0.3 else None
    state, reference = ReqState("r", PROMPT, toy_decode, MARKERS), WholeTextPlacer(PROMPT)
    plain_text = ""
    for piece in instance_chunks(rng, answer, cut):
        expected = reference.place(state.token_ids, piece.token_ids, plain_text + piece.text)
        plain_text += piece.text
        assert state.accept(piece).text == expected, (answer, cut)
    assert state.plain_text == plain_text


def test_a_long_answer_with_markers_costs_its_length_not_its_length_squared(monkeypatch):
    """Each token gave the placer the whole text so far (joined, then copied once more): these 20k tokens read
    7.8e8 characters, quadratic in the output. Counted: the text the placer is given, and what the state joins."""
    from services.frontend import req_state, shown_markers
    num_read = [0]
    place, joined = shown_markers.MarkerPlacer.place, req_state._Pieces.joined

    def counted_place(self, output_ids, new_ids, plain):
        num_read[0] += len(plain)
        return place(self, output_ids, new_ids, plain)

    def counted_joined(self):
        text = joined(self)
        num_read[0] += len(text)
        return text
    monkeypatch.setattr(shown_markers.MarkerPlacer, "place", counted_place)
    monkeypatch.setattr(req_state._Pieces, "joined", counted_joined)
    state = ReqState("r", PROMPT, toy_decode, MARKERS)
    num_tokens = 20_000
    for index in range(num_tokens):
        token_id = 90 + index // 500 % 2 if index % 500 == 499 else index % 26  # a marker every 500 tokens
        state.accept(TokenChunk(index, (token_id,), toy_decode([token_id]), None))
    text = state.text  # read once, here
    assert text.count("<tool_call>") == text.count("</tool_call>") == 20
    assert num_read[0] <= 2 * len(text), num_read[0]  # each character given once, joined once
