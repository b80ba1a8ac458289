"""Thinking-block signatures for the fake Anthropic API: minted when a block is served, checked when it comes back.

https://platform.claude.com/docs/en/build-with-claude/preserved-thinking (and .../preserved-thinking/prefix-checks):
on every `thinking` / `redacted_thinking` block sent back, the API checks its signature for

1. integrity: a signature it did not mint, or a block whose text changed → 400 "Invalid `signature` in
   `thinking` block", always;
2. the model: a block the current model cannot read is dropped silently (`FakeAnthropic.dropped_thinking`);
3. the prefix (Fable 5.1+, Opus 5.5, Sonnet 5.5, Haiku 5.5): tools, system, every message before the block and
   the blocks before it in its own message must be byte-identical to when it was produced, and the thinking
   blocks before it must be those that were before it then, less any dropped from the oldest end. A failure
   invalidates the block and every later one.

A signature is an HMAC under a per-fake secret of what the check needs: the model, the block's text, digests of
the prefix parts and the ids of the thinking blocks before it. It cannot be forged and needs no server memory.

"Byte-identical" is taken literally for what the caller wrote: free-form JSON (a tool's `input_schema`, a
`tool_use.input`, tool results) is compared in the order it was sent, so reordered keys are a change, and a string
`content` is not the same as a one-text-block list. The API's own fields are typed, not text, so the order of a
block's fields and a null optional field (the SDK's ``model_dump()`` adds ``"citations": None``) do not count.
`cache_control` is not part of the prefix; nor are effort, max_tokens, output_config, tool_choice, metadata and
thinking.display, which live outside the compared parts.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from durable_agents.testing.api_models import ModelRules
from durable_agents.testing.api_rules import BINDING_BETA, THINKING_KINDS

__all__ = ["Binding", "BlockNote", "Prefix", "Signer", "prefix_of"]

INVALID_SIGNATURE = "Invalid `signature` in `thinking` block"
_BOUND = (
    "Invalid `signature` in `thinking` block. The block is bound to a different conversation. Remove the block, "
    'or set `thinking.block_binding.prefix_mismatch_behavior` to "drop_block".'
)
_NEEDS_BETA = f" That setting requires the `{BINDING_BETA}` value in the `anthropic-beta` header."


@dataclass(frozen=True)
class BlockNote:
    """A returned thinking block the fake did not pass to the model as is: dropped, or let through mismatched."""

    path: str  # "messages.3.content.0"
    reason: str  # "model_binding_mismatch" | "prefix_binding_mismatch"
    model: str  # the model of the request that sent it back
    detail: str = ""  # what differs from when the block was produced


@dataclass(frozen=True)
class Prefix:
    """Digests of what came before a block: tools, system, each earlier message, the earlier blocks of its own."""

    tools: str
    system: str
    messages: tuple[str, ...]


@dataclass
class Binding:
    """What checking one request's thinking blocks found."""

    error: str | None = None
    dropped: list[BlockNote] = field(default_factory=list)
    mismatched: list[BlockNote] = field(default_factory=list)  # let through ("allow" accounts)
    transformations: list[dict[str, str]] = field(default_factory=list)  # the response's input_transformations
    live: list[str] = field(default_factory=list)  # ids of the blocks the model reads, in order


def _envelope(value: Any) -> Any:
    # A block's own fields are typed by the API: their order and null optionals are not content. What they hold
    # (input, input_schema, text) is the caller's and keeps its order.
    if not isinstance(value, dict):
        return value
    out: dict[str, Any] = {}
    for key in sorted(value):
        item = value[key]
        if key == "cache_control" or item is None:
            continue
        if key == "content" and isinstance(item, list):
            item = [_envelope(b) for b in item]
        out[key] = item
    return out


def _digest(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))  # no sort_keys: order is content
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _visible(blocks: Sequence[Any]) -> list[Any]:
    return [_envelope(b) for b in blocks if not (isinstance(b, dict) and b.get("type") in THINKING_KINDS)]


def content_digest(content: Any) -> str:
    """A digest of a message's content as the API reads it (field order and nulls aside), to recognise it again."""
    return _digest([_envelope(b) for b in content] if isinstance(content, list) else content)


def message_digest(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):
        content = _visible(content)
    return _digest({"role": message.get("role"), "content": content})


def prefix_of(body: Mapping[str, Any]) -> Prefix:
    """The prefix digests of a request's messages (a reply's blocks add their own message's earlier blocks)."""
    system = body.get("system")
    return Prefix(
        tools=_digest([_envelope(t) for t in body.get("tools") or []]),
        system=_digest(_visible(system) if isinstance(system, list) else system),
        messages=tuple(message_digest(m) for m in body.get("messages") or [] if isinstance(m, dict)),
    )


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


