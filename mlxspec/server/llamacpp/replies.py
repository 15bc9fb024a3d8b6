"""llama.cpp's `/completion` result object (`server_task_result_cmpl_final::
to_json_non_oaicompat` in its tools/server), its stream chunks, and `response_fields`.

Bodies leave as compact JSON (Starlette's JSONResponse writes no spaces): llama.vim finds
`"content":"` in the raw text before it parses anything, so a space after the colon would
make it drop every completion.
"""

from __future__ import annotations

import json

from mlxspec.events import RunRecord


def stop_type(record: RunRecord) -> str:
    """eos (the model ended), word (a stop string), limit (n_predict, the indentation or
    the time allowed)."""
    if record.stop_string is not None:
        return "word"
    if record.finish_reason == "length" or record.limit is not None:
        return "limit"
    return "eos"


def timings(record: RunRecord) -> dict:
    """llama.cpp's `timings`: the prompt's tokens evaluated (the cached ones excluded) and
    the generated ones, each with its time, plus the drafts where speculation ran."""
    prompt_n = record.prompt_tokens - record.reused_prompt_tokens
    prompt_ms = record.prefill_seconds * 1000
    predicted_n = record.completion_tokens
    predicted_ms = record.time_to_first_token - record.prefill_seconds + record.decode_seconds
    predicted_ms *= 1000
    return {
        "cache_n": record.reused_prompt_tokens,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": 1000 * prompt_n / prompt_ms if prompt_ms else 0.0,
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else 0.0,
        "predicted_per_second": 1000 * predicted_n / predicted_ms if predicted_ms else 0.0,
        "draft_n": record.drafted,
        "draft_n_accepted": record.accepted,
    }


def final_result(
    record: RunRecord, content: str, id_slot: int, index: int = 0, streamed: bool = False
) -> dict:
    """The whole result (streamed: its content already went out in the chunks)."""
    return {
        "index": index,
        "content": "" if streamed else content,
        "tokens": [],
        "id_slot": id_slot,
        "stop": True,
        "model": record.model,
        "tokens_predicted": record.completion_tokens,
        "tokens_evaluated": record.prompt_tokens,
        "generation_settings": {
            "n_predict": record.max_tokens,
            **{key: record.sampling.get(key) for key in ("temperature", "top_k", "top_p")},
            "seed": record.sampling.get("seed"),
        },
        "prompt": "",
        "has_new_line": "\n" in content,
        "truncated": False,
        "stop_type": stop_type(record),
        "stopping_word": record.stop_string or "",
        "tokens_cached": record.prompt_tokens + record.completion_tokens,
        "timings": timings(record),
        "x_mlxspec": record.to_dict(),
    }


def warmed_up(record: RunRecord, id_slot: int) -> dict:
    """n_predict 0: the prompt is in the cache; nothing is answered."""
    result = final_result(record, "", id_slot)
    result["tokens_predicted"] = result["timings"]["predicted_n"] = 0
    return result


def picked(result: dict, fields: list[str] | None) -> dict:
    """llama.cpp's `response_fields`: only the fields named, each at the top level under
    the name asked (`timings/prompt_n` is `result["timings"]["prompt_n"]`); a name that
    leads nowhere is left out."""
    if not fields:
        return result
    out = {}
    for path in fields:
        value, found = result, True
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                found = False
                break
            value = value[key]
        if found:
            out[path] = value
    return out


def chunk(content: str, id_slot: int, index: int = 0) -> dict:
    """One streamed piece of text."""
    return {"index": index, "content": content, "tokens": [], "stop": False, "id_slot": id_slot}


def sse(payload: dict) -> str:
    """A server-sent event as llama.cpp sends them: compact JSON, no [DONE]."""
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
