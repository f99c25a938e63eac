"""check_stop: EOS, stop_token_ids, min_tokens, max_tokens and max_model_len."""

from __future__ import annotations

from collections.abc import Callable

from loom.core.stop import check_stop
from loom.request import Request, RequestStatus


def _after(request: Request, *tokens: int) -> RequestStatus | None:
    request.output_token_ids.extend(tokens)
    return check_stop(request, max_model_len=256)


def test_eos_stops_with_no_stop_reason(make_request: Callable[..., Request]) -> None:
    req = make_request("r", [1, 2, 3], 10, eos_token_ids=[5])
    assert _after(req, 4) is None
    assert _after(req, 5) == RequestStatus.FINISHED_STOPPED
    assert req.stop_reason is None


def test_ignore_eos(make_request: Callable[..., Request]) -> None:
    req = make_request("r", [1, 2, 3], 10, eos_token_ids=[5], ignore_eos=True)
    assert _after(req, 5) is None


def test_stop_token_id_is_the_stop_reason(make_request: Callable[..., Request]) -> None:
    req = make_request("r", [1], 10, stop_token_ids=[8, 9])
    assert _after(req, 9) == RequestStatus.FINISHED_STOPPED
    assert req.stop_reason == 9


def test_min_tokens_defers_stops_but_not_length(make_request: Callable[..., Request]) -> None:
    req = make_request("r", [1], 3, eos_token_ids=[5], stop_token_ids=[6], min_tokens=2)
    assert _after(req, 5) is None
    assert _after(req, 6) == RequestStatus.FINISHED_STOPPED  # the second output token may stop
    req = make_request("r", [1], 2, eos_token_ids=[5], min_tokens=2)
    assert _after(req, 5) is None
    assert _after(req, 4) == RequestStatus.FINISHED_LENGTH


def test_length_by_max_tokens_and_by_max_model_len(make_request: Callable[..., Request]) -> None:
    req = make_request("r", [1, 2], 2)
    assert _after(req, 3) is None
    assert _after(req, 3) == RequestStatus.FINISHED_LENGTH
    req = make_request("r", [1, 2], 100)
    req.output_token_ids.extend([3, 3])
    assert check_stop(req, max_model_len=5) is None
    req.output_token_ids.append(3)
    assert check_stop(req, max_model_len=5) == RequestStatus.FINISHED_LENGTH


def test_stop_token_on_the_last_allowed_token_reports_stop(make_request: Callable[..., Request]) -> None:
    req = make_request("r", [1], 1, eos_token_ids=[5])
    assert _after(req, 5) == RequestStatus.FINISHED_STOPPED
