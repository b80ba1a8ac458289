"""Token cost of crashes and resumes: the same agent run crashed 0, 1 and 5 times, and resume prompts at 10 vs 200.

    python bench/tokens.py [--turns 100] [--crashes 0,1,5] [--early 10] [--late 200]

Needs Postgres and Redis (scripts/test starts them). Prints figures and ratios; asserts nothing.

A real `celery worker` runs the agent (`bench/agent_ticks.py`) against the fake Messages API, which
simulates prompt caching. A crash is a SIGKILL of the worker while a model request is in flight; the
server answers that request anyway a moment later (billed, as the API would, but never journaled), and
a new worker takes the run over once the lease expires. Tokens are everything billed: input, output,
cache writes and cache reads; "ledger" is what the run recorded, "billed" what the server served.
"""

from __future__ import annotations

import argparse
import os
import queue
import socket
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

try:
    from bench._setup import prepare
except ModuleNotFoundError:  # run as `python bench/x.py`: the repository root is not on sys.path yet
    from _setup import prepare

DB_NAME = "durable_bench_tokens"
BROKER = os.environ.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379/11")
USAGE = ("input_tokens", "output_tokens", "cache_write_tokens", "cache_read_tokens")
SERVED = ("input_tokens", "output_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
ROOT = prepare(
    DB_NAME,
    BROKER,
    # A killed worker's run is taken over within seconds: short leases, frequent sweeps.
    DURABLE_LEASE_SECONDS="2",
    DURABLE_SWEEP_SECONDS="0.5",
    DURABLE_IDLE_RESWEEP_SECONDS="1",
)

import redis  # noqa: E402

from bench.agent_ticks import Ticker  # noqa: E402
from durable_agents import api  # noqa: E402
from durable_agents.agents.participants import Usage  # noqa: E402
from durable_agents.agents.pricing import cost_usd  # noqa: E402
from durable_agents.models import Run, Turn  # noqa: E402
from durable_agents.testing import WorkerProcess, wait_for  # noqa: E402
from durable_agents.testing.fake_anthropic import FakeAnthropic, RecordedRequest, Reply  # noqa: E402


class BilledFake(FakeAnthropic):
    """The fake server, counting what it billed (every message it answered, read by a client or not)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.priced: list[tuple[str, dict[str, Any]]] = []  # (model, usage) of every message served

    def start(self) -> BilledFake:
        super().start()
        # Two writes per answer: without TCP_NODELAY, Nagle and delayed ACKs add ~40 ms to every request.
        self._server.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self

    def _message(self, request: RecordedRequest, reply: Reply, *rest: Any) -> tuple[dict[str, Any], list[bool]]:
        message, truncated = super()._message(request, reply, *rest)
        self.priced.append((message["model"], message["usage"]))
        return message, truncated

    def reset(self) -> None:
        super().reset()
        self.priced.clear()

    def billed_tokens(self) -> int:
        return sum(u[name] for _model, u in self.priced for name in SERVED)

    def billed_cost(self) -> Decimal:
        return sum((cost_usd(model, Usage(*(u[name] for name in SERVED))) for model, u in self.priced), Decimal(0))


@dataclass(frozen=True)
class Outcome:
    crashes: int
    ledger: dict[str, int]
    billed: int
    cost_usd: Decimal
    billed_usd: Decimal
    turns: int
    compactions: int

    @property
    def tokens(self) -> int:
        return sum(self.ledger.values())


class Bench:
    def __init__(self, fake: BilledFake, ticker: Ticker) -> None:
        self.fake = fake
        self.ticker = ticker
        self.stalls: queue.Queue[int] = queue.Queue()
        ticker.on_stall = self.stalls.put
        self.env = fake.environ()
        self.worker: WorkerProcess | None = None

    def start_worker(self) -> None:
        self.worker = WorkerProcess(
            env=self.env, cwd=ROOT, beat=True, extra_args=["--include", "bench.agent_ticks"]
        ).start()

    def run(self, workflow: str, ticks: int, crash_at: list[int]) -> Run:
        """Run the agent to the end, SIGKILLing the worker at each tick of `crash_at` while it asks the model."""
        self.fake.reset()  # a fresh prompt cache: runs do not read each other's entries
        self.ticker.stall_at = set(crash_at)
        self.start_worker()
        run = api.start(workflow, {"ticks": ticks})
        for _ in crash_at:
            self.stalls.get(timeout=300)
            assert self.worker is not None
            self.worker.kill()
            self.start_worker()
        done = wait_for(
            lambda: Run.objects.filter(pk=run.id, status__in=["completed", "failed"]).first(),
            timeout=600,
            what=f"run {run.id}",
        )
        assert self.worker is not None
        self.worker.kill()
        if done.status != "completed":
            raise SystemExit(f"run {run.id} failed: {done.error}")
        return done

    def outcome(self, run: Run, crashes: int) -> Outcome:
        turns = Turn.objects.filter(run=run)
        return Outcome(
            crashes=crashes,
            ledger={name: getattr(run, name) for name in USAGE},
            billed=self.fake.billed_tokens(),
            cost_usd=run.cost_usd,
            billed_usd=self.fake.billed_cost(),
            turns=turns.filter(purpose="turn").count(),
            compactions=turns.filter(purpose="compaction").count(),
        )


def resumed_prompt(run: Run, tick: int) -> tuple[int, int]:
    """(prompt tokens, of which cache reads) of the request that re-asked `tick` after the crash."""
    for turn in Turn.objects.filter(run=run, purpose="turn").order_by("index"):
        if any(b.get("type") == "tool_use" and b["input"].get("n") == tick for b in turn.content):
            return turn.input_tokens + turn.cache_write_tokens + turn.cache_read_tokens, turn.cache_read_tokens
    raise LookupError(f"no turn asked for tick {tick}")


def crash_points(turns: int, crashes: int) -> list[int]:
    return [turns * (i + 1) // (crashes + 1) for i in range(crashes)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=100, help="ticks in the crash comparison run")
    parser.add_argument("--crashes", default="0,1,5", help="comma-separated crash counts to compare")
    parser.add_argument("--early", type=int, default=10, help="the early resume point (tick)")
    parser.add_argument("--late", type=int, default=200, help="the late resume point (tick)")
    args = parser.parse_args()
    redis.Redis.from_url(BROKER).flushdb()
    ticker = Ticker()
    with BilledFake(responder=ticker) as fake:
        bench = Bench(fake, ticker)
        outcomes = []
        for crashes in (int(k) for k in args.crashes.split(",")):
            run = bench.run("bench_ticks", args.turns, crash_points(args.turns, crashes))
            outcomes.append(bench.outcome(run, crashes))
        resumes = {}
        for workflow in ("bench_ticks", "bench_ticks_uncompacted"):
            run = bench.run(workflow, args.late + 5, [args.early, args.late])
            resumes[workflow] = (resumed_prompt(run, args.early), resumed_prompt(run, args.late))

    base = outcomes[0]
    print(f"\ntokens of one {args.turns}-turn agent run, SIGKILLed mid model call K times (compaction at 4000)")
    print(
        f"{'K':>3} {'turns':>6} {'compact':>8} {'input':>8} {'output':>7} {'c.write':>8} {'c.read':>8} "
        f"{'ledger':>8} {'billed':>8} {'ledger $':>9} {'billed $':>9} {'tokens/K=0':>11} {'billed/K=0':>11}"
    )
    for o in outcomes:
        u = o.ledger
        print(
            f"{o.crashes:>3} {o.turns:>6} {o.compactions:>8} {u['input_tokens']:>8} {u['output_tokens']:>7} "
            f"{u['cache_write_tokens']:>8} {u['cache_read_tokens']:>8} {o.tokens:>8} {o.billed:>8} "
            f"{o.cost_usd:>9.4f} {o.billed_usd:>9.4f} {o.tokens / base.tokens:>11.3f} {o.billed / base.billed:>11.3f}"
        )
    print(f"\nprompt tokens of the first request after a SIGKILL at tick {args.early} vs tick {args.late}")
    print(f"{'agent':<26} {f'at {args.early}':>10} {f'at {args.late}':>10} {'ratio':>7}   cache reads at each")
    for workflow, ((early, early_read), (late, late_read)) in resumes.items():
        print(f"{workflow:<26} {early:>10} {late:>10} {late / early:>7.2f}   {early_read} / {late_read}")


if __name__ == "__main__":
    main()
