"""`check_stop`: has a request finished with its newest token? (vLLM's
`vllm/v1/core/sched/utils.py`).

The engine core checks what it can see in token ids: EOS, stop token ids,
`max_tokens` and `max_model_len`. Stop *strings* need text, and text lives
in the front end: its detokenizer finds them and aborts the request.
"""

from __future__ import annotations

from minivllm.v1.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """As vLLM V1: nothing but the length limits ends a request before
    `min_tokens`; then EOS, then stop token ids, then the length limits
    (a stop on the last allowed token says "stop", not "length")."""
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        last_token_id = request.output_token_ids[-1]
        if not params.ignore_eos and last_token_id == request.eos_token_id:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if last_token_id in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last_token_id
            return True
    # (vLLM checks min_tokens first and returns; a request held by
    # min_tokens at max_model_len could then never finish.)
    if request.num_tokens >= max_model_len or (
        request.max_tokens is not None and request.num_output_tokens >= request.max_tokens
    ):
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
