"""The frontend end to end: a real instance process on a tiny model, a real etcd, the
frontend process, and the `openai` client. No manager runs, so every request takes the
frontend's own etcd fallback (and the fallback counter shows it)."""

from __future__ import annotations

import asyncio
import json
import signal
import uuid

import aiohttp
import grpc
import openai
import pytest
import torch

from services.cluster.processes import ServiceProcess
from services.common.etcd_launcher import free_port
from services.common.gen.ferry.v1 import common_pb2, instance_pb2, instance_pb2_grpc
from services.common.registry import Registry
from services.instance.engine.tokenizer import Tokenizer

pytestmark = pytest.mark.timeout(120)

NUM_BLOCKS = 64
BLOCK_SIZE = 4
MAX_MODEL_LEN = 256
KEYS = ("key-one", "key-two")
ORIGIN = "https://chat.example.com"  # the one origin whose pages may call this frontend (CORS)
PROMPT_IDS = [5, 17, 42, 99, 7, 3]


@pytest.fixture(scope="module")
def cluster_name() -> str:
    return f"fe-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def instance(etcd, tiny_model_dir, cluster_name, tmp_path_factory):
    port = free_port()
    process = ServiceProcess(
        "instance-fe", "instance",
        ["--model", str(tiny_model_dir), "--port", str(port), "--instance-id", "fe-0", "--num-threads", "1",
         "--etcd-endpoints", etcd.endpoint, "--cluster", cluster_name, "--lease-ttl-s", "3",
         "--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE), "--max-model-len", str(MAX_MODEL_LEN)],
        f"127.0.0.1:{port}", tmp_path_factory.mktemp("logs"))
    process.start()
    try:
        asyncio.run(process.wait_healthy(90))
        yield process
    finally:
        process.stop()


def frontend_process(name, etcd, model_dir, cluster_name, log_dir, *extra: str) -> ServiceProcess:
    port = free_port("127.0.0.1")
    return ServiceProcess(
        name, "frontend",
        ["--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port), "--etcd-endpoints", etcd.endpoint,
         "--cluster", cluster_name, "--max-model-len", str(MAX_MODEL_LEN), *extra],
        f"http://127.0.0.1:{port}", log_dir)


def start_frontend(name, etcd, model_dir, cluster_name, log_dir, *extra: str) -> ServiceProcess:
    return frontend_process(name, etcd, model_dir, cluster_name, log_dir, *extra).start()


@pytest.fixture(scope="module")
def frontend(instance, etcd, tiny_model_dir, cluster_name, tmp_path_factory):
    process = start_frontend("frontend-fe", etcd, tiny_model_dir, cluster_name, tmp_path_factory.mktemp("logs"),
                             "--api-key", KEYS[0], "--api-key", KEYS[1], "--max-body-bytes", "65536",
                             "--allowed-origins", ORIGIN.replace("chat", "Chat") + "/")  # as people type it
    try:
        asyncio.run(process.wait_healthy(60))
        yield process
    finally:
        process.stop()


@pytest.fixture
async def client(frontend):
    async with openai.AsyncOpenAI(base_url=f"{frontend.address}/v1", api_key=KEYS[0], max_retries=0,
                                  timeout=60) as client:
        yield client


@pytest.fixture
async def http(frontend):
    async with aiohttp.ClientSession(base_url=frontend.address, headers={"Authorization": f"Bearer {KEYS[1]}"},
                                     timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


@pytest.fixture
async def instance_stub(instance):
    async with grpc.aio.insecure_channel(instance.address) as channel:
        yield instance_pb2_grpc.InstanceServiceStub(channel)


MODEL = "tiny-gqa-tied"  # the model folder's name


async def instance_greedy(stub, prompt_ids, max_tokens, **sampling) -> tuple[list[int], str]:
    request = instance_pb2.GenerateRequest(
        request_id=f"ref-{uuid.uuid4().hex}", prompt_token_ids=prompt_ids,
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **sampling))
    chunks = [chunk async for chunk in stub.Generate(request, timeout=60)]
    return [t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks)


# ---- completions and chat ----------------------------------------------------------------


async def test_completion_token_ids_match_the_instances_own_output(client, instance_stub):
    expected_ids, expected_text = await instance_greedy(instance_stub, PROMPT_IDS, 12)
    raw = await client.completions.with_raw_response.create(
        model=MODEL, prompt=PROMPT_IDS, max_tokens=12, temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True})
    completion = raw.parse()
    choice = completion.choices[0].model_dump()
    assert choice["token_ids"] == expected_ids
    assert choice["text"] == expected_text
    assert choice["finish_reason"] == "length"
    assert completion.usage.prompt_tokens == len(PROMPT_IDS) and completion.usage.completion_tokens == 12
    assert raw.headers["x-request-id"] == completion.id and completion.id.startswith("cmpl-")


