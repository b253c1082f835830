"""Tokenizer, chat template and incremental detokenization on a small byte-level BPE."""

import json
import random
import threading
import time
from pathlib import Path

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from services.instance.engine.tokenizer import IncrementalDetokenizer, Tokenizer

pytestmark = pytest.mark.timeout(60)

SPECIAL = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! Hello again, world.",
    "naïve café déjà vu — ünïcödé text",
    "你好，世界。今天天气很好。",
    "emoji: 🚀🎉🙂 and more 🚀",
] * 20
# A multi-line template: trim_blocks/lstrip_blocks decide its newlines, as in transformers.
CHAT_TEMPLATE = """{{ bos_token }}{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role ' + message['role']) }}
    {% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}
<think></think>
{% endif %}
{% endif %}"""
UNICODE_TEXT = "naïve 你好 🚀🎉 déjà — ok"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer")
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(CORPUS, trainer)
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>",
        "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True},
        "chat_template": CHAT_TEMPLATE,
    }))
    (path / "config.json").write_text(json.dumps({"eos_token_id": 1}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    return path


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


def test_encode_decode_round_trip(tokenizer):
    ids = tokenizer.encode(UNICODE_TEXT)
    assert ids[0] == tokenizer.bos_token_id == 0
    assert tokenizer.encode(UNICODE_TEXT, add_special_tokens=False) == ids[1:]
    assert tokenizer.decode(ids) == UNICODE_TEXT
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<s>" + UNICODE_TEXT


def test_encoding_a_long_prompt_lets_other_threads_run(tokenizer):
    # The frontend encodes in a worker thread; holding the GIL for a 1 MB prompt froze its event
    # loop (every stream, /health) for seconds. Another thread must get turns meanwhile.
    text = "the quick brown fox jumps over the lazy dog. " * 20_000
    ticks, done = [], threading.Event()

    def tick() -> None:
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    ticker = threading.Thread(target=tick)
    ticker.start()
    time.sleep(0.01)
    started = time.perf_counter()
    ids = tokenizer.encode(text)
    ended = time.perf_counter()
    done.set()
    ticker.join()
    during = [t for t in ticks if started < t < ended]
    assert ids and (ended - started < 0.05 or len(during) >= 5), (ended - started, len(during))


def test_eos_ids_come_from_all_three_files(tokenizer):
    assert tokenizer.eos_token_ids == (1, 2, 3)  # config, generation config, then <|im_end|>
    assert tokenizer.special_tokens["eos_token"] == "<|im_end|>"


def test_chat_template_renders_like_transformers(tokenizer, model_dir):
    transformers = pytest.importorskip("transformers")
    reference = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(model_dir / "tokenizer.json"), bos_token="<s>", eos_token="<|im_end|>",
    )
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🚀"}]
    text = tokenizer.apply_chat_template(messages)
    assert text == (
        "<s><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 🚀<|im_end|>\n<|im_start|>assistant\n"
    )
    expected = reference.apply_chat_template(messages, chat_template=CHAT_TEMPLATE, tokenize=False,
                                             add_generation_prompt=True)
    assert text == expected
    assert tokenizer.encode_chat(messages).count(tokenizer.bos_token_id) == 1
    without = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    assert without == text.removesuffix("<|im_start|>assistant\n")


@pytest.mark.parametrize("final", ["The answer is", "The answer is  \n"])
def test_continue_final_message_leaves_the_last_message_open_like_transformers(tokenizer, model_dir, final):
    transformers = pytest.importorskip("transformers")
    reference = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(model_dir / "tokenizer.json"), bos_token="<s>", eos_token="<|im_end|>",
    )
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": final}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\n" + final)  # this template keeps the content as it is
    assert text == reference.apply_chat_template(messages, chat_template=CHAT_TEMPLATE, tokenize=False,
                                                 continue_final_message=True)
    with pytest.raises(ValueError, match="continue_final_message"):
        tokenizer.apply_chat_template([{"role": "user", "content": ""}], add_generation_prompt=False,
                                      continue_final_message=True)


def test_template_variables_reach_the_chat_template(tokenizer):
    """As Qwen3's template reads enable_thinking (vLLM's chat_template_kwargs)."""
    messages = [{"role": "user", "content": "Hi"}]
    plain = tokenizer.apply_chat_template(messages)
    assert tokenizer.apply_chat_template(messages, enable_thinking=False) == plain + "<think></think>\n"
    assert tokenizer.apply_chat_template(messages, enable_thinking=True) == plain
    assert tokenizer.encode_chat(messages, True, enable_thinking=False) == tokenizer.encode(
        plain + "<think></think>\n", add_special_tokens=False)


