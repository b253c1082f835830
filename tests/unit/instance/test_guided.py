"""Constrained decoding's grammar state (llguidance) on the tiny byte-level BPE tokenizer:
the mask allows exactly what the grammar can take next, a guide rebuilt from a request's
tokens is where the original was, and bad grammars and tokens are refused by field name."""

import json

import llguidance
import pytest

from services.common.errors import InvalidArgument
from services.instance.engine.guided import MAX_GRAMMAR_CHARS, GrammarCompiler
from services.instance.engine.tokenizer import Tokenizer

pytestmark = pytest.mark.timeout(60)

CHOICE = llguidance.LLMatcher.grammar_from_regex("(yes|no) please")
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer.backend, tokenizer.backend.get_vocab_size() + 5, tokenizer.eos_token_ids)


def texts_allowed(guide, tokenizer: Tokenizer) -> set[str]:
    return {tokenizer.decode([t]) for t in guide.allowed().nonzero().flatten().tolist()}


def test_the_mask_allows_what_can_come_next_and_eos_only_at_the_end(compiler, tokenizer):
    guide = compiler.guide(CHOICE)
    assert guide.allowed().shape == (tokenizer.backend.get_vocab_size() + 5,)
    first = texts_allowed(guide, tokenizer)
    assert first and all("yes".startswith(t) or "no".startswith(t) or t in ("yes ", "no ") for t in first)
    ids = tokenizer.encode("yes please")
    for token_id in ids:
        assert guide.allowed()[token_id]
        assert guide.accept(token_id)
    assert guide.is_complete and not guide.error
    assert set(guide.allowed().nonzero().flatten().tolist()) <= set(tokenizer.eos_token_ids)


def test_a_guide_rebuilt_from_the_output_so_far_goes_on_where_it_was(compiler, tokenizer):
    ids = tokenizer.encode(json.dumps({"ok": True}))
    for cut in range(len(ids)):
        original = compiler.guide(llguidance.LLMatcher.grammar_from_json_schema(SCHEMA))
        for token_id in ids[:cut]:
            assert original.accept(token_id)
        rebuilt = compiler.guide(llguidance.LLMatcher.grammar_from_json_schema(SCHEMA), ids[:cut])
        assert rebuilt.allowed().equal(original.allowed())


def test_a_refused_token_is_an_error_not_an_exception(compiler, tokenizer):
    guide = compiler.guide(CHOICE)
    assert not guide.accept(tokenizer.encode("maybe")[0])
    assert guide.error


@pytest.mark.parametrize("grammar, message", [
    ("start: foo", "grammar: at 1(8): unknown name"),
    (llguidance.LLMatcher.grammar_from_regex("a(b"), "grammar: "),
    (llguidance.LLMatcher.grammar_from_json_schema({"type": "objectx"}), "grammar: "),
    ("x" * (MAX_GRAMMAR_CHARS + 1), f"grammar: {MAX_GRAMMAR_CHARS + 1} characters"),
])
def test_a_bad_grammar_is_invalid_argument_naming_the_field(compiler, grammar, message):
    with pytest.raises(InvalidArgument, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        compiler.guide(grammar)


def test_tokens_the_grammar_does_not_allow_are_refused_naming_their_field(compiler, tokenizer):
    with pytest.raises(InvalidArgument, match=r"^resume_token_ids: token 0 \("):
        compiler.guide(CHOICE, tokenizer.encode("maybe"), tokens_field="resume_token_ids")


def test_a_special_token_the_mask_lets_through_but_the_grammar_refuses_is_not_allowed(compiler, tokenizer):
    # llguidance's mask allows <|im_start|> where the grammar spells its text, then refuses the token itself
    im_start = tokenizer.backend.token_to_id("<|im_start|>")
    guide = compiler.guide('start: "ab" "<|im_start|>"')
    for token_id in tokenizer.encode("ab"):
        assert guide.accept(token_id)
    assert not guide.allowed().any()  # the engine stops such a request there
    with pytest.raises(InvalidArgument, match="^grammar: it allows no first token"):
        compiler.guide('start: "<|im_start|>" "x"')
    named = compiler.guide('start: <|im_start|> "x"')  # named as llguidance's Lark names special tokens: taken
    assert named.allowed()[im_start] and named.accept(im_start)



def test_tokens_outside_the_vocabulary_and_grammars_nothing_satisfies_are_refused(compiler):
    vocab = compiler.guide(CHOICE).allowed().shape[0]
    for token_id in (-1, vocab, 2**31 - 1):
        with pytest.raises(InvalidArgument, match=r"^resume_token_ids: token 0 \(.*\) is outside the vocabulary"):
            compiler.guide(CHOICE, [token_id], tokens_field="resume_token_ids")
    impossible = llguidance.LLMatcher.grammar_from_json_schema({"type": "integer", "minimum": 5, "maximum": 1})
    with pytest.raises(InvalidArgument, match="^grammar: Unsatisfiable schema"):
        compiler.guide(impossible)
