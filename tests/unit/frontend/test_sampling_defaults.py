"""The model's generation_config.json sampling fields as request defaults (as vLLM applies them),
--generation-config auto|vllm|FOLDER and --override-generation-config (no sockets)."""

from __future__ import annotations

import json

import pytest

from services.frontend.config import load_config
from services.frontend.openai_protocol import RequestError, parse_chat_request, parse_completion_request
from services.frontend.prompt_checks import resolve_max_tokens
from services.frontend.sampling_defaults import SamplingDefaults, load_sampling_defaults

pytestmark = pytest.mark.timeout(10)

MODEL = "tiny"
QWEN3 = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
         "temperature": 0.6, "top_k": 20, "top_p": 0.95, "transformers_version": "4.51.0"}  # Qwen3-0.6B's file


def chat(defaults: SamplingDefaults, **fields):
    return parse_chat_request({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}, MODEL,
                              defaults)


def completion(defaults: SamplingDefaults, **fields):
    return parse_completion_request({"model": MODEL, "prompt": "hello", **fields}, MODEL, defaults)


def model_dir(tmp_path, generation_config: dict | str):
    text = generation_config if isinstance(generation_config, str) else json.dumps(generation_config)
    (tmp_path / "generation_config.json").write_text(text)
    return tmp_path


def test_the_model_folders_file_gives_the_default_of_every_field_a_request_leaves_out(tmp_path):
    defaults = load_sampling_defaults(model_dir(tmp_path, QWEN3), "auto", "")
    assert defaults == SamplingDefaults(temperature=0.6, top_k=20, top_p=0.95)  # eos, do_sample: not sampling fields
    for parse in (chat, completion):
        sampling = parse(defaults).sampling
        assert (sampling.temperature, sampling.top_k, sampling.top_p) == (0.6, 20, 0.95)
        assert (sampling.min_p, sampling.repetition_penalty) == (0.0, 1.0)  # the file leaves them: OpenAI's
        sent = parse(defaults, temperature=0.0, top_k=-1, top_p=1.0).sampling  # what a request sends wins
        assert (sent.temperature, sent.top_k, sent.top_p) == (0.0, 0, 1.0)
        null = parse(defaults, temperature=None, top_p=None).sampling  # an explicit null is left out, as in vLLM
        assert (null.temperature, null.top_p) == (0.6, 0.95)


def test_vllm_reads_no_file_and_a_folder_reads_its_own(tmp_path):
    (tmp_path / "model").mkdir()
    folder = model_dir(tmp_path / "model", QWEN3)
    assert load_sampling_defaults(folder, "vllm", "") == SamplingDefaults()
    assert chat(SamplingDefaults()).sampling.temperature == 1.0
    other = tmp_path / "other"
    other.mkdir()
    model_dir(other, {"temperature": 0.3, "repetition_penalty": 1.1, "min_p": 0.05})
    assert load_sampling_defaults(folder, str(other), "") == SamplingDefaults(temperature=0.3, min_p=0.05,
                                                                                 repetition_penalty=1.1)
    assert load_sampling_defaults(tmp_path / "no-file", "auto", "") == SamplingDefaults()
    with pytest.raises(ValueError, match=rf"--generation-config {tmp_path}: no generation_config.json in that folder"):
        load_sampling_defaults(folder, str(tmp_path), "")


def test_the_override_sets_replaces_and_removes_fields(tmp_path):
    folder = model_dir(tmp_path, QWEN3)
    defaults = load_sampling_defaults(folder, "auto", '{"temperature": 0.5, "min_p": 0.1, "top_k": null}')
    assert defaults == SamplingDefaults(temperature=0.5, top_p=0.95, min_p=0.1)  # null: back to OpenAI's
    assert load_sampling_defaults(folder, "vllm", '{"max_new_tokens": 64}') == SamplingDefaults(max_tokens=64)


@pytest.mark.parametrize("override, words", [
    ("{temperature: 0.5}", ["not valid JSON"]),
    ("[0.5]", ["expected a JSON object"]),
    ('{"temprature": 0.5}', ["unknown field 'temprature'", "temperature, top_p"]),
    ('{"temperature": -1}', ["temperature: must be between 0.0 and 2.0, got -1.0"]),
    ('{"max_new_tokens": 0}', ["max_new_tokens: must be between 1 and"]),
])
def test_a_bad_override_stops_the_start_naming_the_flag(override, words, capsys):
    with pytest.raises(SystemExit) as info:
        load_config(["--manager-address", "m:1", "--override-generation-config", override])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "--override-generation-config: " in err
    assert all(word in err for word in words), err


