"""Prefill/decode disaggregation for the router: prefill on one replica, decode on another (docs/disaggregation.md).

The request goes first to a prefill replica (`loom serve --kv-transfer-role producer`) with
kv_transfer_params {"do_remote_decode": true}, max_tokens 1 and no streaming: it computes the prompt's K/V,
keeps the blocks pinned and answers with where to pull them. The original request then goes to a decode
replica (`--kv-transfer-role consumer`) with those kv_transfer_params: it pulls the blocks, computes the last
prompt token itself and generates the answer, which is streamed back as is. Torch-free, as the rest of the
router. If the prefill replica fails or returns no kv_transfer_params, the decode replica simply computes the
prompt (its answer is the same); a failed pull on the decode side falls back the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import httpx

logger = logging.getLogger(__name__)

# the prefill's part: what its request must not carry (streams, choices and logprobs are the decode's job)
_PREFILL_DROPPED = ("stream", "stream_options", "n", "best_of", "logprobs", "top_logprobs", "prompt_logprobs",
                    "echo", "use_beam_search", "max_completion_tokens", "min_tokens", "kv_transfer_params")


def prefill_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The prefill replica's copy of a request body: do_remote_decode, max_tokens 1, not streamed, one sample."""
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROPPED}
    out["max_tokens"] = 1
    out["stream"] = False
    out["kv_transfer_params"] = {"do_remote_decode": True}
    return out


async def prefill_then_decode(client: httpx.AsyncClient, prefill_url: str, decode_url: str, path: str,
                              body: dict[str, Any], headers: dict[str, str]) -> tuple[httpx.Response, bool]:
    """Run a /v1/completions or /v1/chat/completions request disaggregated.

    Args:
        client: the router's client (its timeouts apply to both hops).
        prefill_url, decode_url: base URLs of the two replicas, e.g. "http://127.0.0.1:8001".
        path: the route, e.g. "/v1/completions".
        body: the client's JSON body (not modified).
        headers: headers to forward (auth, cache control); content-length is recomputed.

    Returns:
        (response, prefilled): the decode replica's response, opened with `client.send(..., stream=True)`: the
        caller streams it through (and must close it); prefilled is True when the decode replica was given the
        prefill's blocks to pull. Any error from the prefill replica (4xx, 5xx, unreachable, an answer without
        kv_transfer_params) makes the decode replica compute the prompt: it judges the client's own body.

    Raises:
        httpx.HTTPError: the decode replica cannot be reached (the caller's failover applies).
    """
    forward = {k: v for k, v in headers.items() if k.lower() not in ("content-length", "host")}
    decode_body = dict(body)
    try:
        prefill = await client.post(prefill_url.rstrip("/") + path, json=prefill_body(body), headers=forward)
    except httpx.HTTPError as e:
        logger.warning("prefill replica %s unreachable (%s): the decode replica computes the prompt", prefill_url, e)
        prefill = None
    if prefill is not None and 400 <= prefill.status_code < 500:
        # the prefill's body is not the client's (max_tokens 1, no streaming...): whatever it refused, the
        # decode replica judges the client's own body, and computes the prompt if it is fine
        logger.warning("prefill replica %s refused the prefill (%s); the decode replica computes the prompt%s",
                       prefill_url, prefill.text[:200], " (is it started with --kv-transfer-role producer?)"
                       if _error_param(prefill) == "kv_transfer_params" else "")
        prefill = None
    if prefill is not None and prefill.status_code == 200:
        try:
            answer = prefill.json()
        except ValueError:
            answer = None
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if params:
            decode_body["kv_transfer_params"] = params
        else:
            logger.warning("prefill replica %s returned no kv_transfer_params (not a producer?)", prefill_url)
    elif prefill is not None:
        logger.warning("prefill replica %s answered %d: the decode replica computes the prompt", prefill_url,
                       prefill.status_code)
    request = client.build_request("POST", decode_url.rstrip("/") + path, json=decode_body, headers=forward)
    return await client.send(request, stream=True), "kv_transfer_params" in decode_body


def _error_param(response: httpx.Response) -> str | None:
    """The `param` of an OpenAI-style error body, or None."""
    try:
        body = response.json()
    except ValueError:
        return None
    error = body.get("error") if isinstance(body, dict) else None
    return error.get("param") if isinstance(error, dict) else None


__all__ = ["prefill_body", "prefill_then_decode"]