async def test_a_clients_request_id_names_the_request_and_a_bad_one_is_a_400(http, instance_stub):
    body = {"model": MODEL, "prompt": PROMPT_IDS, "max_tokens": 3, "temperature": 0}
    async with http.post("/v1/completions", json=body, headers={"X-Request-Id": "trace-7"}) as response:
        completion = await response.json()
        assert response.status == 200 and completion["id"].startswith("cmpl-trace-7-")
        assert response.headers["x-request-id"] == completion["id"]
    async with http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "request_id": "from-body", "stream": True}) as response:
        assert response.status == 200 and response.headers["x-request-id"].startswith("chatcmpl-from-body-")
        await response.read()
    async with http.post("/v1/completions", json=body, headers={"X-Request-Id": "two words"}) as response:
        assert response.status == 200 and response.headers["x-request-id"].startswith("cmpl-two_words-")
    async with http.post("/v1/completions", json={**body, "request_id": 5}) as response:
        assert response.status == 400 and (await response.json())["error"]["param"] == "request_id"


async def test_logit_bias_and_penalties_reach_the_engine(client, instance_stub):
    async def token_ids(**body) -> list[int]:
        completion = await client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=12, temperature=0,
                                                     extra_body={"return_token_ids": True, "ignore_eos": True, **body})
        return completion.choices[0].model_dump()["token_ids"]
    plain = await token_ids()
    assert await token_ids(logit_bias={"17": 100}) == [17] * 12  # forced every step
    assert (await token_ids(logit_bias={str(plain[0]): -100}))[0] != plain[0]  # banned
    penalized, _ = await instance_greedy(instance_stub, PROMPT_IDS, 12, presence_penalty=1.5, frequency_penalty=1.0)
    assert penalized != plain  # (this model repeats tokens when greedy)
    assert await token_ids(presence_penalty=1.5, frequency_penalty=1.0) == penalized


async def test_n_choices_are_requests_of_their_own_whole_and_streamed(client):
    seeded = await client.completions.create(model=MODEL, prompt="the cat sat", max_tokens=8, temperature=1.0, seed=11,
                                             n=3, extra_body={"return_token_ids": True, "ignore_eos": True})
    assert [c.index for c in seeded.choices] == [0, 1, 2] and seeded.usage.completion_tokens == 24
    by_seed = [await client.completions.create(model=MODEL, prompt="the cat sat", max_tokens=8, temperature=1.0,
                                               seed=11 + i, extra_body={"return_token_ids": True, "ignore_eos": True})
               for i in range(3)]  # choice i is the request with seed + i
    assert [c.model_dump()["token_ids"] for c in seeded.choices] == \
        [r.choices[0].model_dump()["token_ids"] for r in by_seed]
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=1.0, seed=5, n=2,
        stream=True, stream_options={"include_usage": True}, extra_body={"return_token_ids": True, "ignore_eos": True})
    chunks = [chunk async for chunk in stream]
    streamed = {0: [], 1: []}
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.model_dump().get("token_ids") or []
    whole = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=1.0, seed=5, n=2,
        extra_body={"return_token_ids": True, "ignore_eos": True})
    assert [streamed[0], streamed[1]] == [c.model_dump()["token_ids"] for c in whole.choices]
    assert chunks[-1].usage.completion_tokens == 12 and len({c.id for c in chunks}) == 1


async def test_a_batch_of_prompts_answers_as_its_prompts_one_by_one_whole_and_streamed(client):
    prompts = ["the cat sat", PROMPT_IDS, "once upon a time"]
    options = dict(model=MODEL, max_tokens=6, temperature=1.0, seed=7, extra_body={"return_token_ids": True,
                                                                                 "ignore_eos": True})
    batch = await client.completions.create(prompt=prompts, n=2, **options)
    singles = [await client.completions.create(prompt=prompt, n=2, **options) for prompt in prompts]
    expected = [c.model_dump()["token_ids"] for single in singles for c in single.choices]
    assert [c.index for c in batch.choices] == list(range(6))  # prompt i's choice j is i * 2 + j
    assert [c.model_dump()["token_ids"] for c in batch.choices] == expected
    assert [c.model_dump()["prompt_token_ids"] for c in batch.choices] == \
        [single.choices[0].model_dump()["prompt_token_ids"] for single in singles for _ in range(2)]
    assert batch.usage.prompt_tokens == sum(single.usage.prompt_tokens for single in singles)
    assert batch.usage.completion_tokens == 36
    stream = await client.completions.create(prompt=prompts, n=2, stream=True,
                                             stream_options={"include_usage": True}, **options)
    streamed: dict[int, list[int]] = {index: [] for index in range(6)}
    chunks = [chunk async for chunk in stream]
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.model_dump()["token_ids"]
    assert list(streamed.values()) == expected
    assert chunks[-1].usage.prompt_tokens == batch.usage.prompt_tokens


async def test_echo_returns_each_prompt_before_its_output_whole_and_streamed(client, tiny_model_dir):
    options = dict(model=MODEL, max_tokens=5, temperature=0, echo=True, extra_body={"ignore_eos": True})
    plain = [(await client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                              extra_body={"ignore_eos": True})).choices[0].text
             for prompt in ("the cat sat", PROMPT_IDS)]
    echoed = await client.completions.create(prompt=["the cat sat", PROMPT_IDS], **options)
    ids_text = Tokenizer.from_dir(tiny_model_dir).decode(PROMPT_IDS)  # token ids echo as their text
    assert [c.text for c in echoed.choices] == ["the cat sat" + plain[0], ids_text + plain[1]]
    stream = await client.completions.create(prompt="the cat sat", stream=True, **options)
    texts = [chunk.choices[0].text async for chunk in stream if chunk.choices]
    assert texts[0] == "the cat sat" and "".join(texts) == echoed.choices[0].text


