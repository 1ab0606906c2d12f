"""OpenAI's embeddings and completions with tenants and the response cache: a tenant's
tokens per minute answered 429 of type ``tokens`` with Retry-After, counting a
completion's generated tokens as well as its prompt's; a request of many texts counted
once against its request rate, and repeated texts computed once."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from tests import text as tx
from tests.conftest import Server, http, short_tmpdir
from zeroserve.broker.server.tenants import new_key

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def world() -> Iterator[tuple[Server, str, str]]:
    repo = short_tmpdir("zsoaiq")
    folder = tx.write_embedder(repo)
    tx.write_generator(repo, "gen")
    cfg = (repo / "emb" / "config.json")
    cfg.write_text(cfg.read_text()[:-1] + ', "response_cache": {"enable": true}}')
    key, hashed = new_key()
    gen_key, gen_hashed = new_key()
    tenants = Path(str(repo) + "-tenants.toml")
    # 2 requests a second (3 at once), so that one request of many texts is visibly counted once;
    # 300 tokens a minute, so that a few texts use it up
    tenants.write_text(f'[tenants.t]\nkeys = ["{hashed}"]\nrate = 2\nburst = 3\n'
                       f'tokens_per_minute = 300\n'
                       # half a token a second: one completion of 60 spends more than all
                       f'[tenants.g]\nkeys = ["{gen_hashed}"]\ntokens_per_minute = 30\n')
    assert folder.exists()
    srv = Server(repo, extra=["--tenants", str(tenants), "--response-cache-bytes",
                              str(1 << 20)]).wait_ready()
    yield srv, key, gen_key
    srv.stop()
    shutil.rmtree(repo, ignore_errors=True)
    tenants.unlink()


def hits(srv: Server) -> float:
    _, _, raw = http("GET", srv.url + "/metrics")
    found = re.search(r'^zeroserve_cache_hits_total\{[^}]*model="emb"[^}]*\} (\S+)$',
                      raw.decode(), re.M)
    return float(found.group(1)) if found else 0.0


def test_tokens_per_minute_and_one_request_of_many_texts(world: tuple[Server, str, str]
                                                          ) -> None:
    srv, key, _ = world
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0)
    request = client.embeddings.create
    with client:
        check_quotas(srv, request)


def check_quotas(srv: Server, create: Any) -> None:
    # 20 texts of 5 tokens: one request against a rate of 2 a second, 100 tokens
    texts = [tx.text(5 + i % 2) for i in range(20)]
    got = create(model="emb", input=texts, encoding_format="float")
    assert len(got.data) == 20 and got.usage.prompt_tokens == 110
    # the two distinct texts were computed once each: the rest are their copies
    assert all(np.array_equal(got.data[i].embedding, got.data[i % 2].embedding)
               for i in range(20))
    before = hits(srv)
    again = create(model="emb", input=texts[:2], encoding_format="float")
    assert hits(srv) == before + 2   # across requests, the response cache answers
    np.testing.assert_allclose(again.data[1].embedding, got.data[1].embedding)
    with pytest.raises(openai.RateLimitError) as err:
        create(model="emb", input=[tx.text(n) for n in range(60, 65)])   # 310 tokens
    body = err.value.body
    assert body["type"] == "tokens" and "tokens per minute" in body["message"]
    assert int(err.value.response.headers["retry-after"]) >= 1


def test_a_completions_generated_tokens_count_against_tokens_per_minute(
        world: tuple[Server, str, str]) -> None:
    srv, _, key = world
    with openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0) as client:
        done = client.completions.create(model="gen", prompt="w1", max_tokens=60)
        assert done.usage.prompt_tokens == 1 and done.usage.completion_tokens == 60
        # the prompt's one token was charged at admission, the 60 as they came: 31 over
        # the 30 a minute, so even a prompt of one token waits about a minute
        with pytest.raises(openai.RateLimitError) as err:
            client.completions.create(model="gen", prompt="w1", max_tokens=1)
    body = err.value.body
    assert body["type"] == "tokens" and "prompt and completion tokens" in body["message"]
    assert int(err.value.response.headers["retry-after"]) >= 30


def test_no_key_is_401_in_openais_shape(world: tuple[Server, str, str]) -> None:
    srv, _, _ = world
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="not-a-key", max_retries=0) as c, \
            pytest.raises(openai.AuthenticationError) as err:
        c.embeddings.create(model="emb", input="w1")
    assert err.value.body["code"] == "invalid_api_key"