def test_chat_template_errors_are_value_errors(tokenizer, model_dir, tmp_path):
    with pytest.raises(ValueError, match="unknown role tool"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}])
    (tmp_path / "tokenizer.json").write_text((model_dir / "tokenizer.json").read_text())
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])


def test_chat_template_file_wins(model_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text((model_dir / name).read_text())
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}]) == "[x]"


def _with_template(model_dir: Path, tmp_path: Path, template: str, **special: str) -> Path:
    (tmp_path / "tokenizer.json").write_text((model_dir / "tokenizer.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, **special}))
    return tmp_path


QUIRKY_TEMPLATES = {
    # transformers' assistant-mask marker (TRL's assistant-only loss): a fine-tuned model ships it; before, the
    # template did not compile and the model could not be served (a black-box run)
    "generation": "{% for m in messages %}{% if m.role == 'assistant' %}A: {% generation %}{{ m.content }}"
                  "{% endgeneration %}{{ '\\n' }}{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}",
    # transformers defines tools and documents (null without them): before, `is not none` was true and tojson failed
    "tools": "{% if tools is not none %}TOOLS {{ tools | tojson }}\n{% endif %}{% if documents is not none %}DOCS\n"
             "{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}",
    # every special token tokenizer_config.json names (before: bos, eos, pad and unk only)
    "special": "{% for m in messages %}{{ cls_token }}{{ m.content }}{{ sep_token }}{% endfor %}{{ mask_token }}",
}


@pytest.mark.parametrize("name", sorted(QUIRKY_TEMPLATES))
def test_quirky_templates_render_like_transformers(model_dir, tmp_path, name):
    special = {"bos_token": "<s>", "eos_token": "</s>", "sep_token": "</s>", "cls_token": "<s>",
               "mask_token": "<|im_start|>"}
    path = _with_template(model_dir, tmp_path, QUIRKY_TEMPLATES[name], **special)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "again"}]
    expected = {
        "generation": "user: Hi\nA: Hello\nuser: again\n",
        "tools": "user: Hi\nassistant: Hello\nuser: again\n",
        "special": "<s>Hi</s><s>Hello</s><s>again</s><|im_start|>",
    }[name]
    assert Tokenizer.from_dir(path).apply_chat_template(messages) == expected
    transformers = pytest.importorskip("transformers")
    reference = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), **special)
    assert reference.apply_chat_template(messages, chat_template=QUIRKY_TEMPLATES[name], tokenize=False,
                                         add_generation_prompt=True) == expected


def test_a_requests_tools_replace_the_null_default(model_dir, tmp_path):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    path = _with_template(model_dir, tmp_path, QUIRKY_TEMPLATES["tools"])
    text = Tokenizer.from_dir(path).apply_chat_template([{"role": "user", "content": "Hi"}], tools=tools)
    assert text == f"TOOLS {json.dumps(tools)}\nuser: Hi\n"


# Gemma 3's way with content: a string, or a list whose text parts it trims and writes one after another
LIST_CONTENT_TEMPLATE = (
    "{% for message in messages %}<{{ message['role'] }}>{% if message['content'] is string %}"
    "{{ message['content'] | trim }}{% else %}{% for item in message['content'] %}{% if item['type'] == 'text' %}"
    "{{ item['text'] | trim }}{% endif %}{% endfor %}{% endif %}</>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.mark.parametrize("template", [LIST_CONTENT_TEMPLATE, LIST_CONTENT_TEMPLATE.replace(
    "{% for item in message['content'] %}", "{% set parts = message.content %}{% for item in parts %}")])
def test_a_template_that_loops_over_content_gets_the_content_list_like_transformers(model_dir, tmp_path, template):
    """Before, text parts were always joined with newlines, so such a template saw one text ("a\nb" where
    transformers and vLLM render "ab"; a black-box run)."""
    path = _with_template(model_dir, tmp_path, template)
    parts = [{"type": "text", "text": " a "}, {"type": "text", "text": "b"}]
    messages = [{"role": "user", "content": parts}, {"role": "assistant", "content": "c"}]
    tokenizer = Tokenizer.from_dir(path)
    assert tokenizer.apply_chat_template(messages) == "<user>ab</><assistant>c</><assistant>"
    assert tokenizer.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=False,
                                         continue_final_message=True) == "<user>ab"
    transformers = pytest.importorskip("transformers")
    reference = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    assert reference.apply_chat_template(messages, chat_template=template, tokenize=False,
                                         add_generation_prompt=True) == tokenizer.apply_chat_template(messages)


def test_a_template_that_reads_content_as_text_gets_the_parts_joined(tokenizer):
    """As vLLM's "string" content format: text parts joined with newlines."""
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert tokenizer.apply_chat_template([{"role": "user", "content": parts}]) == \
        tokenizer.apply_chat_template([{"role": "user", "content": "a\nb"}])


