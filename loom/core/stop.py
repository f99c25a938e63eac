"""Token-level stop check, run after each token appended to a request. Plain Python, no torch.

Stop *strings* need the text, so the output processor matches them and aborts the request through
`Scheduler.finish_requests`; this module only looks at token ids and lengths.
"""

from __future__ import annotations

from loom.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> RequestStatus | None:
    """Whether the request ends after its last appended token.

    Rules (OpenAI semantics, as vLLM applies them):
      * FINISHED_STOPPED when the last token is an EOS id (unless sampling_params.ignore_eos; sets
        request.stop_reason = None) or one of sampling_params.stop_token_ids (sets
        request.stop_reason = that id). Neither applies before sampling_params.min_tokens outputs.
      * FINISHED_LENGTH when num_output_tokens >= request.max_tokens or num_tokens >= max_model_len.
    A stop token that coincides with the length limit reports STOPPED: the model did end there.

    Args:
        request: has at least one output token.
        max_model_len: tokens (prompt + output) the model may hold.

    Returns:
        The finished status to give the request, or None to continue. The caller sets the status.
    """
    assert request.output_token_ids, "check_stop runs after a token is appended"
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        last = request.output_token_ids[-1]
        if not params.ignore_eos and last in request.eos_token_ids:
            request.stop_reason = None
            return RequestStatus.FINISHED_STOPPED
        if last in params.stop_token_ids:
            request.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


__all__ = ["check_stop"]
