"""Which header carries the caller's API key."""

from starlette.datastructures import Headers

from zeroserve.gateway.apikey import api_key_of


def test_bearer_then_x_api_key() -> None:
    assert api_key_of(Headers({"Authorization": "Bearer  k1 "})) == "k1"
    assert api_key_of(Headers({"authorization": "bearer k1", "x-api-key": "k2"})) == "k1"
    assert api_key_of(Headers({"Authorization": "Basic abc", "X-API-Key": "k2"})) == "k2"
    assert api_key_of(Headers({"Authorization": "Bearer "})) == ""
    assert api_key_of(Headers({})) == ""
