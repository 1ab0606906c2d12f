"""A save_pretrained GPT-2 (random weights, a byte-level BPE tokenizer made by the test,
a chat template) behind OpenAI's completions and chat: 16, then 64, concurrent requests
of mixed prompt lengths from the `openai` client, streamed and not, each answer the text of
``model.generate(do_sample=False)`` in-process (a near-tie in float32, top two logits
within 1e-4, may flip a token, and is named)."""

from __future__ import annotations

import json
import random
import shutil
from typing import Any, Iterator

import pytest

from tests.conftest import Server, short_tmpdir
from tests.lm import check, complete_all, prompt_ids, write_lm

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(400)

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Server, Any, Any]]:
    repo = short_tmpdir("zsoail")
    folder, tokenizer = write_lm(repo, most=8)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    config = json.loads((repo / "lm" / "config.json").read_text())
    config["text"] = {"task": "generate", "max_length": 512}
    (repo / "lm" / "config.json").write_text(json.dumps(config))
    # the same model again, taking the sampling settings
    shutil.copytree(repo / "lm", repo / "lms")
    config = {**config, "name": "lms", "inputs": config["inputs"] + [
        {"name": "temperature", "datatype": "FP32", "shape": [1]},
        {"name": "top_p", "datatype": "FP32", "shape": [1]},
        {"name": "seed", "datatype": "INT64", "shape": [1]}]}
    (repo / "lms" / "config.json").write_text(json.dumps(config))
    srv = Server(repo, workers=1).wait_ready(180)
    yield srv, folder, tokenizer
    srv.stop()
    shutil.rmtree(repo, ignore_errors=True)


def test_concurrent_completions_equal_generate(served: tuple[Server, Any, Any]) -> None:
    srv, folder, tokenizer = served
    rng = random.Random(7)
    plan = [(rng.randint(4, 200), rng.randint(1, 40)) for _ in range(16)]
    prompts = [prompt_ids(tokenizer, i, n) for i, (n, _) in enumerate(plan)]

    notes: list[str] = []
    got = complete_all(srv.url, "lm", prompts, [m for _, m in plan])
    for ids, (_, m), (text, finish) in zip(prompts, plan, got):
        check(folder, tokenizer, ids, m, text, notes)
        assert finish in ("length", "stop")
    assert len(notes) <= 2, notes


def test_64_concurrent_greedy_completions_equal_generate(
        served: tuple[Server, Any, Any]) -> None:
    """The issue's 64 concurrent requests, prompts of 4-200 tokens, max_tokens 1-128: most
    short, a few long (the ends of both ranges among them), so that it stays short on a
    shared 2-core host while long streams run beside many joining and leaving."""
    srv, folder, tokenizer = served
    rng = random.Random(64)
    lengths = [4, 200] + [rng.randint(4, 200) for _ in range(62)]
    most = [1, 128] + [rng.randint(64, 128) for _ in range(6)] + \
        [rng.randint(1, 16) for _ in range(56)]
    rng.shuffle(most)
    prompts = [prompt_ids(tokenizer, i, n) for i, n in enumerate(lengths)]

    notes: list[str] = []
    for ids, m, (text, _) in zip(prompts, most, complete_all(srv.url, "lm", prompts, most)):
        check(folder, tokenizer, ids, m, text, notes)
    assert len(notes) <= 4, notes


def test_chat_streamed_is_the_template_and_generate(served: tuple[Server, Any, Any]) -> None:
    srv, folder, tokenizer = served
    messages = [{"role": "system", "content": "kato rine"},
                {"role": "user", "content": "musa lope dife"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             chat_template=TEMPLATE, tokenize=False)
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0) as c:
        stream = c.chat.completions.create(model="lm", messages=messages, max_tokens=24,
                                           stream=True,
                                           stream_options={"include_usage": True})
        chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert chunks[-1].usage.prompt_tokens == len(ids)
    notes: list[str] = []
    check(folder, tokenizer, ids, 24, text, notes)
    assert len(notes) <= 1, notes


def test_sampling_where_the_model_takes_it(served: tuple[Server, Any, Any]) -> None:
    srv, folder, tokenizer = served
    ids = prompt_ids(tokenizer, 3, 20)
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0) as c:
        def sample(seed: int | None, temperature: float | None = 1.2) -> str:
            got = c.completions.create(model="lms", prompt=ids, max_tokens=24, seed=seed,
                                       temperature=temperature, top_p=0.9)
            return str(got.choices[0].text)
        first = sample(seed=11)
        assert sample(seed=11) == first               # a seeded request repeats
        assert len({sample(seed=s) for s in (12, 13, 14)} | {first}) > 1   # and samples
        greedy_text = sample(seed=None, temperature=0.0)
        notes: list[str] = []
        check(folder, tokenizer, ids, 24, greedy_text, notes)   # temperature 0: greedy
        assert len(notes) <= 1, notes
        with pytest.raises(openai.BadRequestError) as err:   # a greedy model refuses it
            c.completions.create(model="lm", prompt=ids, max_tokens=4, temperature=0.8)
        assert err.value.body["param"] == "temperature"
