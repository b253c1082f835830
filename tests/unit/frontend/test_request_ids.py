"""A client's X-Request-Id (or vLLM's body `request_id`) names ferry's request id, which stays unique."""

from __future__ import annotations

import re

import pytest
from multidict import CIMultiDict

from services.frontend.request_error import RequestError
from services.frontend.request_ids import client_request_id, new_request_id

pytestmark = pytest.mark.timeout(10)


def test_without_a_client_id_the_id_is_the_prefix_and_32_hex():
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", new_request_id("cmpl", None))


def test_a_client_id_is_kept_whole_with_a_random_tail():
    first, second = new_request_id("chatcmpl", "trace/42=ab"), new_request_id("chatcmpl", "trace/42=ab")
    assert re.fullmatch(r"chatcmpl-trace/42=ab-[0-9a-f]{12}", first)
    assert first != second  # a retry under the same client id is another request


def test_the_header_wins_over_the_body_and_is_matched_without_case():
    headers = CIMultiDict({"X-Request-ID": "from-header"})
    assert client_request_id(headers, {"request_id": "from-body"}) == "from-header"
    assert client_request_id(CIMultiDict(), {"request_id": "from-body"}) == "from-body"
    assert client_request_id(CIMultiDict({"X-Request-Id": ""}), {"request_id": "from-body"}) == "from-body"
    assert client_request_id(CIMultiDict(), {}) is None
    assert client_request_id(CIMultiDict(), {"request_id": None}) is None
    assert client_request_id(CIMultiDict(), {"request_id": ""}) is None


@pytest.mark.parametrize("given, kept", [
    ("has space", "has_space"), ("é-\r\n", "_-__"), ("tab\there", "tab_here"), ("x" * 200, "x" * 128),
])
def test_an_id_is_made_of_visible_ascii_and_cut_to_128_characters_rather_than_refused(given, kept):
    """A proxy's ids must never turn traffic into 400s (a review: Heroku's are up to 200 characters);
    what travels as gRPC metadata and in log lines is visible ASCII."""
    assert client_request_id(CIMultiDict({"x-request-id": given}), {}) == kept
    assert client_request_id(CIMultiDict(), {"request_id": given}) == kept


@pytest.mark.parametrize("bad", [7, ["x"], {"a": 1}])
def test_a_body_request_id_that_is_not_a_string_is_a_400_naming_it(bad):
    with pytest.raises(RequestError, match="^request_id: must be a string") as caught:
        client_request_id(CIMultiDict(), {"request_id": bad})
    assert caught.value.param == "request_id" and caught.value.http_status == 400
