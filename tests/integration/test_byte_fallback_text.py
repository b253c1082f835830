"""Text of SentencePiece byte-fallback tokens end to end: a real instance and frontend serve a tiny model
whose tokenizer spells everything in <0xNN> tokens (as Llama 2, Mistral and Gemma spell characters missing
from their vocabularies), so a prompt ending in two such characters is followed by output bytes that
continue the decoder's run."""

from __future__ import annotations

import json
import shutil

import pytest
from tokenizers import Tokenizer as HfTokenizer
from tokenizers import decoders, models

from services.instance.models.tiny import build_tiny_model
from services.instance.models.tiny_tokenizer import SPECIAL_TOKENS
from tests.integration.scripted_serving import openai_client, serving

pytestmark = pytest.mark.timeout(120)

MODEL = "byte-fallback"
BYTE_A = len(SPECIAL_TOKENS) + ord("A")  # <0x41>


def byte_ids(text: str) -> list[int]:
    return [len(SPECIAL_TOKENS) + b for b in text.encode()]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    base = build_tiny_model(tmp_path_factory.mktemp("models") / "base", "mha-untied", seed=0)
    folder = base.with_name(MODEL)
    shutil.copytree(base, folder)
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)} | {
        f"<0x{b:02X}>": len(SPECIAL_TOKENS) + b for b in range(256)}
    backend = HfTokenizer(models.WordLevel(vocab, unk_token=SPECIAL_TOKENS[0]))
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    (folder / "tokenizer.json").write_text(backend.to_str())
    assert json.loads((folder / "config.json").read_text())["vocab_size"] >= backend.get_vocab_size()
    return folder


@pytest.fixture(scope="module")
def frontend(etcd, model_dir, tmp_path_factory):
    with serving("bytes", etcd, model_dir, tmp_path_factory.mktemp("logs")) as frontend:
        yield frontend


async def test_output_bytes_after_a_prompt_ending_in_byte_characters_are_their_text(frontend):
    """The instance decoded the output after the prompt's last 4 ids, 0x97 E4 BA AC (the end of 北, 京): a run
    that starts mid-character, which the decoder turns into U+FFFD per byte, so the output's "A"s continuing it
    came out "\ufffd\ufffd\ufffd" (a Chinese answer to a Chinese prompt garbled the same way, and a stop string
    was looked for in that)."""
    prompt = byte_ids("Hi北京")
    ask = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0, "logit_bias": {str(BYTE_A): 100}}
    async with openai_client(frontend) as client:
        whole = await client.completions.create(**ask, extra_body={"return_token_ids": True})
        streamed = [chunk.choices[0].text async for chunk in await client.completions.create(**ask, stream=True)]
        stopped = await client.completions.create(**ask, stop=["AA"])
    assert whole.choices[0].model_dump()["token_ids"] == [BYTE_A] * 3
    assert whole.choices[0].text == "".join(streamed) == "AAA"
    assert stopped.choices[0].text == "" and stopped.choices[0].finish_reason == "stop"