def test_incremental_deltas_never_split_characters(tokenizer):
    ids = tokenizer.encode(UNICODE_TEXT, add_special_tokens=False)
    # The test is only meaningful if some token boundary falls inside a character.
    assert any(tokenizer.decode(ids[:n]).endswith("\ufffd") for n in range(1, len(ids)))
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.feed([i]) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == tokenizer.decode(ids) == UNICODE_TEXT
    assert "" in deltas  # some token was held back


def test_incremental_in_chunks_with_special_tokens_and_context(tokenizer):
    prompt = tokenizer.encode("Hello, world!")
    ids = [2, *tokenizer.encode(" 你好🚀 café", add_special_tokens=False), 3]
    detok = IncrementalDetokenizer(tokenizer, context_ids=prompt[-3:])
    deltas = [detok.feed(ids[i : i + 3]) for i in range(0, len(ids), 3)]
    assert "".join(deltas) + detok.flush() == " 你好🚀 café"
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert "".join(detok.feed([i]) for i in ids) + detok.flush() == tokenizer.decode(ids, skip_special_tokens=False)


def test_flush_emits_an_incomplete_tail(tokenizer):
    ids = tokenizer.encode("🚀", add_special_tokens=False)
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.feed(ids[:-1]) == ""
    assert detok.flush() == tokenizer.decode(ids[:-1])
    assert detok.flush() == ""


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_token_bytes_join_to_the_text_even_inside_a_character(tokenizer):
    """Byte-level BPE splits an emoji over tokens whose own text is U+FFFD; their bytes are exact."""
    text = "ok 🌟 é!"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.token_bytes(i) for i in ids]
    assert b"".join(pieces).decode() == text
    assert any(tokenizer.decode([i]) == "\ufffd" for i in ids)  # some piece is part of a character


def test_token_bytes_of_sentencepiece_byte_fallback_and_of_special_tokens():
    backend = BackendTokenizer(models.WordLevel({"<0xE8>": 0, "▁hi": 1, "<s>": 2}, unk_token="<s>"))
    backend.add_special_tokens(["<s>"])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer = Tokenizer(backend)
    assert (tokenizer.token_bytes(0), tokenizer.token_bytes(1), tokenizer.token_bytes(2)) == (b"\xe8", b" hi", b"<s>")


def sentencepiece_like_tokenizer() -> Tokenizer:
    """Llama 2's decoding of a vocabulary of words and every <0xNN> byte (byte fallback)."""
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    vocab |= {word: 256 + n for n, word in enumerate(["<s>", "▁hi", "▁there", "é", "▁", "ok"])}
    backend = BackendTokenizer(models.WordLevel(vocab, unk_token="<s>"))
    backend.add_special_tokens(["<s>"])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    return Tokenizer(backend)


def streamed_text(tokenizer: Tokenizer, ids: list[int]) -> str:
    detok = IncrementalDetokenizer(tokenizer)
    return "".join(detok.feed([i]) for i in ids) + detok.flush()


@pytest.mark.parametrize("pieces", [
    ["<0x42>", "<0xE2>", "▁hi"],  # a valid byte, then one that starts no character: the whole run is invalid
    ["<0xF0>", "<0x9F>", "<0x9A>", "<0x80>", "ok", "<0xE2>"],  # an emoji, then a dangling byte at the end
    ["▁hi", "<0x41>", "<0x42>", "<0xFF>", "<0x43>", "▁there"],
    ["<0xC3>", "<0xA9>", "é", "<0xC3>", "▁", "<0xA9>"],
    ["<0x41>", "<s>", "<0x9F>", "▁there"],  # a skipped special token leaves the run open: "A" turns into U+FFFD
])
def test_streamed_byte_fallback_text_equals_the_full_decode(pieces):
    tokenizer = sentencepiece_like_tokenizer()
    ids = [tokenizer.backend.token_to_id(p) for p in pieces]
    assert streamed_text(tokenizer, ids) == tokenizer.decode(ids)


def test_streamed_random_byte_fallback_text_equals_the_full_decode():
    """Random ids, as a random-weight model emits them: the same text streamed as decoded at once."""
    tokenizer = sentencepiece_like_tokenizer()
    generator = random.Random(0)
    for _ in range(300):
        ids = [generator.choice([*range(0x41, 0x44), 0xC3, 0xA9, 0xE2, 0xF0, 0x9F, 0xFF, *range(257, 262)])
               for _ in range(generator.randint(1, 12))]
        assert streamed_text(tokenizer, ids) == tokenizer.decode(ids), ids


