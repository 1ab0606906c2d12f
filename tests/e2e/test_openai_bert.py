"""A real text encoder behind OpenAI's route: a ``transformers`` BertModel (random
weights, a WordPiece vocabulary and ``BertTokenizerFast`` written by the test, saved
with ``save_pretrained``) served as it is, fed texts of mixed lengths at once by the
``openai`` client and LangChain: every vector equal to the model run in-process on the
same tokens, mean-pooled and normalized, within 1e-4."""

from __future__ import annotations

import asyncio
import json
import shutil
import warnings
from typing import Any, Iterator

import numpy as np
import pytest

from tests import bert
from tests.conftest import Server, short_tmpdir

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
pytestmark = pytest.mark.timeout(300)

LENGTHS = (3, 7, 12, 30, 5, 61, 18, 9, 44, 3)


def text(n: int) -> str:
    """A text of n tokens ([CLS] and [SEP] included) in bert.vocabulary's words."""
    return " ".join(f"w{(i * 37) % 800}" for i in range(n - 2))


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Server, Any, Any]]:
    repo = short_tmpdir("zsoaib")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = bert.save_pretrained(repo / "bert" / "1")
    (repo / "bert" / "config.json").write_text(json.dumps(
        {"platform": "transformers", "text": {"task": "embeddings"},
         "dynamic_batching": {"max_batch_tokens": 512, "max_queue_delay_ms": 5}}))
    tok = transformers.BertTokenizerFast.from_pretrained(str(repo / "bert" / "1"))
    srv = Server(repo).wait_ready(180)
    yield srv, module, tok
    srv.stop()
    shutil.rmtree(repo, ignore_errors=True)


def expected(module: Any, tok: Any, texts: list[str]) -> list[np.ndarray]:
    return [bert.embedding(module, np.array([tok(t)["input_ids"]]))[0] for t in texts]


def test_mixed_lengths_at_once_equal_the_model_in_process(served: tuple[Server, Any, Any]
                                                          ) -> None:
    srv, module, tok = served
    texts = [text(n) for n in LENGTHS]
    assert [len(tok(t)["input_ids"]) for t in texts] == list(LENGTHS)
    want = expected(module, tok, texts)

    async def run() -> list[Any]:
        client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused",
                                    max_retries=0)
        try:
            # one request of every length, and every length as a request of its own,
            # all at once: rows of different requests share padded batches
            return await asyncio.gather(
                client.embeddings.create(model="bert", input=texts),
                *(client.embeddings.create(model="bert", input=t, encoding_format="float")
                  for t in texts))
        finally:
            await client.close()

    whole, *singles = asyncio.run(run())
    for got, w in zip(whole.data, want):
        np.testing.assert_allclose(got.embedding, w, atol=1e-4)
    for got, w in zip(singles, want):
        np.testing.assert_allclose(got.data[0].embedding, w, atol=1e-4)
    assert whole.usage.prompt_tokens == sum(LENGTHS)
    ids = [tok(t)["input_ids"] for t in texts[:3]]
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="unused") as client:
        by_ids = client.embeddings.create(model="bert", input=ids, encoding_format="float")
    for got, w in zip(by_ids.data, want):
        np.testing.assert_allclose(got.embedding, w, atol=1e-4)


def test_langchain_against_the_bert(served: tuple[Server, Any, Any]) -> None:
    srv, module, tok = served
    lc = pytest.importorskip("langchain_openai")
    emb = lc.OpenAIEmbeddings(model="bert", base_url=srv.url + "/v1", api_key="unused",
                              check_embedding_ctx_length=False)
    texts = [text(4), text(40), text(11)]
    for got, w in zip(emb.embed_documents(texts), expected(module, tok, texts)):
        np.testing.assert_allclose(got, w, atol=1e-4)
    np.testing.assert_allclose(emb.embed_query(texts[1]), expected(module, tok, texts[1:2])[0],
                               atol=1e-4)
