"""The one stop check, for both loops and every branch: pure, below the scheduler (process results calls it
one token at a time)."""
from __future__ import annotations

from ..request import Req


def check_stop(req: Req, tok: int) -> str | None:
    """EOS (unless ignore_eos), stop token ids, stop strings, then max_tokens / context length. Below
    min_tokens only the length counts (the device forbids EOS and the stop ids there; stop strings are
    ignored, as in vLLM, but the stop checker still reads every token)."""
    p = req.params
    early = len(req.output_ids) < p.min_tokens
    if tok in req.eos_token_ids and not p.ignore_eos and not early:
        return "stop"
    if tok in p.stop_token_ids and not early:
        return "stop"
    if req.stop_checker is not None:
        cut = req.stop_checker.add(tok)
        if cut is not None and not early:
            req.text = cut
            return "stop"
    if len(req.output_ids) >= req.max_new_tokens():
        return "length"
    return None
