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
    assert re.fullmatch(r"chatcmpl-trace/42=ab-[0-9a-f]{8}", first)
    assert first != second  # a retry under the same client id is another request


def test_the_header_wins_over_the_body_and_is_matched_without_case():
    headers = CIMultiDict({"X-Request-ID": "from-header"})
    assert client_request_id(headers, {"request_id": "from-body"}) == "from-header"
    assert client_request_id(CIMultiDict(), {"request_id": "from-body"}) == "from-body"
    assert client_request_id(CIMultiDict(), {}) is None
    assert client_request_id(CIMultiDict(), {"request_id": None}) is None


@pytest.mark.parametrize("bad", ["", "has space", "é", "x" * 129, "tab\there"])
def test_a_bad_header_is_a_400_naming_it(bad):
    with pytest.raises(RequestError, match="x-request-id header") as caught:
        client_request_id(CIMultiDict({"x-request-id": bad}), {})
    assert caught.value.param is None and caught.value.http_status == 400


@pytest.mark.parametrize("bad", ["", "a b", 7, ["x"]])
def test_a_bad_body_field_is_a_400_naming_it(bad):
    with pytest.raises(RequestError, match="^request_id: ") as caught:
        client_request_id(CIMultiDict(), {"request_id": bad})
    assert caught.value.param == "request_id"
