"""The OpenAI response bodies of ``osd serve``: choices, logprobs, envelopes, echoed
prompts and server-sent events."""

import json

from fastapi.responses import JSONResponse, StreamingResponse

from osd.server.requests import GenRequest


def token_text(tok, token_id: int) -> str:
    return f"token_id:{token_id}" if tok is None else tok.decode([token_id])


def logprobs_body(tok, req: GenRequest, token_pairs: list, offset: int):
    """OpenAI's ``logprobs`` object of a choice from ``(token id, osd.TokenLogprobs or
    None)`` pairs (None: an echoed prompt's first token): chat's ``content`` list, or the
    completions' parallel lists (``text_offset`` from ``offset``, the characters sent
    before these tokens)."""
    if req.logprobs is None:
        return None
    if req.kind == "chat":

        def entry(i, lp):
            t = token_text(tok, i)
            return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}

        return {
            "content": [
                {**entry(e.token_id, e.logprob), "top_logprobs": [entry(i, lp) for i, lp in e.top]}
                for _, e in token_pairs
            ]
        }
    tokens = [token_text(tok, i) for i, _ in token_pairs]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [e and e.logprob for _, e in token_pairs],
        "top_logprobs": [e and {token_text(tok, i): lp for i, lp in e.top} for _, e in token_pairs],
        "text_offset": offsets,
    }


def pairs(logprobs: list) -> list:
    """``(token id, osd.TokenLogprobs)`` pairs of generated tokens' logprobs."""
    return [(e.token_id, e) for e in logprobs]


def choice(
    tok,
    req: GenRequest,
    text: str,
    ids: list[int],
    finish: str | None,
    stream: bool,
    token_pairs: list,
    offset: int = 0,
    index: int = 0,
) -> dict:
    """One choice of a response (``stream``: of a chunk)."""
    lp = logprobs_body(tok, req, token_pairs, offset)
    if req.kind == "chat":
        if stream:
            c = {
                "index": index,
                "delta": {"content": text} if text else {},
                "logprobs": lp,
                "finish_reason": finish,
            }
        else:
            c = {
                "index": index,
                "message": {"role": "assistant", "content": text},
                "logprobs": lp,
                "finish_reason": finish,
            }
    else:
        c = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
    if req.return_token_ids:
        c["token_ids"] = ids
        if not stream or finish is not None:
            c["prompt_token_ids"] = req.prompt_ids
    return c


def envelope(kind: str, request_id: str, model_name: str, created: int, stream: bool) -> dict:
    """The fields every response (or chunk) of one request starts with."""
    obj = {
        "chat": ("chat.completion", "chat.completion.chunk"),
        "completion": ("text_completion", "text_completion"),
    }[kind][int(stream)]
    return {"id": request_id, "object": obj, "created": created, "model": model_name}


async def echo_prompt(async_engine, req: GenRequest) -> tuple[str, list]:
    """The echoed prompt: its text and its ``(token id, logprobs)`` pairs (scored by the
    target only when logprobs are asked for)."""
    tok = async_engine.engine.tokenizer
    text = "" if tok is None else tok.decode(req.prompt_ids)
    scores = (
        [None] * len(req.prompt_ids)
        if req.logprobs is None
        else await async_engine.score(req.prompt_ids, req.logprobs)
    )
    return text, list(zip(req.prompt_ids, scores))


def echo_only(slots: list, head: dict, tok, usage: dict):
    """The response to ``echo`` with ``max_tokens`` 0: each choice's prompt alone."""
    req = slots[0][0]
    choices = [
        choice(tok, r, echo[0], [], "length", req.stream, echo[1], index=k)
        for k, (r, echo, _) in enumerate(slots)
    ]
    if not req.stream:
        return JSONResponse({**head, "choices": choices, "usage": usage})
    events = [sse({**head, "choices": [c]}) for c in choices]
    if req.include_usage:
        events.append(sse({**head, "choices": [], "usage": usage}))
    return StreamingResponse(iter(events + ["data: [DONE]\n\n"]), media_type="text/event-stream")


def sse(obj) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