async def test_an_echoed_prompt_cut_by_truncate_prompt_tokens_is_what_the_model_saw(client, tiny_model_dir):
    """Its text, logprobs tokens and offsets agree (before, the text was the whole prompt as given, the
    tokens only those kept, and the offsets pointed into the wrong text)."""
    options = dict(model=MODEL, max_tokens=1, temperature=0, echo=True, logprobs=0,
                   extra_body={"ignore_eos": True, "truncate_prompt_tokens": 2})
    kept = Tokenizer.from_dir(tiny_model_dir).decode(PROMPT_IDS[-2:])
    for prompt in (PROMPT_IDS, Tokenizer.from_dir(tiny_model_dir).decode(PROMPT_IDS)):
        (choice,) = (await client.completions.create(prompt=prompt, **options)).choices
        assert choice.text.startswith(kept) and "".join(choice.logprobs.tokens) == choice.text
        assert [choice.text[o:o + len(t)] for o, t in zip(choice.logprobs.text_offset, choice.logprobs.tokens)] == \
            choice.logprobs.tokens


async def test_echo_with_logprobs_scores_the_prompt_as_transformers_does(client, tiny_model_dir):
    """lm-eval's loglikelihood request: the prompt's logprobs (the first token's null), whole and streamed,
    also when the prompt's blocks are in the prefix cache."""
    from transformers import LlamaForCausalLM
    hf = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.inference_mode():
        reference = hf(torch.tensor([PROMPT_IDS])).logits[0, :-1].float().log_softmax(dim=-1)
    expected = [reference[i, token_id].item() for i, token_id in enumerate(PROMPT_IDS[1:])]
    for _ in range(2):  # the second time, the prompt's blocks are cached: its logprobs are computed all the same
        scored = await client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=0, echo=True, logprobs=1,
                                                 temperature=0)
        (choice,) = scored.choices
        assert choice.text == Tokenizer.from_dir(tiny_model_dir).decode(PROMPT_IDS)
        assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
        assert len(choice.logprobs.tokens) == len(PROMPT_IDS) and scored.usage.completion_tokens == 0
    stream = await client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=3, echo=True, logprobs=2,
                                             temperature=0, stream=True, extra_body={"ignore_eos": True})
    chunks = [chunk.choices[0] async for chunk in stream if chunk.choices]
    assert chunks[0].logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    token_logprobs = [lp for chunk in chunks for lp in chunk.logprobs.token_logprobs]
    assert len(token_logprobs) == len(PROMPT_IDS) + 3 and all(lp <= 0 for lp in token_logprobs[1:])
    vllm_shaped = await client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=1, temperature=0,
                                                  extra_body={"prompt_logprobs": 2})
    entries = vllm_shaped.choices[0].model_dump()["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(PROMPT_IDS)
    for row, (entry, token_id) in enumerate(zip(entries[1:], PROMPT_IDS[1:])):
        mine = entry[str(token_id)]
        assert mine["logprob"] == pytest.approx(expected[row], abs=1e-4)
        assert mine["rank"] == int((reference[row] > reference[row, token_id] + 1e-5).sum()) + 1
        assert {int(k) for k, v in entry.items() if v["rank"] <= 2} == set(reference[row].topk(2).indices.tolist())


async def test_a_batch_with_one_bad_prompt_is_refused_whole_naming_it(http):
    async with http.post("/v1/completions", json={"model": MODEL, "prompt": ["fine", [5, 100000]]}) as response:
        body = await response.json()
    assert response.status == 400 and body["error"]["param"] == "prompt[1][1]"
    assert body["error"]["message"].startswith("prompt[1][1]: token id 100000 is outside the vocabulary")


async def test_streamed_completion_equals_the_whole_one(client):
    whole = await client.completions.create(model=MODEL, prompt="the cat sat", max_tokens=10, temperature=0,
                                            extra_body={"return_token_ids": True, "ignore_eos": True})
    stream = await client.completions.create(
        model=MODEL, prompt="the cat sat", max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"return_token_ids": True, "ignore_eos": True})
    chunks = [chunk async for chunk in stream]
    token_chunks = [c for c in chunks if c.choices]
    assert [t for c in token_chunks for t in c.choices[0].model_dump()["token_ids"]] == \
        whole.choices[0].model_dump()["token_ids"]
    assert "".join(c.choices[0].text for c in token_chunks) == whole.choices[0].text
    assert token_chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert len({c.id for c in chunks}) == 1


async def test_chat_whole_and_streamed(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    whole = await client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=8,
                                                 temperature=0, extra_body={"return_token_ids": True,
                                                                            "ignore_eos": True})
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == 8 and whole.choices[0].finish_reason == "length"
    stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                  stream=True, extra_body={"return_token_ids": True,
                                                                           "ignore_eos": True})
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert [t for c in chunks for t in c.choices[0].model_dump()["token_ids"]] == \
        whole.choices[0].model_dump()["token_ids"]
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_seed_reproduces_a_sampled_completion(client):
    def ask():
        return client.completions.create(model=MODEL, prompt="once upon", max_tokens=12, temperature=1.0, top_p=0.9,
                                         seed=1234, extra_body={"top_k": 50, "ignore_eos": True,
                                                                "return_token_ids": True})
    first, second = await ask(), await ask()
    assert first.choices[0].model_dump()["token_ids"] == second.choices[0].model_dump()["token_ids"]


