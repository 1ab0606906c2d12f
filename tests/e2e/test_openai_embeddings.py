"""OpenAI's embeddings route, through a real server, driven by the `openai` client
unchanged (float and its default base64), raw JSON, and LangChain's OpenAIEmbeddings:
every vector equal to the model computed in-process on the same tokens."""

from __future__ import annotations

import json
import shutil
from typing import Any, Iterator

import numpy as np
import pytest

from tests import text as tx
from tests.conftest import Server, http, short_tmpdir

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    repo = short_tmpdir("zsoai")
    tx.write_embedder(repo, batching={"max_batch_tokens": 256})
    tx.write_embedder(repo, "cut", text_section={"truncate": True, "max_length": 8,
                                                 "matryoshka": True})
    srv = Server(repo, extra=["--max-body-bytes", "200000"]).wait_ready()
    yield srv
    srv.stop()
    shutil.rmtree(repo, ignore_errors=True)


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[Any]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def ids_of(texts: list[str]) -> list[list[int]]:
    from tokenizers import Tokenizer
    folder = short_tmpdir("zstok")
    try:
        tok = Tokenizer.from_file(str(tx.write_tokenizer(folder)))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return [e.ids for e in tok.encode_batch(texts)]


def test_a_list_of_texts_of_mixed_lengths_in_order(client: Any) -> None:
    texts = [tx.text(n) for n in (3, 40, 9, 64, 17, 3, 33)]
    got = client.embeddings.create(model="emb", input=texts)   # base64, the client's default
    assert [d.index for d in got.data] == list(range(len(texts)))
    for d, ids in zip(got.data, ids_of(texts)):
        np.testing.assert_allclose(d.embedding, tx.reference(ids), atol=1e-4)
    assert got.usage.prompt_tokens == got.usage.total_tokens == sum(
        len(i) for i in ids_of(texts))
    assert got.model == "emb"


def test_floats_a_string_and_token_ids(client: Any) -> None:
    one = client.embeddings.create(model="emb", input=tx.text(12), encoding_format="float")
    (ids,) = ids_of([tx.text(12)])
    np.testing.assert_allclose(one.data[0].embedding, tx.reference(ids), atol=1e-4)
    rows = [[2, 7, 9, 3], [2, 11, 3]]
    got = client.embeddings.create(model="emb", input=rows, encoding_format="float")
    for d, row in zip(got.data, rows):
        np.testing.assert_allclose(d.embedding, tx.reference(row), atol=1e-4)
    single = client.embeddings.create(model="emb", input=[2, 7, 9, 3])
    np.testing.assert_allclose(single.data[0].embedding, tx.reference([2, 7, 9, 3]), atol=1e-4)


def test_dimensions_cut_and_normalized_where_the_model_allows(client: Any) -> None:
    got = client.embeddings.create(model="cut", input=tx.text(6), dimensions=4,
                                   encoding_format="float")
    (ids,) = ids_of([tx.text(6)])
    full = tx.reference(ids)[:4]
    np.testing.assert_allclose(got.data[0].embedding, full / np.linalg.norm(full), atol=1e-4)
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model="emb", input="w1", dimensions=4)
    assert err.value.body["param"] == "dimensions"


def test_an_over_long_text_is_refused_or_cut_as_the_model_says(client: Any) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model="emb", input=["w1", tx.text(80)])
    assert "input[1] has 80 tokens" in err.value.body["message"]
    assert err.value.body["code"] == "context_length_exceeded"
    got = client.embeddings.create(model="cut", input=tx.text(80), encoding_format="float")
    (ids,) = ids_of([tx.text(80)])
    cut = ids[:7] + [3]   # the tokenizer keeps [SEP] at the end of what it cuts
    np.testing.assert_allclose(got.data[0].embedding, tx.reference(cut), atol=1e-4)
    assert got.usage.prompt_tokens == 8


