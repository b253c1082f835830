"""Special tool-call markers put back into a request's text for its parser, in place even where the
instance holds text back for a stop string, and never in what a resume sends back (shown_markers.py)."""

from __future__ import annotations

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