async def test_stop_string_ends_the_output_before_it(client):
    whole = await client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=24, temperature=0,
                                            extra_body={"ignore_eos": True})
    text = whole.choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    if not stop.strip():
        pytest.skip(f"no usable stop string in {text!r}")
    stopped = await client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=24, temperature=0,
                                              stop=[stop], extra_body={"ignore_eos": True})
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[: text.index(stop)]


async def test_logprobs(client):
    completion = await client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=5, temperature=0,
                                                 logprobs=2, extra_body={"ignore_eos": True})
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    assert all(len(top) <= 2 for top in logprobs.top_logprobs) and all(lp <= 0 for lp in logprobs.token_logprobs)
    chat = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=4, temperature=0, logprobs=True, top_logprobs=3,
                                                extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(entry.top_logprobs) == 3 for entry in content)


async def test_tokenize_and_detokenize_agree_with_what_generation_uses(http, client, tiny_model_dir):
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    async with http.post("/tokenize", json={"model": MODEL, "prompt": "the cat sat"}) as response:
        tokenized = await response.json()
    assert tokenized == {"count": len(tokenizer.encode("the cat sat")), "max_model_len": MAX_MODEL_LEN,
                         "tokens": tokenizer.encode("the cat sat")}
    completion = await client.completions.create(model=MODEL, prompt="the cat sat", max_tokens=1, temperature=0)
    assert completion.usage.prompt_tokens == tokenized["count"]  # the same ids the request was served with
    async with http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}) as response:
        chat_ids = (await response.json())["tokens"]
    chat = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=1, temperature=0)
    assert chat.usage.prompt_tokens == len(chat_ids)
    async with http.post("/detokenize", json={"tokens": chat_ids}) as response:
        assert (await response.json())["prompt"] == tokenizer.decode(chat_ids, skip_special_tokens=False)
    async with http.post("/detokenize", json={"tokens": [5, 100000]}) as response:
        error = (await response.json())["error"]
    assert response.status == 400 and error["param"] == "tokens[1]" and "outside the vocabulary" in error["message"]
    async with http.post("/tokenize", json={"prompt": "a", "messages": []}) as response:
        assert response.status == 400 and "exactly one of prompt" in (await response.json())["error"]["message"]
    without = {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False,
               "chat_template_kwargs": {"enable_thinking": False}}  # a variable this template does not read
    async with http.post("/tokenize", json=without) as response:
        without_ids = (await response.json())["tokens"]
    assert without_ids == tokenizer.encode_chat([{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert len(without_ids) < len(chat_ids) and chat_ids[:len(without_ids)] == without_ids
    continued = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=1, temperature=0,
                                                     extra_body={"add_generation_prompt": False})
    assert continued.usage.prompt_tokens == len(without_ids)


async def test_stop_token_ids_end_the_output_at_the_first_of_them(client):
    def create(**extra):
        return client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=12, temperature=0,
                                         extra_body={"return_token_ids": True, "ignore_eos": True, **extra})
    plain = (await create()).choices[0].model_dump()["token_ids"]
    stop_id = plain[4]
    with pytest.raises(openai.BadRequestError, match=r"stop_token_ids\[1\]: token id 100000 is outside the vocabulary"):
        await create(stop_token_ids=[stop_id, 100000], min_tokens=2)  # it would index the logits (min_tokens)
    unused = next(t for t in range(511, 0, -1) if t not in plain)  # in the vocabulary, never generated here
    stopped = (await create(stop_token_ids=[stop_id, unused])).choices[0]
    assert stopped.model_dump()["token_ids"] == plain[:plain.index(stop_id) + 1]  # the stop token is kept
    assert stopped.finish_reason == "stop"
    first = plain.index(stop_id)
    held = (await create(stop_token_ids=[stop_id], min_tokens=first + 2)).choices[0].model_dump()["token_ids"]
    assert held[:first] == plain[:first] and stop_id not in held[:first + 2]  # vLLM's min_tokens holds it back
    assert len(held) >= first + 2 and (held[-1] == stop_id or len(held) == 12)


async def test_a_frontend_advertises_no_longer_context_than_the_instances_serve(instance, etcd, tiny_model_dir,
                                                                               cluster_name, tmp_path):
    """Without --max-model-len the frontend starts from the model's 1024 tokens, but the only
    instance serves 256 (its etcd record): that is what clients are told and held to."""
    frontend = start_frontend("frontend-ctx", etcd, tiny_model_dir, cluster_name, tmp_path, "--max-model-len", "0")
    try:
        await frontend.wait_healthy(60)
        async with aiohttp.ClientSession(frontend.address) as http:
            async with http.get("/v1/models") as response:
                assert (await response.json())["data"][0]["max_model_len"] == MAX_MODEL_LEN
            async with http.get("/openapi.json") as response:
                schema = await response.json()
            assert f"at most {MAX_MODEL_LEN} tokens" in schema["info"]["description"]
            body = {"model": MODEL, "prompt": [1] * (MAX_MODEL_LEN - 6), "max_tokens": 10}
            async with http.post("/v1/completions", json=body) as response:
                error = (await response.json())["error"]
            assert response.status == 400 and f"maximum context length is {MAX_MODEL_LEN}" in error["message"]
            async with http.post("/v1/completions", json={**body, "max_tokens": 6, "ignore_eos": True}) as response:
                reply = await response.json()
            assert response.status == 200 and reply["usage"]["total_tokens"] == MAX_MODEL_LEN, reply
    finally:
        frontend.stop()


def model_with_generation_config(tiny_model_dir, folder, **fields) -> None:
    """The tiny model in `folder` (links to its files), its generation_config.json given `fields`."""
    folder.mkdir()
    for path in tiny_model_dir.iterdir():
        if path.name != "generation_config.json":
            (folder / path.name).symlink_to(path)
    generation_config = json.loads((tiny_model_dir / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**generation_config, **fields}))


