"""A request's text state (`TextOutput`) as it enters the engine: new, resumed after its instance failed (after
the text its client has), or migrated in (after the text its source sent). Reads only the tokenizer: may run
off the engine thread."""

from __future__ import annotations

from services.common.errors import FailedPrecondition, InvalidArgument
from services.instance.engine.migration_state import RequestState
from services.instance.engine.request import SamplingParams
from services.instance.engine.text_output import TextOutput
from services.instance.engine.tokenizer import IncrementalDetokenizer, Tokenizer


def new_text(tokenizer: Tokenizer, prompt: tuple[int, ...], sampling: SamplingParams) -> TextOutput:
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.detokenizer_context(prompt))
    return TextOutput(detokenizer, tuple(sampling.stop), sampling.min_tokens)


def resumed_text(tokenizer: Tokenizer, prompt: tuple[int, ...], sampling: SamplingParams, resumed: list[int],
                 resume_text: str | None) -> TextOutput:
    """The text past the `resumed` tokens, of which the client has `resume_text` (None: all)."""
    text = new_text(tokenizer, prompt, sampling)
    if resume_text is None:
        text.prime(resumed)
    elif not text.restore(resumed, len(resumed), resume_text):
        raise InvalidArgument(f"resume_text: {resume_text[:40]!r}... is not how the text of resume_token_ids "
                              "starts; send the text the client received of those tokens")
    return text


def migrated_text(tokenizer: Tokenizer, state: RequestState) -> TextOutput:
    """The text state the source had."""
    text = new_text(tokenizer, state.prompt_token_ids, state.sampling)
    if not text.restore(list(state.output_token_ids), state.num_resumed_tokens, state.text_sent):
        raise FailedPrecondition(f"request {state.request_id}: the text the source sent does not match this "
                                 "instance's detokenization; migrate only between instances of the same model")
    return text
