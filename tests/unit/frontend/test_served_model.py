"""ServedModel on the tiny model folder: prompts, the chat template, token strings (no sockets)."""

from __future__ import annotations

import pytest

from services.frontend.openai_protocol import RequestError, parse_chat_request, parse_completion_request
from services.frontend.served_model import ServedModel
from services.instance.engine.model_fingerprint import model_fingerprint


pytestmark = pytest.mark.timeout(60)


def token_ids_of(model, parsed) -> list[list[int]]:
    return [prompt.token_ids for prompt in model.prepared_prompts(parsed)]


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> ServedModel:
    return ServedModel.load(tiny_model_dir, "tiny")


def test_context_and_vocabulary_come_from_config_json(tiny_model_dir, model):
    assert model.max_model_len == 1024 and model.vocab_size == 512
    assert ServedModel.load(tiny_model_dir, "tiny", max_model_len=128).max_model_len == 128


def test_the_weights_fingerprint_is_the_folders_as_an_instance_computes_it(tiny_model_dir, model):
    """The frontend excludes instances of other weights by comparing this with their records' (dispatch.py)."""
    assert model.fingerprint == model_fingerprint(tiny_model_dir) != ""


def test_prompts_as_text_and_as_token_ids(model):
    (text_ids,) = token_ids_of(model, parse_completion_request({"prompt": "the cat"}, "tiny"))
    assert text_ids and model.decode(text_ids) == "the cat"
    assert token_ids_of(model, parse_completion_request({"prompt": [3, 4, 5]}, "tiny")) == [[3, 4, 5]]
    with pytest.raises(RequestError, match=r"^prompt\[1\]: token id 512 is outside the vocabulary") as info:
        token_ids_of(model, parse_completion_request({"prompt": [3, 512]}, "tiny"))
    assert info.value.param == "prompt[1]"


def test_a_batch_gives_each_prompt_its_ids_and_names_the_bad_one(model):
    batch = token_ids_of(model, parse_completion_request({"prompt": ["the cat", [3, 4]]}, "tiny"))
    assert [model.decode(batch[0]), batch[1]] == ["the cat", [3, 4]]
    with pytest.raises(RequestError, match=r"^prompt\[1\]\[1\]: token id 512") as info:
        token_ids_of(model, parse_completion_request({"prompt": ["the cat", [3, 512]]}, "tiny"))
    assert info.value.param == "prompt[1][1]"


def test_add_special_tokens_false_encodes_the_text_alone(model):
    (without,) = token_ids_of(model, parse_completion_request({"prompt": "the cat", "add_special_tokens": False},
                                                                  "tiny"))
    assert without == model.tokenizer.encode("the cat", add_special_tokens=False)


def test_truncate_prompt_tokens_keeps_the_last_ones(model):
    def ids(**fields):
        return token_ids_of(model, parse_completion_request({"prompt": [3, 4, 5, 6], **fields}, "tiny"))
    assert ids(truncate_prompt_tokens=2) == [[5, 6]] and ids(truncate_prompt_tokens=9) == [[3, 4, 5, 6]]
    assert ids(truncate_prompt_tokens=-1) == [[3, 4, 5, 6]]  # the context (1024) holds them all
    assert token_ids_of(model, parse_completion_request({"prompt": [512, 4, 5], "truncate_prompt_tokens": 2},
                                                        "tiny")) == [[4, 5]]  # cut before it is checked
    with pytest.raises(RequestError, match=r"^prompt\[2\]: token id 512") as info:  # its index in the request
        token_ids_of(model, parse_completion_request({"prompt": [3, 4, 512], "truncate_prompt_tokens": 2}, "tiny"))
    assert info.value.param == "prompt[2]"
    chat = parse_chat_request({"messages": [{"role": "user", "content": "hi"}], "truncate_prompt_tokens": 3}, "tiny")
    (whole,) = token_ids_of(model, parse_chat_request({"messages": [{"role": "user", "content": "hi"}]}, "tiny"))
    assert token_ids_of(model, chat) == [whole[-3:]]


