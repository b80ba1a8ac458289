"""Token estimates and prompt-cache accounting for the fake Anthropic API.

Tokens are estimated at ~4 characters each, stable for equal requests, so tests can compare them but should not
pin exact values. The cache follows https://platform.claude.com/docs/en/build-with-claude/prompt-caching: entries
are per model and keyed by the whole prefix up to a breakpoint; a request reads the longest cached prefix within
20 blocks before its last breakpoint; an entry lives 5 minutes (or 1 hour) from its last write or read.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

# The API looks back this many blocks from a breakpoint for an earlier cache entry.
_CACHE_LOOKBACK_BLOCKS = 20
# Tokens the API adds around every prompt (role markers, the assistant prefix); never cached.
_FRAMING_TOKENS = 3


class PromptCache:
    """Cache entries (prefix hash → expiry on `clock`) and the usage a prompt is billed."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic, min_cache_tokens: int = 0) -> None:
        self._clock = clock
        self._min_cache_tokens = min_cache_tokens
        self._lock = threading.Lock()
        self._cache: dict[str, float] = {}

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()

    def usage(self, body: dict[str, Any], *, update_cache: bool) -> tuple[int, int, int]:
        """(input_tokens, cache_creation_input_tokens, cache_read_input_tokens) for this prompt."""
        segments = prompt_segments(body)
        cumulative: list[int] = []
        hashes: list[str] = []
        running = 0
        # Caches are per model, and a prefix is everything before it: a rolling hash gives every prefix a key.
        digest = hashlib.sha256(str(body.get("model")).encode())
        for segment, _ttl in segments:
            text = canonical(segment)
            running += estimate(text)
            digest.update(text.encode())
            cumulative.append(running)
            hashes.append(digest.hexdigest())
        total = running + _FRAMING_TOKENS
        breakpoints = [i for i, (_segment, ttl) in enumerate(segments) if ttl is not None]
        if not breakpoints or cumulative[breakpoints[-1]] < self._min_cache_tokens:
            return total, 0, 0
        last = breakpoints[-1]
        candidates = sorted({*range(last, max(-1, last - _CACHE_LOOKBACK_BLOCKS), -1), *breakpoints}, reverse=True)
        now = self._clock()
        with self._lock:
            self._cache = {key: expiry for key, expiry in self._cache.items() if expiry > now}
            hit = next((i for i in candidates if hashes[i] in self._cache), None)
            if update_cache:
                for i in breakpoints:
                    self._cache[hashes[i]] = max(self._cache.get(hashes[i], 0.0), now + (segments[i][1] or 300))
                if hit is not None:  # a read refreshes the entry's lifetime, as the API does
                    self._cache[hashes[hit]] = max(self._cache[hashes[hit]], now + 300)
        read = cumulative[hit] if hit is not None else 0
        creation = cumulative[last] - read
        return total - cumulative[last], creation, read


def blocks(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    # Also read for requests the fake refuses (the log identifies them): anything but a list holds no blocks.
    return [b for b in content if isinstance(b, dict)] if isinstance(content, list) else []


def _strip(block: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in block.items() if k != "cache_control"}


def _ttl(block: Any) -> float | None:
    control = block.get("cache_control") if isinstance(block, dict) else None
    if not isinstance(control, dict):
        return None
    return 3600.0 if control.get("ttl") == "1h" else 300.0


def prompt_segments(body: dict[str, Any]) -> list[tuple[dict[str, Any], float | None]]:
    """The prompt in cache order (tools, system, messages), one entry per block: (block sans cache_control, ttl)."""
    segments = [(_strip(tool), _ttl(tool)) for tool in blocks(body.get("tools"))]
    segments += [(_strip(block), _ttl(block)) for block in blocks(body.get("system"))]
    for message in body.get("messages") if isinstance(body.get("messages"), list) else []:
        if not isinstance(message, dict):
            continue
        for index, block in enumerate(blocks(message.get("content"))):
            # The role rides on each block so the same words from the other speaker are a different prefix.
            segments.append(({"role": message.get("role"), "index": index, **_strip(block)}, _ttl(block)))
    return segments


def prompt_tokens(body: dict[str, Any]) -> int:
    """The prompt's size by the fake's estimate: what `usage` bills in all (input + cache write + cache read)."""
    return sum(estimate(canonical(segment)) for segment, _ttl in prompt_segments(body)) + _FRAMING_TOKENS


def last_breakpoint_ttl(body: dict[str, Any]) -> float:
    return next((ttl for _segment, ttl in reversed(prompt_segments(body)) if ttl is not None), 300.0)


def canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def estimate(text: str) -> int:
    return max(1, (len(text) + 3) // 4)


def output_tokens(content: list[dict[str, Any]]) -> int:
    sizes = [estimate(b["text"] if b.get("type") == "text" else canonical(b.get("input", b))) for b in content]
    return max(1, sum(sizes))
