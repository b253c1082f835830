"""Constrained decoding: the tokens a request's grammar allows next (llguidance).

A request whose `SamplingParams.grammar` is set (an llguidance grammar: a JSON schema, a
regex, Lark; see the proto) gets a `Guide`. Before each of its tokens is sampled,
`allowed()` is its vocabulary mask, and the sampler gives every other token -inf; the
token chosen is then `accept`ed. The grammar allows eos only where the text may end, and
once it can take nothing more (`is_complete`) the engine finishes the request (stop).

A guide's state is a function of the request's output tokens alone, so a request that
moves (migration, PD hand-off) or resumes after a failure rebuilds it by replaying them
(`GrammarCompiler.guide(grammar, output_token_ids)`) and goes on exactly where it was.

The llguidance tokenizer (the vocabulary as byte strings, ~0.2 s to build for a 49k
vocabulary) is built once, on the first request with a grammar.

Special tokens: llguidance's mask can allow a special token (or an added one shaped like
`<...>`, which it takes as special) where the grammar spells out its text, and then refuse
it when it is consumed. `allowed()` checks each special token the mask allows and drops
those the grammar would refuse, so a sampled token is always one it takes. (Grammars name
special tokens as llguidance's Lark does: `<|im_start|>` or `<[id]>`.)
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

import llguidance
import tokenizers
import torch

from services.common.errors import InvalidArgument

MAX_GRAMMAR_CHARS = 256 * 1024
_BIT_SHIFTS = torch.arange(8, dtype=torch.uint8)


class Guide:
    """One request's grammar state; used by the engine thread only."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, special_token_ids: torch.Tensor) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._special_token_ids = special_token_ids

    def allowed(self) -> torch.Tensor:
        """bool [vocab_size]: True where the grammar allows the token next (all False: it allows nothing)."""
        bitmask = torch.frombuffer(bytearray(self._matcher.compute_bitmask()), dtype=torch.uint8)
        # Little-endian 32-bit words, token t at bit t % 32 of word t // 32: byte by byte, bit k of byte b is token 8b + k.
        allowed = ((bitmask.unsqueeze(1) >> _BIT_SHIFTS) & 1).flatten()[:self._vocab_size].bool()
        special = self._special_token_ids[allowed[self._special_token_ids]]
        for token_id in special.tolist():  # allowed by the mask; check the grammar takes them (see above)
            if self._matcher.validate_tokens([token_id]) != 1:
                allowed[token_id] = False
        return allowed

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the grammar refuses it (then `error` says why)."""
        return self._matcher.consume_token(token_id)

    @property
    def is_complete(self) -> bool:
        """The grammar can take nothing more: the request is done."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        return self._matcher.get_error() if self._matcher.is_error() else ""


class GrammarCompiler:
    """Builds guides for one model's vocabulary; thread-safe."""

    def __init__(self, backend: tokenizers.Tokenizer, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self._backend = backend
        self._vocab_size = vocab_size
        self._eos_token_ids = sorted(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._special_token_ids = torch.empty(0, dtype=torch.int64)  # what llguidance takes as special, in the vocab
        self._lock = threading.Lock()

    def guide(self, grammar: str, output_token_ids: Sequence[int] = (), *, tokens_field: str = "output_token_ids"
              ) -> Guide:
        """A guide past `output_token_ids`; raises InvalidArgument naming `grammar`, or `tokens_field` where the
        tokens are not what the grammar allows."""
        if len(grammar) > MAX_GRAMMAR_CHARS:
            raise InvalidArgument(f"grammar: {len(grammar)} characters, more than the {MAX_GRAMMAR_CHARS} allowed")
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise InvalidArgument(f"grammar: {_first_line(matcher.get_error())}")
        guide = Guide(matcher, self._vocab_size, self._special_token_ids)
        for index, token_id in enumerate(output_token_ids):
            if not 0 <= token_id < self._vocab_size:
                raise InvalidArgument(f"{tokens_field}: token {index} ({token_id}) is outside the vocabulary "
                                      f"(0 to {self._vocab_size - 1})")
            if not guide.accept(token_id):
                raise InvalidArgument(f"{tokens_field}: token {index} ({token_id}) is not one the grammar allows there")
        if not output_token_ids and not guide.allowed().any():
            raise InvalidArgument("grammar: it allows no first token of this model's vocabulary (unsatisfiable, or "
                                  "it spells out a special token's text: name those <|...|> or <[id]>)")
        return guide

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                tokenizer = llguidance.LLTokenizer(
                    _tokenizer_json(self._backend), n_vocab=max(self._vocab_size, self._backend.get_vocab_size()),
                    eos_token=self._eos_token_ids)
                self._special_token_ids = torch.tensor(
                    [t for t in self._backend.get_added_tokens_decoder() if t < self._vocab_size
                     and tokenizer.is_special_token(t)], dtype=torch.int64)
                self._tokenizer = tokenizer
            return self._tokenizer


def _tokenizer_json(backend: tokenizers.Tokenizer) -> str:
    """The tokenizer as JSON, without padding or truncation (they would change how text is tokenized)."""
    copy = tokenizers.Tokenizer.from_str(backend.to_str())
    copy.no_padding()
    copy.no_truncation()
    return copy.to_str()


def _first_line(error: str) -> str:
    return error.strip().splitlines()[0][:500] if error.strip() else "invalid"