@pytest.mark.parametrize("body,param,words", [
    ({"model": "emb", "input": ""}, "input", "input[0] is an empty string"),
    ({"model": "emb", "input": ["w1", ""]}, "input", "input[1] is an empty string"),
    ({"model": "emb", "input": []}, "input", "non-empty"),
    ({"model": "emb", "input": [[]]}, "input", "input[0] is an empty list"),
    ({"model": "emb", "input": ["w1"] * 2049}, "input", "2049 items"),
    ({"model": "emb", "input": [[2, 99999]]}, "input", "outside the model's vocabulary"),
    ({"model": "emb", "input": "w1", "encoding_format": "hex"}, "encoding_format", "hex"),
    ({"input": "w1"}, "model", "'model' is required"),
])
def test_bad_inputs_are_400s_in_openais_shape(server: Server, body: dict[str, Any],
                                              param: str, words: str) -> None:
    status, _, raw = http("POST", server.url + "/v1/embeddings", json.dumps(body).encode(),
                          {"Content-Type": "application/json"})
    assert status == 400, raw
    err = json.loads(raw)["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert words in err["message"]


def test_an_unknown_model_is_404_and_the_server_keeps_serving(client: Any) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.embeddings.create(model="nope", input="w1")
    assert err.value.body["code"] == "model_not_found"
    assert client.embeddings.create(model="emb", input="w1").data


def test_a_body_over_the_limit_is_413(server: Server) -> None:
    body = json.dumps({"model": "emb", "input": ["w1 " * 1000] * 100}).encode()
    status, _, raw = http("POST", server.url + "/v1/embeddings", body)
    assert status == 413 and json.loads(raw)["error"]["type"] == "invalid_request_error"


def test_models_list_in_openais_shape_and_the_registrations(client: Any, server: Server
                                                            ) -> None:
    ids = {m.id for m in client.models.list()}
    assert {"emb", "cut"} <= ids
    status, _, raw = http("GET", server.url + "/v1/models")
    doc = json.loads(raw)
    assert status == 200 and {m["name"] for m in doc["models"]} >= {"emb", "cut"}
    assert client.models.retrieve("emb").id == "emb"
    status, _, raw = http("GET", server.url + "/openai/v1/models")
    assert status == 200 and json.loads(raw)["object"] == "list"


def test_langchain_embeds_documents_and_a_query(server: Server) -> None:
    lc = pytest.importorskip("langchain_openai")
    # check_embedding_ctx_length=False: LangChain would otherwise count tokens with
    # tiktoken's OpenAI vocabulary (a download) and send those ids, not the texts
    emb = lc.OpenAIEmbeddings(model="emb", base_url=server.url + "/v1", api_key="unused",
                              check_embedding_ctx_length=False)
    texts = [tx.text(5), tx.text(30)]
    docs = emb.embed_documents(texts)
    for vec, ids in zip(docs, ids_of(texts)):
        np.testing.assert_allclose(vec, tx.reference(ids), atol=1e-4)
    np.testing.assert_allclose(emb.embed_query(tx.text(5)), docs[0], atol=1e-6)


def test_a_thousand_texts_answered_once_in_order(client: Any, server: Server) -> None:
    texts = [tx.distinct(i, 3 + i % 50) for i in range(1000)]
    got = client.embeddings.create(model="emb", input=texts, encoding_format="float")
    assert len(got.data) == 1000
    refs = ids_of(texts)
    for i in (0, 1, 499, 998, 999):
        np.testing.assert_allclose(got.data[i].embedding, tx.reference(refs[i]), atol=1e-4)
    _, _, raw = http("GET", server.url + "/metrics")
    assert b"zeroserve_batch_padding_ratio_bucket" in raw


def test_a_reply_names_the_tokens_its_batch_computed(server: Server) -> None:
    from zeroserve.broker.client import Client
    ids = np.array([[2, 7, 9, 11, 3]], np.int64)
    with Client(server.frontend, timeout_s=30) as c:
        out = c.infer("emb", {"input_ids": ids, "attention_mask": np.ones_like(ids)})
    assert out.stats["batch_tokens"] >= 5 and out.stats["batch_size"] >= 1
    np.testing.assert_allclose(out.outputs["embedding"][0], tx.reference(list(ids[0])),
                               atol=1e-4)
