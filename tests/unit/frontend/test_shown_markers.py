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
from services.frontend.shown_markers import MarkerPlacer
from services.frontend.tool_calls import ToolCallFormat, ToolCallParser
from services.instance.engine.text_output import TextOutput
from services.instance.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.unit.instance.test_tokenizer import sentencepiece_like_tokenizer

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
    context = model.tokenizer.detokenizer_context(PROMPT)
    instance_text = TextOutput(IncrementalDetokenizer(model.tokenizer, context_ids=context), stop)
    state = ReqState("r", PROMPT, model.decode, MarkerPlacer(dict(model.shown_marker_ids), model.tokenizer, PROMPT))
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


# ---- placement of markers against decoding the whole output at each, and its cost ------------------------------

MARKERS = {90: "<tool_call>", 91: "</tool_call>"}  # special tokens: the instance's text leaves them out


def toy_decode(ids, skip_special_tokens=True) -> str:
    """Token i (not a marker) is the letter chr(ord('a') + i % 26), written 1 + i % 3 times."""
    return "".join(chr(ord("a") + i % 26) * (1 + i % 3) for i in ids if i not in MARKERS)


class ToyTokenizer:
    """toy_decode as a tokenizer (what an incremental detokenizer asks of one), counting the ids it decodes."""

    def __init__(self) -> None:
        self.num_decoded = 0

    def decode(self, ids, skip_special_tokens=True) -> str:
        self.num_decoded += len(ids)
        return toy_decode(ids)

    def is_special(self, token_id: int) -> bool:
        return token_id in MARKERS

    def is_raw_byte(self, token_id: int) -> bool:
        return False

    def detokenizer_context(self, prompt_ids) -> tuple[int, ...]:
        return tuple(prompt_ids[-4:])


class WholeTextPlacer:
    """The placement MarkerPlacer made before: each marker placed by decoding the prompt's context and the
    whole output before it, given the instance's whole text at every chunk (the reference for what each chunk
    must send)."""

    def __init__(self, context, markers, decode) -> None:
        self._context, self._markers, self._decode = list(context), markers, decode
        self._waiting: list[tuple[int, str]] = []
        self._num_placed = 0

    def place(self, output_ids, new_ids, plain_text: str) -> str:
        for offset, token_id in enumerate(new_ids):
            if token_id in self._markers:
                ids = [*self._context, *output_ids, *new_ids[:offset]]
                position = len(self._decode(ids)) - len(self._decode(self._context))
                self._waiting.append((max(position, self._num_placed), self._markers[token_id]))
        pieces, placed = [], self._num_placed
        while self._waiting and self._waiting[0][0] <= len(plain_text):
            position, marker = self._waiting.pop(0)
            pieces += [plain_text[placed:position], marker]
            placed = position
        pieces.append(plain_text[placed:])
        self._num_placed = len(plain_text)
        return "".join(pieces)


def instance_chunks(rng, answer: list[int], cut: int | None, decode, context):
    """The answer in chunks of 1-4 tokens, each with the text the instance releases by then: a prefix of the
    answer's text, held back by 0-6 characters (a stop string starting), all of it (or up to `cut`, where a
    stop string ended it) with the last chunk."""
    context = list(context)
    text_of = lambda ids: decode([*context, *ids])[len(decode(context)):]  # noqa: E731
    text = text_of(answer) if cut is None else text_of(answer)[:cut]
    released, index = 0, 0
    while index < len(answer):
        ids = answer[index:index + rng.randint(1, 4)]
        is_last = index + len(ids) == len(answer)
        upto = len(text) if is_last else max(released, min(len(text), len(text_of(answer[:index + len(ids)]))
                                                             - rng.randint(0, 6)))
        yield TokenChunk(index, tuple(ids), text[released:upto], FinishReason.STOP if is_last else None)
        released, index = upto, index + len(ids)


def check_against_whole_text_placement(rng, tokenizer, markers: dict[int, str], answer: list[int], prompt=PROMPT):
    """Each chunk sends exactly what the whole-text placement sent, on a random chunking, with or without a cut."""
    decode = tokenizer.decode
    cut = rng.randint(0, len(decode(answer))) if rng.random() < 0.3 else None
    state = ReqState("r", prompt, decode, MarkerPlacer(markers, tokenizer, prompt))
    context = tokenizer.detokenizer_context(prompt)  # what the instance decodes the output after
    reference, plain_text = WholeTextPlacer(context, markers, decode), ""
    for piece in instance_chunks(rng, answer, cut, decode, context):
        expected = reference.place(state.token_ids, piece.token_ids, plain_text + piece.text)
        plain_text += piece.text
        assert state.accept(piece).text == expected, (answer, cut)
    assert state.plain_text == plain_text