def test_chat_goes_through_the_chat_template(model):
    parsed = parse_chat_request({"messages": [{"role": "user", "content": "hi"}]}, "tiny")
    (ids,) = token_ids_of(model, parsed)
    assert model.token_text(ids[0]) == "<|im_start|>"  # special tokens are kept in token strings
    assert model.tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_a_model_without_a_chat_template_rejects_chat_with_400(tiny_model_dir, tmp_path):
    import json
    import shutil
    folder = tmp_path / "no-template"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    model = ServedModel.load(folder, "no-template")
    with pytest.raises(RequestError, match="no chat template"):
        token_ids_of(model, parse_chat_request({"messages": [{"role": "user", "content": "hi"}]}, "no-template"))


def test_an_echoed_token_id_prompt_keeps_its_special_tokens_as_its_logprobs_list_them(model):
    special = model.tokenizer.backend.token_to_id("<|im_start|>")
    prompt = [special, *model.tokenizer.encode("the cat", add_special_tokens=False)]
    text = model.prompt_text(prompt)
    assert text == "".join(model.token_text(token_id) for token_id in prompt)  # text offsets stay monotonic
    assert text.endswith("the cat") and text != "the cat"
    assert model.prompt_text("as given") == "as given"


def test_tools_with_tool_choice_none_reach_the_chat_template_as_transformers_passes_them(tiny_model_dir, tmp_path):
    import json
    import shutil
    folder = tmp_path / "tools-template"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}{% endif %}"
                               "{% for m in messages %}{{ m.content }}{% endfor %}")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    model = ServedModel.load(folder, "tools")
    tools = [{"type": "function", "function": {"name": "get_weather"}}, {"function": {"name": "f2"}}]
    (ids,) = token_ids_of(model, parse_chat_request({"messages": [{"role": "user", "content": "hi"}], "tools": tools,
                                                     "tool_choice": "none"}, "tools"))
    assert model.tokenizer.decode(ids, skip_special_tokens=False) == "TOOLS:get_weather;f2;hi"
    for bad in ([{"type": "function"}], [3], {"f": 1}):
        with pytest.raises(RequestError, match=r"^tools"):
            parse_chat_request({"messages": [{"role": "user", "content": "hi"}], "tools": bad, "tool_choice": "none"},
                               "tools")


def test_tools_the_model_cannot_call_are_refused_unless_tool_choice_is_none(tiny_model_dir, tmp_path):
    import json
    import shutil
    from services.frontend.tool_calls import ToolCallFormat, ToolCallParserSetting
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [{"function": {"name": "f"}}]}
    plain = ServedModel.load(tiny_model_dir, "plain")
    assert plain.tool_call_format is None
    with pytest.raises(RequestError, match=r"^tools: calls cannot be read .*: its chat template shows no tool-call"):
        token_ids_of(plain, parse_chat_request(body, "plain"))
    token_ids_of(plain, parse_chat_request({**body, "tool_choice": "none"}, "plain"))
    forced = ServedModel.load(tiny_model_dir, "plain", tool_call_parser=ToolCallParserSetting.HERMES)
    token_ids_of(forced, parse_chat_request(body, "plain"))
    folder = tmp_path / "hermes-template"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m.content }}{% endfor %}call tools in <tool_call></tool_call>"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert ServedModel.load(folder, "hermes").tool_call_format is ToolCallFormat.HERMES


def test_hermes_models_tool_use_template_shows_the_tools_and_sets_the_format(tiny_model_dir, tmp_path):
    """Hermes 2 Pro and 3 ship named templates; transformers takes "tool_use" when tools are passed."""
    import json
    import shutil
    from services.frontend.tool_calls import ToolCallFormat
    folder = tmp_path / "named-templates"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": "{% for m in messages %}{{ m.content }}{% endfor %}"},
        {"name": "tool_use", "template": "TOOLS {% for t in tools %}{{ t.function.name }}{% endfor %} in "
                                         "<tool_call></tool_call>: {% for m in messages %}{{ m.content }}{% endfor %}"}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    model = ServedModel.load(folder, "named")
    assert model.tool_call_format is ToolCallFormat.HERMES
    body = {"messages": [{"role": "user", "content": "hi"}]}
    (plain,) = token_ids_of(model, parse_chat_request(body, "named"))
    (with_tools,) = token_ids_of(model, parse_chat_request({**body, "tools": [{"function": {"name": "f"}}]}, "named"))
    assert model.tokenizer.decode(plain) == "hi"
    assert model.tokenizer.decode(with_tools) == "TOOLS f in <tool_call></tool_call>: hi"


