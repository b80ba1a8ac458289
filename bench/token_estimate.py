"""How far the ~4-characters-a-token estimate is from a count, for prompts like the ones the agents send.

    python bench/token_estimate.py                          # counts by the fake Messages API (offline)
    ANTHROPIC_API_KEY=... python bench/token_estimate.py --api claude-sonnet-5-5   # counts by the real API

The shared rate limiter (`rate_limits.estimate_input_tokens`: compact JSON / 4) and the budget guard
(`messages.estimate_tokens`: `json.dumps` / 4) reserve by an estimate; COUNT_TOKENS replaces it for a
conversation's first request by `messages.count_tokens`. Offline, the counts come from FakeAnthropic, which counts by
the same ~4-characters rule (its docstring says so), over real HTTP and the real SDK: its figures show the plumbing,
not the error. The error itself can only be measured against the API (`--api`; count_tokens is free, with a
requests-per-minute limit of its own), or bounded by what is documented about the tokenizer; the table after the
figures gives those facts, with their sources, and what they imply for each sample. Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
os.environ.setdefault("DJANGO_LOCAL_SECRET_KEY", "1")  # a random key for this machine (project/settings.py)

import anthropic  # noqa: E402
import django  # noqa: E402

django.setup()

from durable_agents.agents.claude import count_input_tokens  # noqa: E402
from durable_agents.agents.messages import estimate_tokens  # noqa: E402
from durable_agents.agents.rate_limits import estimate_input_tokens  # noqa: E402
from durable_agents.testing.fake_anthropic import FakeAnthropic  # noqa: E402
from project.refunds.tools import email_customer, issue_refund, lookup_order  # noqa: E402
from project.refunds.workflows import INSTRUCTIONS  # noqa: E402

MODEL = "claude-sonnet-5-5"

# What is known about the tokenizer, with sources. "×" is tokens of a 4.7+ model (every 5.x model) over tokens of
# Opus 4.6 for the same text. Anthropic documents one range; the per-content figures are independent count_tokens
# measurements (third party, April 2026), not Anthropic's.
DOCUMENTED = (
    "Anthropic, Opus 4.7 release notes / migration guide "
    "(https://platform.claude.com/docs/en/about-claude/models/migration-guide): the updated tokenizer 'may use "
    "roughly 1x to 1.35x as many tokens when processing text compared to previous models (up to ~35% more, "
    "varying by content)'."
)
MEASURED = {
    # content kind: (x over 4.6, source)
    "english": (1.45, "sol.ava.dev/writings/2026-04-17-opus-4-7-tokenizer: English prose 1.45x"),
    "german": (1.46, "same: German prose 1.46x"),
    "json": (1.31, "same: text-heavy JSON log line 1.31x"),
    "python": (1.20, "same: Python source 1.20x"),
    "cjk": (1.00, "same: Chinese / Japanese / Korean 1.00x"),
}
# English prose: 4.33 characters a token on Opus 4.6, 3.60 on 4.7 (pithwire.com, 'Measuring Claude 4.7's tokenizer
# costs', count_tokens measurements). The 4-characters rule sits between the two.
ENGLISH_CHARS_PER_TOKEN = {"opus-4-6": 4.33, "4.7+": 3.60}


def samples() -> list[tuple[str, str, dict[str, Any]]]:
    """(name, content kind, Messages request) for prompts like the agents' own."""
    tools = [schema.anthropic_schema() for schema in (lookup_order, issue_refund, email_customer)]
    refund_first = {
        "model": MODEL,
        "max_tokens": 1024,
        "system": INSTRUCTIONS,
        "tools": tools,
        "messages": [
            {
                "role": "user",
                "content": "Hi, the mug in my order A-1001 arrived broken: the handle came off in the box. I'd like my "
                "money back please, I don't need a replacement. Thanks, Ana",
            }
        ],
    }
    lines = [
        {
            "sku": f"SKU-{i:05d}",
            "name": f"Stoneware mug, glaze no. {i % 17}",
            "qty": 1 + i % 3,
            "unit": f"{9 + i % 40}.90",
        }
        for i in range(200)
    ]
    tool_result = {
        **refund_first,
        "messages": [
            *refund_first["messages"],
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": "toolu_01", "name": "lookup_order", "input": {"order_id": "A-1001"}}
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_01",
                        "content": json.dumps({"order_id": "A-1001", "lines": lines}),
                    }
                ],
            },
        ],
    }
    code = (ROOT / "durable_agents" / "agents" / "rate_limits.py").read_text()[:6000]
    german = (
        "Guten Tag, ich habe am Montag eine Bestellung aufgegeben (Bestellnummer A-1001), und die Tasse ist "
        "leider zerbrochen angekommen. Der Henkel war abgebrochen und lag lose im Karton. Ich möchte keinen Ersatz, "
        "sondern bitte die Rückerstattung des vollen Betrags auf meine Kreditkarte. Können Sie mir außerdem "
        "bestätigen, bis wann das Geld gutgeschrieben wird? Vielen Dank und freundliche Grüße, Anna Müller. "
    ) * 3
    japanese = (
        "こんにちは。注文番号A-1001のマグカップが割れた状態で届きました。取っ手が箱の中で外れていました。"
        "交換は不要ですので、全額を返金していただけますか。返金がいつ反映されるかも教えてください。よろしくお願いします。"
    ) * 3

    def asking(text: str, *, system: str = "") -> dict[str, Any]:
        request: dict[str, Any] = {"model": MODEL, "max_tokens": 1024, "messages": [{"role": "user", "content": text}]}
        return {**request, "system": system} if system else request

    return [
        ("refund agent, first request", "english", refund_first),
        ("+ a 200-line order as tool result", "json", tool_result),
        ("a 6,000-character Python file", "python", asking(f"Review this module:\n\n{code}")),
        ("German customer message", "german", asking(german, system=INSTRUCTIONS)),
        ("Japanese customer message", "cjk", asking(japanese)),
    ]