class Signer:
    """Mints and checks signatures under one secret (one per fake)."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    def mint(
        self, *, kind: str, text: str, signer: str, prefix: Prefix, own: Sequence[Any], seq: Sequence[str], nonce: str
    ) -> str:
        payload = {
            "v": 1,
            "n": nonce,
            "k": kind,
            "m": signer,
            "h": hashlib.sha256(text.encode()).hexdigest()[:20],
            "t": prefix.tools,
            "s": prefix.system,
            "p": list(prefix.messages),
            "o": _digest(_visible(own)),
            "q": list(seq),
        }
        body = _b64(json.dumps(payload, separators=(",", ":")).encode())
        return f"{body}.{self._mac(body)}"

    def _mac(self, body: str) -> str:
        return _b64(hmac.new(self._secret, body.encode(), hashlib.sha256).digest())

    def open(self, token: Any, *, kind: str, text: str) -> dict[str, Any] | None:
        """The payload of a genuine, unmodified block; None if forged, altered or not this fake's."""
        if not isinstance(token, str) or token.count(".") != 1:
            return None
        body, mac = token.split(".")
        if not hmac.compare_digest(mac, self._mac(body)):
            return None
        payload: dict[str, Any] = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
        if payload.get("k") != kind or payload.get("h") != hashlib.sha256(text.encode()).hexdigest()[:20]:
            return None
        return payload

    def check(self, body: Mapping[str, Any], rules: ModelRules, *, mode: str, betas: frozenset[str]) -> Binding:
        """Check every thinking block of a request: integrity, model, prefix (see the module docstring)."""
        result = Binding()
        thinking = body.get("thinking") if isinstance(body.get("thinking"), dict) else {}
        binding = thinking.get("block_binding") if isinstance(thinking.get("block_binding"), dict) else None
        behavior = binding.get("prefix_mismatch_behavior") if binding else None
        # Accounts made before 2026-08-31 ("allow") get mismatched blocks through unless the request opts in by
        # setting the behaviour; Fable 5.2 enforces on every account.
        enforce = rules.prefix_check == "always" or mode == "error" or behavior is not None
        reporting = BINDING_BETA in betas
        prefix = prefix_of(body)
        failed = ""
        for i, message in enumerate(body.get("messages") or []):
            blocks = message.get("content") if isinstance(message, dict) else None
            if not isinstance(blocks, list):
                continue
            for j, block in enumerate(blocks):
                if not isinstance(block, dict) or block.get("type") not in THINKING_KINDS:
                    continue
                path = f"messages.{i}.content.{j}"
                kind = block["type"]
                token = block.get("signature") if kind == "thinking" else block.get("data")
                payload = self.open(token, kind=kind, text=block.get("thinking", "") if kind == "thinking" else "")
                if payload is None:
                    result.error = f"{path}: {INVALID_SIGNATURE}"
                    return result
                if not rules.can_read(payload["m"]):
                    result.dropped.append(BlockNote(path, "model_binding_mismatch", rules.model))
                    if reporting:
                        result.transformations.append(
                            {"type": "thinking_dropped", "path": path, "reason": "model_binding_mismatch"}
                        )
                    continue
                if rules.prefix_check != "never":
                    failed = failed or _mismatch(payload, prefix, i, blocks[:j], result.live)
                    if failed:
                        note = BlockNote(path, "prefix_binding_mismatch", rules.model, failed)
                        if behavior == "drop_block":
                            result.dropped.append(note)
                            result.transformations.append(
                                {"type": "thinking_dropped", "path": path, "reason": "prefix_binding_mismatch"}
                            )
                            continue
                        if enforce:
                            hint = "" if reporting else _NEEDS_BETA
                            result.error = f"{path}: {_BOUND}{hint} {failed}"
                            return result
                        result.mismatched.append(note)
                        if reporting:
                            result.transformations.append(
                                {"type": "thinking_mismatch_allowed", "path": path, "reason": "prefix_binding_mismatch"}
                            )
                result.live.append(payload["n"])
        return result


def _mismatch(payload: Mapping[str, Any], prefix: Prefix, index: int, own: Sequence[Any], live: list[str]) -> str:
    """What differs from when the block was produced, as a sentence; "" if nothing does."""
    if payload["t"] != prefix.tools:
        return "The `tools` differ from when the block was produced."
    if payload["s"] != prefix.system:
        return "The `system` prompt differs from when the block was produced."
    then = payload["p"]
    for k, (before, now) in enumerate(zip(then, prefix.messages[:index], strict=False)):
        if before != now:
            return f"`messages.{k}` differs from when the block was produced."
    if len(then) != index:
        return "Messages before the block were added or removed since it was produced."
    if payload["o"] != _digest(_visible(own)):
        return f"The blocks before it in `messages.{index}` differ from when it was produced."
    seq = payload["q"]
    # Dropping earlier blocks from the oldest end (or all of them) is allowed; a gap or a re-added block is not.
    if len(live) > len(seq) or seq[len(seq) - len(live) :] != live:
        return "A thinking block before it was left out or moved."
    return ""
