"""Whether a sequence's newest token completes one of its request's stop strings.

The engine asks after every decided token (greedy, sampling, and each of beam search's 2W
candidates), so a stop string is caught at the token that completes it: an occurrence lying
wholly before the newest token would have ended the sequence at an earlier step (beam search
never lets an ended candidate run on). That makes a tail decode enough:

    generated tokens:  t0 t1 ... [ t(n-k) ...... t(n-2) | t(n-1) ]
                                   tail before the newest | newest
    the tail grows (doubling) until the text before the newest token holds at least
    the longest stop string plus TAIL_MARGIN_CHARS characters, or reaches t0.

A stop string that the newest token completes starts at most len(stop) - 1 characters before
the newest token's text, so it lies inside the tail. The margin absorbs what a decode can get
wrong at the tail's first token: up to three replacement characters for a UTF-8 character cut at
its start, and a leading space a SentencePiece decoder strips. Only the generated tokens are
searched, never the prompt (as vLLM and OpenAI; transformers also matches across the boundary).
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.tokenizer import Tokenizer

TAIL_MARGIN_CHARS = 4


class StopStringMatcher:
    """One request's stop strings and the tokenizer whose decode defines the text searched."""

    def __init__(self, tokenizer: Tokenizer, stop_strings: Sequence[str]) -> None:
        if not stop_strings or not all(stop_strings):
            raise ValueError("stop_strings must be non-empty strings, at least one")
        self._tokenizer = tokenizer
        self.stop_strings = tuple(stop_strings)
        self._min_tail_chars = max(len(string) for string in self.stop_strings) + TAIL_MARGIN_CHARS

    def is_stopped(self, token_ids: Sequence[int]) -> bool:
        """token_ids: the sequence's generated tokens, newest last; True when their text contains a
        stop string (the caller checked every shorter prefix, so the newest token completes it)."""
        if not token_ids:
            return False
        num_before = len(token_ids) - 1
        tail_len = min(num_before, self._min_tail_chars)  # tokens before the newest one
        while True:
            start = num_before - tail_len
            before = self._tokenizer.decode(list(token_ids[start:num_before])) if tail_len else ""
            if start == 0 or len(before) >= self._min_tail_chars:
                break
            tail_len = min(num_before, 2 * tail_len)
        text = self._tokenizer.decode(list(token_ids[start:]))
        return any(string in text for string in self.stop_strings)
