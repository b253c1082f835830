"""TextOutput: incremental text, stop strings across tokens, hold-back of a possible stop string."""

import pytest

from services.instance.engine.text_output import TextOutput
from services.instance.engine.tokenizer import IncrementalDetokenizer, Tokenizer

pytestmark = pytest.mark.timeout(10)

PIECES = {1: "Hel", 2: "lo", 3: " wor", 4: "ld", 5: "!", 6: "", 7: "END", 8: "x"}


class PieceDetokenizer:
    def feed(self, token_ids: list[int]) -> str:
        return "".join(PIECES[t] for t in token_ids)

    def flush(self) -> str:
        return ""


def stream(text: TextOutput, token_ids: list[int]) -> tuple[list[str], bool]:
    deltas, stopped = [], False
    for token_id in token_ids:
        stopped = text.append(token_id)
        deltas.append(text.take_delta(is_final=stopped))
        if stopped:
            break
    return deltas, stopped


def test_without_stop_strings_every_delta_goes_out_at_once():
    deltas, stopped = stream(TextOutput(PieceDetokenizer(), ()), [1, 2, 3, 4])
    assert deltas == ["Hel", "lo", " wor", "ld"] and not stopped


def test_stop_string_spanning_tokens_cuts_the_text_before_it():
    text = TextOutput(PieceDetokenizer(), ("o wo",))
    deltas, stopped = stream(text, [1, 2, 3, 4])
    assert stopped and "".join(deltas) == "Hell" and text.text == "Hell"
    assert all("o" not in d for d in deltas)  # the start of the stop string was never streamed


def test_held_back_text_is_released_when_it_is_not_a_stop_string():
    text = TextOutput(PieceDetokenizer(), ("END",))
    deltas, stopped = stream(text, [1, 2, 3, 4, 5])
    assert not stopped
    assert "".join(deltas) + text.take_delta(is_final=True) == "Hello world!"
    assert deltas[0] == "H"  # two characters held back: they could start "END"


def test_earliest_of_several_stop_strings_wins():
    text = TextOutput(PieceDetokenizer(), ("ld", "wor"))
    deltas, stopped = stream(text, [1, 2, 3, 4])
    assert stopped and "".join(deltas) == "Hello "


def test_stop_string_inside_one_token():
    deltas, stopped = stream(TextOutput(PieceDetokenizer(), ("N",)), [1, 7, 8])
    assert stopped and "".join(deltas) == "HelE"


def test_empty_pieces_do_not_stop_or_emit():
    deltas, stopped = stream(TextOutput(PieceDetokenizer(), ("zz",)), [6, 6, 1])
    assert deltas == ["", "", "He"] and not stopped


def test_primed_text_is_not_emitted_again():
    text = TextOutput(PieceDetokenizer(), ())
    text.prime([1, 2])
    assert text.take_delta(is_final=False) == ""
    text.append(3)
    assert text.take_delta(is_final=False) == " wor"


def test_stop_strings_count_only_after_min_tokens():
    """vLLM's min_tokens: a stop string in the text of the first min_tokens tokens does not end it; primed
    (resumed) tokens count toward min_tokens."""
    deltas, stopped = stream(TextOutput(PieceDetokenizer(), ("END",), min_tokens=2), [7, 1, 7, 8])
    assert stopped and "".join(deltas) == "ENDHel"
    deltas, stopped = stream(TextOutput(PieceDetokenizer(), ("END",), min_tokens=3), [7, 1, 7, 8])
    assert not stopped and "".join(deltas) == "ENDHelEN"  # its last two characters are held back as always
    primed = TextOutput(PieceDetokenizer(), ("END",), min_tokens=2)
    primed.prime([1, 2])
    assert primed.append(7)


# A resume after a failure: the new instance primes the tokens the client has and goes on
# after the text the client has (`restore`), which may stop short of their whole text.

def streamed(text: TextOutput, token_ids: list[int]) -> tuple[str, bool]:
    """What a client gets of these tokens (all of it once they end in a stop string), and whether they did."""
    out = ""
    for token_id in token_ids:
        if text.append(token_id):
            return out + text.take_delta(is_final=True), True
        out += text.take_delta(is_final=False)
    return out, False


@pytest.mark.parametrize("stop", [(), ("zzz zzz",), ("Paris is",)])
def test_a_resume_at_any_token_gives_the_client_the_same_text(tiny_model_dir, stop):
    """Held-back text (the start of a possible stop string, a character split over byte tokens)
    was never sent: the resumed stream sends it, and sends nothing twice."""
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    token_ids = tokenizer.encode("Paris 🌟🌟 is a café, Paris is é.", add_special_tokens=False)
    assert len(token_ids) > len("Paris 🌟🌟 is a café, Paris is é.") // 2  # the emoji are split over byte tokens

    def make_text() -> TextOutput:
        return TextOutput(IncrementalDetokenizer(tokenizer), stop)

    def finish(text: TextOutput, rest: list[int]) -> str:
        out, stopped = streamed(text, rest)
        return out if stopped else out + text.take_delta(is_final=True)

    whole = finish(make_text(), token_ids)
    k = 1
    while True:  # every resume point before the stream ends
        original = make_text()
        sent, stopped = streamed(original, token_ids[:k])
        if stopped or k == len(token_ids):
            break
        resumed = make_text()
        assert resumed.restore(token_ids[:k], k, sent)
        assert sent + finish(resumed, token_ids[k:]) == whole, f"resumed at token {k}"
        k += 1
    assert k > 20


def test_priming_tokens_that_end_inside_a_character_keeps_the_text_before_it(tiny_model_dir):
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    token_ids = tokenizer.encode("ab🌟", add_special_tokens=False)
    text = TextOutput(IncrementalDetokenizer(tokenizer), ())
    text.prime(token_ids[:-1])  # the emoji's last byte is missing
    assert text.text == "ab"


class HoldingDetokenizer:
    """Holds every piece back until the end, as a run of raw byte tokens is held back until a token
    that is no byte ends it (or the request does)."""

    def __init__(self) -> None:
        self._held = ""

    def feed(self, token_ids: list[int]) -> str:
        self._held += "".join(PIECES[t] for t in token_ids)
        return ""

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held


def test_a_stop_string_in_text_held_back_to_the_end_still_cuts_it():
    text = TextOutput(HoldingDetokenizer(), ("o wo",))
    deltas, stopped = stream(text, [1, 2, 3, 4])
    assert not stopped and deltas == ["", "", "", ""]
    assert text.finish() and text.is_stopped  # before, the held-back text came out whole, stop string and all
    assert text.take_delta(is_final=True) == "Hell" and text.text == "Hell"
    assert not text.finish() and text.take_delta(is_final=True) == ""


def test_held_back_text_before_min_tokens_is_not_looked_through():
    text = TextOutput(HoldingDetokenizer(), ("o wo",), min_tokens=4)
    stream(text, [1, 2, 3, 4])
    assert not text.finish() and text.take_delta(is_final=True) == "Hello world"