@pytest.mark.parametrize(("prompt_text", "num_context"), [("北京", 6), ("a北京", 6), ("🐶🐱", 4), ("ok", 2)])
def test_output_bytes_after_a_prompt_of_byte_characters_stream_as_the_whole_text_decodes(prompt_text, num_context):
    """The context of the prompt's last 4 ids is widened back to a character's first byte: from
    mid-character the decoder turned the whole run, the output's bytes too, into U+FFFD."""
    tokenizer = sentencepiece_like_tokenizer()
    prompt = [tokenizer.backend.token_to_id(f"<0x{b:02X}>") for b in prompt_text.encode()]
    output = [tokenizer.backend.token_to_id(f"<0x{b:02X}>") for b in "是A".encode()]
    context = tokenizer.detokenizer_context(prompt)
    assert len(context) == num_context  # 北京: from 北's first byte, not its last
    detok = IncrementalDetokenizer(tokenizer, context_ids=context)
    text = "".join(detok.feed([i]) for i in output) + detok.flush()
    assert tokenizer.decode(prompt + output) == prompt_text + text == prompt_text + "是A"


def metaspace_tokenizer() -> Tokenizer:
    """Mistral-like: BPE over "▁"-marked words, whose decoder drops the space before the text's first word."""
    backend = BackendTokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    backend.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>"]))
    return Tokenizer(backend)


def wordpiece_tokenizer() -> Tokenizer:
    backend = BackendTokenizer(models.WordPiece(unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece(prefix="##")
    backend.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]"]))
    return Tokenizer(backend)


@pytest.mark.parametrize("make", [metaspace_tokenizer, wordpiece_tokenizer])
def test_token_bytes_after_the_first_token_join_to_the_rest_of_the_text(make):
    """A word's space, which decoding drops only at the start of a text, is part of its token."""
    tokenizer = make()
    for text in ["The quick brown fox jumps", "Hello again, world."]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text and len(ids) > 2
        rest = b"".join(tokenizer.token_bytes(i) for i in ids[1:]).decode()
        assert tokenizer.decode(ids[:1]) + rest == text, (text, rest)


def test_a_vocabulary_without_a_plain_letter_still_keeps_word_spaces():
    """Llama 2's decoding (it strips the text's first space) over words and bytes, no "a" or "e" piece."""
    tokenizer = sentencepiece_like_tokenizer()
    ids = [tokenizer.backend.token_to_id(p) for p in ["▁hi", "▁there", "ok", "▁hi"]]
    rest = b"".join(tokenizer.token_bytes(i) for i in ids[1:]).decode()
    assert tokenizer.decode(ids[:1]) + rest == tokenizer.decode(ids) == "hi thereok hi"


def test_a_word_and_the_same_piece_inside_a_word_differ():
    tokenizer = metaspace_tokenizer()
    word, piece = tokenizer.backend.token_to_id("▁The"), tokenizer.backend.token_to_id("The")
    assert (tokenizer.token_bytes(word), tokenizer.token_bytes(piece)) == (b" The", b"The")


def straddling_tokenizer() -> Tokenizer:
    """Byte-level BPE with a token that ends one CJK character and starts the next: "¯ä¸" is the
    bytes AF E4 B8, so a run of it spells 丯 (E4 B8 AF) again and again, always a character short."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab["¯ä"], vocab["¯ä¸"] = len(vocab), len(vocab) + 1
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=[("¯", "ä"), ("¯ä", "¸")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return Tokenizer(backend)


def test_tokens_that_straddle_characters_stream_their_whole_characters():
    """Each token's text ends inside a character: what comes before that character still goes out
    (before, the whole run was held back to the end, and stop strings in it were never seen)."""
    tokenizer = straddling_tokenizer()
    ids = [tokenizer.backend.token_to_id("¯ä¸")] * 6
    assert tokenizer.decode(ids) == "\ufffd" + "丯" * 5 + "\ufffd"
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.feed([i]) for i in ids]
    assert deltas == ["", "\ufffd丯", "丯", "丯", "丯", "丯"]
    assert "".join(deltas) + detok.flush() == tokenizer.decode(ids)


def test_a_stop_string_inside_straddling_tokens_stops_the_text():
    from services.instance.engine.text_output import TextOutput

    tokenizer = straddling_tokenizer()
    text = TextOutput(IncrementalDetokenizer(tokenizer), stop=("丯丯",))
    token_id = tokenizer.backend.token_to_id("¯ä¸")
    stopped = [text.append(token_id) for _ in range(3)]  # "", "\ufffd丯", "丯": the stop string is whole
    assert stopped == [False, False, True]
    assert text.text == "\ufffd" and text.take_delta(is_final=True) == "\ufffd"