async def test_the_model_folders_generation_config_gives_requests_their_defaults(instance, etcd, tiny_model_dir,
                                                                                 cluster_name, tmp_path):
    """As vLLM: a model whose generation_config.json says temperature 0 and max_new_tokens 5 makes
    an unseeded chat request that sends neither greedy and 5 tokens long; one that sends them gets
    what it sent; completions keep OpenAI's 16 tokens. The frontend logs the defaults it applies."""
    model_with_generation_config(tiny_model_dir, tmp_path / MODEL, temperature=0.0, max_new_tokens=5)
    frontend = start_frontend("frontend-genconf", etcd, tmp_path / MODEL, cluster_name, tmp_path)
    messages = [{"role": "user", "content": "hello there"}]
    extra = {"model": MODEL, "ignore_eos": True, "return_token_ids": True}

    async def ask(http, path, **fields) -> list[int]:
        async with http.post(path, json={**extra, **fields}) as response:
            reply = await response.json()
        assert response.status == 200, reply
        return reply["choices"][0]["token_ids"]

    try:
        await frontend.wait_healthy(60)
        async with aiohttp.ClientSession(frontend.address, timeout=aiohttp.ClientTimeout(total=60)) as http:
            defaulted = await ask(http, "/v1/chat/completions", messages=messages)
            greedy = await ask(http, "/v1/chat/completions", messages=messages, temperature=0, max_tokens=5)
            sampled = await ask(http, "/v1/chat/completions", messages=messages, temperature=1.0, seed=3,
                                max_tokens=8)
            completion = await ask(http, "/v1/completions", prompt=PROMPT_IDS)
        assert len(defaulted) == 5 and defaulted == greedy
        assert len(sampled) == 8 and sampled[:5] != greedy  # the request's own temperature wins
        assert len(completion) == 16
        applied = [line for line in frontend.log_path.read_text().splitlines() if "sampling_defaults_applied" in line]
        assert len(applied) == 1 and "temperature=0.0" in applied[0] and "chat_max_tokens=5" in applied[0], applied
    finally:
        frontend.stop()


async def test_models_health_and_metrics(http, frontend):
    async with http.get("/v1/models") as response:
        assert response.status == 200
        assert [m["id"] for m in (await response.json())["data"]] == [MODEL]
    async with http.get(f"/v1/models/{MODEL}") as response:
        assert response.status == 200 and (await response.json())["id"] == MODEL
    async with http.get("/v1/models/org/other-model") as response:
        error = (await response.json())["error"]
    assert response.status == 404 and (error["code"], error["param"]) == ("model_not_found", "model")
    assert "'org/other-model' does not exist" in error["message"]
    async with aiohttp.ClientSession() as anonymous:  # /health and /metrics need no key
        async with anonymous.get(f"{frontend.address}/health") as response:
            assert response.status == 200 and (await response.json())["num_instances"] == 1
        async with anonymous.get(f"{frontend.address}/metrics") as response:
            text = await response.text()
    assert response.status == 200
    for name in ("ferry_frontend_requests_total", "ferry_frontend_time_to_first_token_seconds",
                 "ferry_frontend_inter_token_latency_seconds", "ferry_frontend_requests_in_flight",
                 "ferry_frontend_dispatch_fallbacks_total"):
        assert name in text, name
    fallbacks = next(line for line in text.splitlines() if line.startswith("ferry_frontend_dispatch_fallbacks_total"))
    assert float(fallbacks.split()[-1]) >= 1  # no manager runs: every dispatch fell back