@pytest.mark.parametrize("values, words", [
    ({"temperature": -1}, ["temperature: must be between 0.0 and 2.0, got -1.0"]),
    ({"temperature": "hot"}, ["temperature: expected a number, got a string"]),
    ({"top_p": 0}, ["top_p: must be in (0, 1], got 0.0"]),
    ({"top_k": 2.5}, ["top_k: expected an integer"]),
    ({"repetition_penalty": 0}, ["repetition_penalty: must be in (0, 2]"]),
    ({"max_new_tokens": True}, ["max_new_tokens: expected an integer, got boolean true"]),
    ("{not json", ["cannot read"]),
    ("[1]", ["expected a JSON object"]),
])
def test_a_file_with_a_value_no_request_could_send_stops_the_start_naming_file_and_field(tmp_path, values, words):
    folder = model_dir(tmp_path, values)
    with pytest.raises(ValueError) as info:
        load_sampling_defaults(folder, "auto", "")
    assert str(folder / "generation_config.json") in str(info.value)
    assert all(word in str(info.value) for word in words) and "--generation-config vllm" in str(info.value)


def test_the_file_read_as_vllm_reads_it(tmp_path):
    """top_k -1 is off; null fields are left out; max_length (a total length) is not max_new_tokens."""
    defaults = load_sampling_defaults(model_dir(tmp_path, {"top_k": -1, "temperature": None, "max_length": 20,
                                                           "do_sample": False, "top_p": 0.9}), "auto", "")
    assert defaults == SamplingDefaults(top_k=0, top_p=0.9)


def test_max_new_tokens_is_chats_default_max_tokens_within_the_context():
    defaults = SamplingDefaults(max_tokens=32)
    assert resolve_max_tokens(chat(defaults), num_prompt_tokens=10, max_model_len=64).sampling.max_tokens == 32
    assert resolve_max_tokens(chat(defaults), 40, 64).sampling.max_tokens == 24  # what the context leaves
    assert resolve_max_tokens(chat(defaults, max_tokens=50), 10, 64).sampling.max_tokens == 50  # sent: it wins
    assert resolve_max_tokens(chat(defaults, max_completion_tokens=40), 10, 64).sampling.max_tokens == 40
    assert resolve_max_tokens(chat(defaults, max_tokens=None), 10, 64).sampling.max_tokens == 32
    assert resolve_max_tokens(completion(defaults), 10, 64).sampling.max_tokens == 16  # OpenAI's, as vLLM keeps
    with pytest.raises(RequestError, match=r"min_tokens: 40 is more than max_tokens \(32, the model's default: "
                                           r"max_new_tokens of its generation config\)"):
        resolve_max_tokens(chat(defaults, min_tokens=40), 10, 64)
    with pytest.raises(RequestError, match=r"min_tokens: 40 is more than max_tokens \(24, what the context leaves"):
        resolve_max_tokens(chat(defaults, min_tokens=40), 40, 64)


def test_the_flags_default_to_vllms():
    config = load_config(["--manager-address", "m:1"])
    assert (config.generation_config, config.override_generation_config) == ("auto", "")


@pytest.mark.parametrize("yaml_value", ["{temperature: 0.5, max_new_tokens: 512, top_k: null}",
                                        "'{\"temperature\": 0.5, \"max_new_tokens\": 512, \"top_k\": null}'"])
def test_a_yaml_file_s_override_may_be_a_mapping_or_its_json(tmp_path, yaml_value):
    """Before, a --config file's mapping became Python's text of it ("{'temperature': 0.5, ...}") and the
    frontend refused it as not valid JSON: only a JSON string worked (a review)."""
    (tmp_path / "frontend.yaml").write_text(f"manager_address: m:1\noverride_generation_config: {yaml_value}\n")
    config = load_config(["--config", str(tmp_path / "frontend.yaml")])
    assert json.loads(config.override_generation_config) == {"temperature": 0.5, "max_new_tokens": 512, "top_k": None}
    defaults = load_sampling_defaults(model_dir(tmp_path, {"top_k": 20}), "auto", config.override_generation_config)
    assert defaults == SamplingDefaults(temperature=0.5, max_tokens=512)


def test_a_yaml_mapping_s_bad_field_stops_the_start_naming_the_flag(tmp_path, capsys):
    (tmp_path / "frontend.yaml").write_text("manager_address: m:1\noverride_generation_config: {temprature: 0.5}\n")
    with pytest.raises(SystemExit) as info:
        load_config(["--config", str(tmp_path / "frontend.yaml")])
    assert info.value.code == 2 and "--override-generation-config: unknown field 'temprature'" in capsys.readouterr().err