@pytest.mark.parametrize("seed", range(20))
def test_each_chunk_sends_what_placing_in_the_whole_text_sent(seed):
    """Markers in chunks of their own or with other tokens, side by side, first or last, while the instance holds
    text back before them, and after a stop string's cut (never sent)."""
    rng = random.Random(seed)
    answer = [rng.choice([rng.randrange(26), 90, 91]) if rng.random() < 0.3 else rng.randrange(26)
              for _ in range(rng.randint(1, 60))]
    check_against_whole_text_placement(rng, ToyTokenizer(), MARKERS, answer)


def test_markers_among_split_characters_go_where_decoding_the_whole_text_put_them(model):
    """A real byte-level BPE vocabulary: markers right after a token that ends mid-character (held back by the
    incremental detokenizer), between the pieces of one, and around words, on random streams."""
    tokenizer, markers = model.tokenizer, dict(model.shown_marker_ids)
    words = [ids for text in ("Paris", " the", " é", "😀", "{\"a\": 1}", "\n", " 東京") for ids in
             [tokenizer.encode(text, add_special_tokens=False)]]
    split = [i for i in range(tokenizer.vocab_size) if "\ufffd" in tokenizer.decode([i])][:20]  # part of a character
    assert split, "the tiny vocabulary has byte pieces"
    rng = random.Random(0)
    for _ in range(200):
        answer = []
        for _ in range(rng.randint(1, 25)):
            kind = rng.random()
            answer += [rng.choice(list(markers))] if kind < 0.25 else [rng.choice(split)] if kind < 0.5 else \
                rng.choice(words)
        prompt = [*rng.choice(words), *rng.choice([[], [rng.choice(split)]])]
        check_against_whole_text_placement(rng, tokenizer, markers, answer, prompt)


def test_markers_among_byte_fallback_runs_go_where_decoding_the_whole_text_put_them():
    """SentencePiece's byte fallback: a run of <0xNN> bytes decodes as a whole (a marker inside it leaves it
    open), which the incremental detokenizer holds back until a token ends it."""
    tokenizer = sentencepiece_like_tokenizer()
    tokenizer.backend.add_special_tokens(["[TOOL_CALLS]", "[ARGS]"])
    tokenizer = Tokenizer(tokenizer.backend)
    markers = {tokenizer.backend.token_to_id(m): m for m in ("[TOOL_CALLS]", "[ARGS]")}
    pieces = [f"<0x{b:02X}>" for b in (0x41, 0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0xF0, 0x9F, 0xFF)] + \
        ["▁hi", "▁there", "é", "▁", "ok", "<s>"]
    ids = [tokenizer.backend.token_to_id(p) for p in pieces]
    rng = random.Random(1)
    for _ in range(300):
        answer = [rng.choice(list(markers)) if rng.random() < 0.2 else rng.choice(ids) for _ in range(rng.randint(1, 20))]
        check_against_whole_text_placement(rng, tokenizer, markers, answer, [rng.choice(ids) for _ in range(5)])


def test_a_long_answer_with_markers_decodes_its_length_not_markers_times_its_length(monkeypatch):
    """Each marker decoded the prompt's tail and the whole output before it: these 20k tokens with a marker every
    50 decoded 4e6 ids, markers x length. Counted too: the text the placer is given, and what the state joins
    (each token gave the placer the whole text so far: 7.8e8 characters)."""
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
    tokenizer = ToyTokenizer()
    state = ReqState("r", PROMPT, toy_decode, MarkerPlacer(MARKERS, tokenizer, PROMPT))
    num_tokens = 20_000
    for index in range(num_tokens):
        token_id = 90 + index // 50 % 2 if index % 50 == 49 else index % 26  # a marker every 50 tokens
        state.accept(TokenChunk(index, (token_id,), toy_decode([token_id]), None))
    text = state.text  # read once, here
    assert text.count("<tool_call>") == text.count("</tool_call>") == 200
    assert num_read[0] <= 2 * len(text), num_read[0]  # each character given once, joined once
    assert tokenizer.num_decoded <= 4 * num_tokens, tokenizer.num_decoded  # each id decoded a few times at most