# ---- bad input -----------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
BAD_REQUESTS = [
    (COMPLETIONS, b'{"model": "tiny-gqa-tied", "prompt": ', "JSON"),
    (COMPLETIONS, b"[1, 2, 3]", "JSON object"),
    (COMPLETIONS, {"model": MODEL}, "prompt"),
    (CHAT, {"model": MODEL}, "messages"),
    (CHAT, {"model": MODEL, "messages": "hi"}, "messages"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, "content"),
    (COMPLETIONS, {"model": MODEL, "prompt": 12}, "prompt"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "stream": "yes"}, "stream"),
    (COMPLETIONS, {"model": MODEL, "prompt": "ok", "stop": ["\ud800"], "max_tokens": 2}, "surrogate"),
    (COMPLETIONS, {"model": MODEL, "prompt": "ok", "stream": True, "cache_salt": "\ud800"}, "surrogate"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "x\udfff"}], "stop": "x"}, "surrogate"),
    (COMPLETIONS, {"model": MODEL, "prompt": "\ud800"}, "surrogate"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),
    (CHAT, {"model": MODEL, "messages": USER, "max_completion_tokens": -1}, "max_completion_tokens"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "temperature": -0.5}, "temperature"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "temperature": 2.5}, "temperature"),
    (CHAT, {"model": MODEL, "messages": USER, "top_p": 0}, "top_p"),
    (CHAT, {"model": MODEL, "messages": USER, "top_p": 1.2}, "top_p"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "n": 17}, "between 1 and 16"),
    (COMPLETIONS, {"model": MODEL, "prompt": [1] * MAX_MODEL_LEN}, "context length"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "word " * 400}]}, "context length"),
    (COMPLETIONS, {"model": MODEL, "prompt": [1, 100000]}, "vocabulary"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "stop": 7}, "stop"),
    (CHAT, {"model": MODEL, "messages": USER, "top_logprobs": 3}, "logprobs"),
]


@pytest.mark.parametrize("path, body, word", BAD_REQUESTS)
async def test_bad_input_is_400_naming_the_problem(http, path, body, word):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with http.post(path, data=data, headers={"Content-Type": "application/json"}) as response:
        payload = await response.json()
    assert response.status == 400, payload
    error = payload["error"]
    assert error["type"] == "invalid_request_error" and word in error["message"], error
    assert set(error) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
async def test_an_unknown_model_is_404_model_not_found(http, path):
    body = {"model": "gpt-4", "prompt": "x", "messages": USER}
    body.pop("messages" if path == COMPLETIONS else "prompt")
    async with http.post(path, json=body) as response:
        error = (await response.json())["error"]
    assert response.status == 404 and (error["code"], error["param"]) == ("model_not_found", "model")
    assert "'gpt-4' does not exist" in error["message"]


async def test_bad_input_through_the_openai_client(client):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        await client.chat.completions.create(model=MODEL, messages=USER, temperature=3)


async def test_oversized_body_is_413(http):
    body = json.dumps({"model": MODEL, "prompt": "x" * 70_000}).encode()
    async with http.post(COMPLETIONS, data=body, headers={"Content-Type": "application/json"}) as response:
        assert response.status == 413
        assert "--max-body-bytes" in (await response.json())["error"]["message"]


async def test_unknown_path_and_wrong_method_are_openai_errors_with_string_codes(http):
    async with http.get("/v1/nope") as response:
        assert response.status == 404
        assert (await response.json())["error"] == {"message": "Not Found: GET /v1/nope", "code": "not_found",
                                                    "type": "invalid_request_error", "param": None}
    async with http.get("/v1/completions") as response:
        assert response.status == 405 and response.headers["Allow"] == "POST"
        assert (await response.json())["error"]["code"] == "method_not_allowed"


# ---- API keys ------------------------------------------------------------------------------


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEYS[0]}"}])
async def test_missing_or_wrong_api_key_is_401(frontend, headers):
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{frontend.address}{COMPLETIONS}", json={"model": MODEL, "prompt": "x"},
                                headers=headers) as response:
            payload = await response.json()
    assert response.status == 401
    assert payload["error"]["code"] == "invalid_api_key" and "Authorization: Bearer" in payload["error"]["message"]


async def test_every_configured_key_works(frontend):
    for key in KEYS:
        async with openai.AsyncOpenAI(base_url=f"{frontend.address}/v1", api_key=key, max_retries=0) as client:
            assert [m.id async for m in client.models.list()] == [MODEL]
            assert (await client.models.retrieve(MODEL)).id == MODEL


# ---- CORS ----------------------------------------------------------------------------------


async def test_a_browser_page_on_an_allowed_origin_may_call_the_api(frontend):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    async with aiohttp.ClientSession(base_url=frontend.address) as session:
        async with session.options(COMPLETIONS, headers=preflight) as response:  # no API key: browsers send none
            assert response.status == 204
            assert response.headers["Access-Control-Allow-Origin"] == ORIGIN
            assert "POST" in response.headers["Access-Control-Allow-Methods"]
            assert response.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": True}
        async with session.post(COMPLETIONS, json=body, headers={
                "Origin": ORIGIN, "Authorization": f"Bearer {KEYS[0]}"}) as response:
            assert response.status == 200 and (await response.text()).endswith("data: [DONE]\n\n")
            assert response.headers["Access-Control-Allow-Origin"] == ORIGIN
            assert response.headers["Access-Control-Expose-Headers"] == "x-request-id, retry-after, x-ferry-ignored-fields"
        async with session.post(COMPLETIONS, json=body, headers={"Origin": ORIGIN}) as response:
            assert response.status == 401  # the page can read why
            assert response.headers["Access-Control-Allow-Origin"] == ORIGIN