def text_chars(value: Any) -> int:
    """Characters of the strings a request holds (what a tokenizer reads), without the JSON around them."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(text_chars(v) for k, v in value.items() if k not in ("model", "max_tokens", "type", "role"))
    if isinstance(value, list):
        return sum(text_chars(v) for v in value)
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--api", metavar="MODEL", help="count with the real API (ANTHROPIC_API_KEY) for this model")
    args = parser.parse_args()

    with FakeAnthropic() as fake:
        if args.api:
            client, counter = anthropic.Anthropic(max_retries=0), f"API ({args.api})"
        else:
            client, counter = fake.client(max_retries=0), "fake (~4 chars)"
        rows = []
        for name, kind, request in samples():
            request = {**request, "model": args.api or request["model"]}
            counted = count_input_tokens(client, request)
            rows.append((name, kind, request, counted))

    print(
        f"{'sample':36} {'text ch':>8} {'json ch':>8} {'limiter':>8} {'budget':>8} {counter:>16} {'count/limiter':>13}"
    )
    for name, _kind, request, counted in rows:
        limiter, budget = estimate_input_tokens(request), estimate_tokens(request)
        ratio = f"{counted / limiter:.2f}" if counted else "n/a"
        compact = len(json.dumps(request, separators=(",", ":"), default=str))
        print(
            f"{name:36} {text_chars(request):8,} {compact:8,} {limiter:8,} {budget:8,} "
            f"{counted if counted is not None else 'failed':>16} {ratio:>13}"
        )

    print("\nWhat the figures can and cannot say:")
    if not args.api:
        print("  * The fake counts by the same ~4-characters rule: 'count/limiter' near 1.00 shows the plumbing")
        print("    (count_tokens over HTTP, the fallback), not the estimate's error. Run with --api MODEL for that.")
        print("    Its non-ASCII rows differ only because the fake reads characters where the estimate reads escapes.")
    print("  * Both estimates count JSON characters, not text: structure (braces, keys, tool schemas) adds to them,")
    print("    and json.dumps escapes every non-ASCII character as \\uXXXX (6 characters, i.e. 1.5 'tokens'):")
    for name, kind, request, _counted in rows:
        per_char = estimate_input_tokens(request) / max(text_chars(request), 1)
        print(f"      {name:36} {per_char:.2f} estimated tokens per text character ({kind})")
    print(f"\nDocumented: {DOCUMENTED}")
    print("Measured by third parties with count_tokens (x = tokens on 4.7+ / tokens on Opus 4.6, same text):")
    for kind, (factor, source) in MEASURED.items():
        print(f"  {kind:8} x{factor:.2f}  {source}")
    old, new = ENGLISH_CHARS_PER_TOKEN["opus-4-6"], ENGLISH_CHARS_PER_TOKEN["4.7+"]
    print(
        f"English prose: {old:.2f} characters a token on Opus 4.6, {new:.2f} on 4.7+ (pithwire.com, count_tokens): "
        f"on prose the 4-characters rule gives {old / 4:.2f}x the 4.6 count and {new / 4:.2f}x the 4.7+ count."
    )
    print("\nImplied for each sample on a 5.x model (text only; the API's own framing and the JSON around it aside):")
    for name, kind, request, _counted in rows:
        chars, limiter = text_chars(request), estimate_input_tokens(request)
        if kind == "english":
            note = f"~{chars / new:,.0f} tokens of text at {new:.2f} characters a token, vs {limiter:,} estimated"
        else:
            factor = MEASURED[kind][0]
            note = f"no characters-a-token figure documented; {factor:.2f}x Opus 4.6's count, {limiter:,} estimated"
        print(f"  {name:36} {note}")


if __name__ == "__main__":
    main()