def test_hermes_tags_the_tokenizer_hides_are_shown_to_the_tool_call_parser_only(tiny_model_dir, tmp_path):
    """Special tokens are left out of the answer's text; a request that reads calls gets its tags back
    in the text its parser reads (before, such a model refused tools with a 400)."""
    import shutil
    from tokenizers import AddedToken, Tokenizer as HfTokenizer
    from services.frontend.tool_calls import ToolCallFormat
    folder = tmp_path / "special-tags"
    shutil.copytree(tiny_model_dir, folder)
    backend = HfTokenizer.from_file(str(folder / "tokenizer.json"))
    backend.add_special_tokens([AddedToken("<tool_call>", special=True), AddedToken("</tool_call>", special=True)])
    (folder / "tokenizer.json").write_text(backend.to_str())
    model = ServedModel.load(folder, "special").with_tool_calls(ToolCallFormat.HERMES)
    assert model.tool_call_format is ToolCallFormat.HERMES
    open_id, close_id = (backend.token_to_id(tag) for tag in ("<tool_call>", "</tool_call>"))
    assert dict(model.shown_marker_ids) == {open_id: "<tool_call>", close_id: "</tool_call>"}
    answer = [*model.tokenizer.encode("ok ", add_special_tokens=False), open_id,
              *model.tokenizer.encode('{"name": "f"}', add_special_tokens=False), close_id]
    assert model.decode(answer) == 'ok {"name": "f"}'  # what the instance's text says


def test_sampling_token_ids_outside_the_vocabulary_are_refused_before_any_dispatch(model):
    for field, value, path in (("stop_token_ids", [3, 512], r"stop_token_ids\[1\]"),
                               ("logit_bias", {"3": 2.0, "512": 1.0}, r"logit_bias\.512")):
        with pytest.raises(RequestError, match=rf"^{path}: token id 512 is outside the vocabulary") as info:
            token_ids_of(model, parse_completion_request({"prompt": "x", field: value}, "tiny"))
        assert info.value.param == path.replace("\\", "")
    assert token_ids_of(model, parse_completion_request({"prompt": [3], "stop_token_ids": [511]}, "tiny")) == [[3]]


def test_constrained_sets_the_checked_grammar_of_structured_output_and_forced_tool_calls(tiny_model_dir, model):
    import llguidance
    from services.frontend.tool_calls import ToolCallParserSetting
    assert model.constrained(parse_completion_request({"prompt": "x"}, "tiny")).sampling.grammar == ""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    completion = model.constrained(parse_completion_request({"prompt": "x", "guided_json": schema}, "tiny"))
    assert '"ok"' in completion.sampling.grammar and not llguidance.LLMatcher.validate_grammar(
        completion.sampling.grammar)
    with pytest.raises(RequestError, match=r"^guided_regex: not a valid constraint"):
        model.constrained(parse_completion_request({"prompt": "x", "guided_regex": "(("}, "tiny"))
    hermes = ServedModel.load(tiny_model_dir, "tiny", tool_call_parser=ToolCallParserSetting.HERMES)
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [{"function": {"name": "f"}}]}
    forced = hermes.constrained(parse_chat_request({**body, "tool_choice": "required"}, "tiny"))
    assert forced.sampling.grammar.startswith("start: call") and '"const": "f"' in forced.sampling.grammar
    auto = parse_chat_request(body, "tiny")
    assert hermes.constrained(auto) is auto  # "auto" alone: free text, calls parsed out of it


def test_forced_tool_calls_on_a_model_without_a_tool_call_format_are_a_400_saying_why(model):
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [{"function": {"name": "f"}}]}
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        with pytest.raises(RequestError, match=r"^tools: calls cannot be forced nor read .*: its chat template shows "
                                               r"no tool-call format"):
            model.constrained(parse_chat_request({**body, "tool_choice": choice}, "tiny"))