async def test_other_origins_get_no_cors_headers(frontend):
    async with aiohttp.ClientSession(base_url=frontend.address) as session:
        async with session.options(COMPLETIONS, headers={"Origin": "https://evil.example",
                                                         "Access-Control-Request-Method": "POST"}) as response:
            assert response.status != 204 and "Access-Control-Allow-Origin" not in response.headers
        async with session.get("/v1/models", headers={"Origin": "https://evil.example",
                                                      "Authorization": f"Bearer {KEYS[0]}"}) as response:
            assert response.status == 200 and "Access-Control-Allow-Origin" not in response.headers


# ---- a client that goes away ----------------------------------------------------------------


async def free_blocks(stub) -> tuple[int, int]:
    status = await stub.GetStatus(instance_pb2.GetStatusRequest(), timeout=5)
    return status.load.num_free_blocks, status.load.num_running + status.load.num_waiting


@pytest.fixture(scope="module")
def slow_cluster(etcd, tiny_model_dir, tmp_path_factory):
    """A sim-engine instance at 50 ms a step and a frontend over it: its requests outlast a test
    process that a busy machine starves (the tiny model's 200 tokens took 187 ms)."""
    name, log_dir, port = f"fe-slow-{uuid.uuid4().hex[:8]}", tmp_path_factory.mktemp("logs"), free_port()
    instance = ServiceProcess(
        "instance-slow", "instance",
        ["--model", str(tiny_model_dir), "--port", str(port), "--instance-id", "slow-0", "--num-threads", "1",
         "--etcd-endpoints", etcd.endpoint, "--cluster", name, "--lease-ttl-s", "3", "--engine", "sim",
         "--sim-step-ms", "50", "--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE),
         "--max-model-len", str(MAX_MODEL_LEN)],
        f"127.0.0.1:{port}", log_dir).start()
    frontend = None
    try:
        asyncio.run(instance.wait_healthy(90))
        frontend = start_frontend("frontend-slow", etcd, tiny_model_dir, name, log_dir)
        asyncio.run(frontend.wait_healthy(60))
        yield instance, frontend, name
    finally:
        if frontend is not None:
            frontend.stop()
        instance.stop()


async def test_client_disconnect_aborts_the_request_on_the_instance(slow_cluster):
    instance, frontend, _ = slow_cluster
    async with grpc.aio.insecure_channel(instance.address) as channel, aiohttp.ClientSession(
            base_url=frontend.address, timeout=aiohttp.ClientTimeout(total=60)) as http:
        instance_stub = instance_pb2_grpc.InstanceServiceStub(channel)
        baseline, _ = await free_blocks(instance_stub)
        body = {"model": MODEL, "prompt": PROMPT_IDS, "max_tokens": 200, "temperature": 0, "stream": True,
                "ignore_eos": True}  # 10 s at 50 ms a step
        response = await http.post(COMPLETIONS, json=body)
        assert response.status == 200
        for _ in range(3):  # a few chunks: the request is running on the instance
            await response.content.readline()
        free, active = await free_blocks(instance_stub)
        assert active == 1 and free < baseline
        response.close()  # the client goes away mid-stream
        for _ in range(50):  # well before the request would have ended by itself
            free, active = await free_blocks(instance_stub)
            if free == baseline and active == 0:
                break
            await asyncio.sleep(0.1)
        assert (free, active) == (baseline, 0)


async def read_sse(response: aiohttp.ClientResponse) -> list[str]:
    return [line.decode().strip() async for line in response.content if line.strip()]


@pytest.mark.timeout(60)
async def test_sigterm_lets_short_requests_finish_and_ends_long_ones_with_an_error_clients_can_read(
        slow_cluster, etcd, tiny_model_dir, tmp_path):
    instance, _, name = slow_cluster
    grace_s = 1.5
    frontend = start_frontend("frontend-sigterm", etcd, tiny_model_dir, name, tmp_path, "--shutdown-grace-s", str(grace_s))
    try:
        await frontend.wait_healthy(60)
        async with grpc.aio.insecure_channel(instance.address) as channel, aiohttp.ClientSession(
                base_url=frontend.address, timeout=aiohttp.ClientTimeout(total=30)) as http:
            instance_stub = instance_pb2_grpc.InstanceServiceStub(channel)
            baseline, _ = await free_blocks(instance_stub)
            long = {"model": MODEL, "prompt": PROMPT_IDS, "max_tokens": 200, "ignore_eos": True}  # 10 s at 50 ms a step
            streaming = await http.post(COMPLETIONS, json={**long, "stream": True})
            await streaming.content.readline()  # it runs
            waiting = asyncio.ensure_future(http.post(COMPLETIONS, json=long))
            short = asyncio.ensure_future(http.post(COMPLETIONS, json={**long, "max_tokens": 5}))  # 0.25 s
            await asyncio.sleep(0.2)
            sent_at = asyncio.get_running_loop().time()
            frontend.signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            async with http.post(COMPLETIONS, json=long) as refused:  # during the grace: refused, not queued
                assert refused.status == 503 and "shutting down" in (await refused.json())["error"]["message"]
            async with http.get("/health") as health:  # a load balancer takes it out
                assert health.status == 503 and health.headers["Retry-After"] == "1"
                assert (await health.json())["status"] == "stopping"

            events = await read_sse(streaming)
            error = json.loads(events[-2].removeprefix("data: "))["error"]
            assert error["type"] == "server_error" and "shutting down" in error["message"], error
            assert events[-1] == "data: [DONE]" and len(events) > 3  # tokens came before the error
            async with await waiting as cut:
                assert cut.status == 503 and "--shutdown-grace-s" in (await cut.json())["error"]["message"]
            async with await short as finished:
                assert finished.status == 200 and (await finished.json())["choices"][0]["finish_reason"] == "length"
            assert await asyncio.to_thread(frontend.popen.wait, 10) == 0
            assert asyncio.get_running_loop().time() - sent_at < grace_s + 3  # not killed after twice its grace
            for _ in range(50):  # the cut requests were aborted on the instance
                free, active = await free_blocks(instance_stub)
                if (free, active) == (baseline, 0):
                    break
                await asyncio.sleep(0.1)
            assert (free, active) == (baseline, 0)
    finally:
        frontend.stop()


# ---- limits and an empty cluster --------------------------------------------------------------


async def test_inflight_limit_and_empty_cluster(instance, etcd, tiny_model_dir, cluster_name, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("logs")
    limited = start_frontend("frontend-limited", etcd, tiny_model_dir, cluster_name, log_dir, "--max-inflight", "1")
    empty = start_frontend("frontend-empty", etcd, tiny_model_dir, f"empty-{cluster_name}", log_dir)
    try:
        await limited.wait_healthy(60)
        async with aiohttp.ClientSession(base_url=limited.address) as session:
            # as long as the context allows: still in flight when the second request comes, however busy the machine
            body = {"model": MODEL, "prompt": PROMPT_IDS, "max_tokens": MAX_MODEL_LEN - len(PROMPT_IDS),
                    "stream": True, "ignore_eos": True}
            async with session.post(COMPLETIONS, json=body) as streaming:
                await streaming.content.readline()
                async with session.post(COMPLETIONS, json={**body, "stream": False}) as second:
                    assert second.status == 429 and second.headers["Retry-After"] == "1"
                    assert "over the limit of 1 (--max-inflight)" in (await second.json())["error"]["message"]
        await asyncio.wait_for(_wait_listening(empty.address), 60)
        async with aiohttp.ClientSession(base_url=empty.address) as session:
            async with session.get("/health") as health:
                assert health.status == 503 and (await health.json())["num_instances"] == 0
                assert (await health.json())["num_registered"] == 0
            async with session.post(COMPLETIONS, json={"model": MODEL, "prompt": "x"}) as response:
                assert response.status == 503 and response.headers["Retry-After"] == "1"
                assert "no serving instance" in (await response.json())["error"]["message"]
    finally:
        limited.stop()
        empty.stop()


async def _wait_listening(base_url: str) -> None:
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                async with session.get(f"{base_url}/health"):
                    return
            except aiohttp.ClientConnectionError:
                await asyncio.sleep(0.2)


@pytest.mark.timeout(90)
async def test_during_the_shutdown_grace_the_frontend_still_sees_instances_come_and_go(
        slow_cluster, etcd, tiny_model_dir, tmp_path):
    """Requests resumed during the grace dispatch from the frontend's view of instances/. Before, SIGTERM closed
    the etcd registry, watches included, so that view froze: an instance that joined then was never seen (and
    one that left was still tried). /health reads the same view."""
    _, _, name = slow_cluster
    frontend = start_frontend("frontend-grace-view", etcd, tiny_model_dir, name, tmp_path, "--shutdown-grace-s", "30")
    try:
        await frontend.wait_healthy(60)
        async with aiohttp.ClientSession(base_url=frontend.address, timeout=aiohttp.ClientTimeout(total=30)) as http, \
                Registry([etcd.endpoint], name) as joiner:
            body = {"model": MODEL, "prompt": PROMPT_IDS, "max_tokens": 200, "ignore_eos": True, "stream": True}
            streaming = await http.post(COMPLETIONS, json=body)  # 10 s at 50 ms a step: the grace lasts
            await streaming.content.readline()
            frontend.signal(signal.SIGTERM)
            assert (await _health_when(http, lambda h: h["status"] == "stopping"))["num_registered"] == 1
            await joiner.register("instances", "joined-in-grace", {"address": "127.0.0.1:1", "state": "serving"})
            assert (await _health_when(http, lambda h: h["num_registered"] == 2))["num_registered"] == 2
            await joiner.unregister("instances", "joined-in-grace")
            assert (await _health_when(http, lambda h: h["num_registered"] == 1))["num_registered"] == 1
            streaming.close()  # the grace ends with the last request
        assert await asyncio.to_thread(frontend.popen.wait, 10) == 0
    finally:
        frontend.stop()


async def _health_when(http: aiohttp.ClientSession, condition, timeout_s: float = 5.0) -> dict:
    """The frontend's /health body once `condition` holds of it, or the last one after `timeout_s`."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        async with http.get("/health") as reply:
            health = await reply.json()
        if condition(health) or asyncio.get_running_loop().time() > deadline:
            return health
        await asyncio.sleep(0.1)
