"""The replay lab at scale: a thousand recorded runs replayed on the workers that ran them, nothing applied.

The conversation is bench/scale_agent.py's (one agent step: the model asks for `look_up_order`, the tool answers,
the model answers in text — two model calls, one effect), its model the real Anthropic SDK against the shipped fake
Messages API, which takes `--latency` seconds per answer. The workers are the Procfile's: `model_worker` (gevent ×
`--greenlets` on the `durable-model` queue, a psycopg pool of `--pool-size`) and one prefork process on the default
queue with beat (the sweep). Measured in one run, in order:

1. **live**: `--runs` runs started and woken at once, as bench/agent_scale.py does: the baseline wall time;
2. the cohort: those runs frozen as recordings (`api.save_cohort`);
3. **deterministic replays**: `api.replay` of the cohort, once for each `--concurrency` (100, the default of
   `api.replay`, and 1,000), baseline lane (the recorded model, claude-sonnet-5-5) and candidate lane
   (`--candidate-model`), the fake answering every model the same way: each lane must agree with the observed lane
   on every run (100 %);
4. **noisy replay** (at the first `--concurrency`): the fake answers the recorded model's first turn with a seeded
   `--noise` share of tool calls with other arguments (the order id with a '#': a call the recording never made,
   so that run's replay diverges and ends), the candidate's with `--candidate-noise`: each lane's agreement, its
   95 % Wilson interval and whether it covers 1 − the noise rate, and the CI verdict at `--fail-under`.

Printed: wall time of each replay (from `api.replay` to its last run finished) beside the live one (from the
wake-up to the last run finished; a replay's runs go `--concurrency` at a time, under their own concurrency key),
the most replay runs in flight at once (admitted and not finished, sampled every 0.2 s), the most requests in
flight at the fake, the peak Postgres connections by application (pg_stat_activity), the time `api.replay` took to
create the runs and `api.replay_report` to compare them, and the effects applied during the replays (the tool's
body counts itself in Redis: must stay 0). Speed is printed, never asserted; the bench exits 1 only if a lane
agrees on another number of runs than the fake's answers make it (all, deterministic; all but the noisy draws,
with noise) or a replay applied an effect.

    python bench/replay.py                      # 1,000 runs, answers of 2 s
    python bench/replay.py --runs 200 --concurrency 100   # smaller
    python bench/replay.py --noise 0.1 --candidate-noise 0.2 --seed 3
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

try:
    from bench._setup import prepare
except ModuleNotFoundError:  # run as `python bench/x.py`: the repository root is not on sys.path yet
    from _setup import prepare

DB_NAME = os.environ.get("BENCH_DB_NAME", "durable_bench_replay")
BROKER = os.environ.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379/14")
MODEL_QUEUE = "durable-model"
STARTERS = 8
ROOT = prepare(DB_NAME, BROKER, DURABLE_SWEEP_SECONDS="1", DURABLE_MODEL_QUEUE=MODEL_QUEUE)

import redis  # noqa: E402
from django.conf import settings  # noqa: E402
from django.db import connection, connections  # noqa: E402
from django.test import override_settings  # noqa: E402

from bench.baseline import UNWOKEN  # noqa: E402
from bench.scale_agent import WORKFLOW, applied  # noqa: E402
from durable_agents import api, clock  # noqa: E402
from durable_agents.engine.admission import slots_held  # noqa: E402
from durable_agents.engine.wake import wake  # noqa: E402
from durable_agents.models import FINISHED_RUN_STATUSES, ReplayRun, Run, RunStatus, StepKind  # noqa: E402
from durable_agents.testing import WorkerProcess, wait_for  # noqa: E402
from durable_agents.testing.fake_anthropic import FakeAnthropic, RecordedRequest, Reply  # noqa: E402

RECORDED_MODEL = settings.DURABLE_AGENTS.get("DEFAULT_MODEL", "claude-sonnet-5-5")


class Model:
    """The fake model: look the order up, then say where it is. With `noise` ({model: rate}), a seeded share of
    first turns call the tool with other arguments (the order id with a '#'). Each draw depends on the seed, the
    model and the order id only, never on the order requests arrive in: an SDK retry gets the same answer."""

    def __init__(self) -> None:
        self.noise: dict[str, float] = {}
        self.seed = 0

    def noisy(self, model: str, order_id: str) -> bool:
        rate = self.noise.get(model, 0.0)
        return rate > 0 and random.Random(f"{self.seed}:{model}:{order_id}").random() < rate

    def __call__(self, request: RecordedRequest) -> Reply:
        if request.tool_results:
            return Reply.text("Your order was delivered.")
        order_id = request.last_user_text.rsplit(" ", 1)[-1].rstrip("?")
        model = str(request.body.get("model", ""))
        return Reply.tool_use(
            "look_up_order", {"order_id": f"#{order_id}" if self.noisy(model, order_id) else order_id}
        )


@dataclass
class Peaks:
    connections: Counter[str] = field(default_factory=Counter)  # application_name → peak connections
    in_flight: int = 0  # replay runs admitted and not finished


class Sampler(threading.Thread):
    """Peak Postgres connections of this bench's database, and of replay runs holding the replay's key."""

    def __init__(self, key: str | None) -> None:
        super().__init__(daemon=True)
        self.key = key
        self.peaks = Peaks()
        self.stopped = threading.Event()

    def run(self) -> None:
        try:
            while not self.stopped.wait(0.2):
                with connections["default"].cursor() as cursor:
                    cursor.execute(
                        "SELECT application_name, count(*) FROM pg_stat_activity WHERE datname = %s "
                        "GROUP BY application_name",
                        [DB_NAME],
                    )
                    for name, count in cursor.fetchall():
                        self.peaks.connections[name or "bench"] = max(self.peaks.connections[name or "bench"], count)
                if self.key:
                    self.peaks.in_flight = max(self.peaks.in_flight, slots_held(self.key))
        finally:
            connections.close_all()

    def __enter__(self) -> Sampler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        self.join()


def worker(name: str, fake: FakeAnthropic, *, pool: str, concurrency: int, queues: str, **kw: Any) -> WorkerProcess:
    log = ROOT / "var" / f"bench-replay-{name}.log"
    log.parent.mkdir(exist_ok=True)
    env = {
        **fake.environ(),
        "DJANGO_DB_APPLICATION_NAME": name,
        "DURABLE_VAR_DIR": str(ROOT / "var"),  # beat's schedule file there, not in a /tmp other benches share
        **kw.pop("env", {}),
    }
    return WorkerProcess(
        name=name,
        env=env,
        cwd=ROOT,
        pool=pool,
        concurrency=concurrency,
        log_path=log,
        extra_args=["--queues", queues, "--include", "bench.scale_agent"],
        **kw,
    ).start()


def _durable(**changes: Any) -> dict[str, Any]:
    return {**settings.DURABLE_AGENTS, "MODEL_QUEUE": MODEL_QUEUE, **changes}


def _start_each(order_ids: list[str]) -> list[str]:
    try:
        return [str(api.start(WORKFLOW, {"order_id": order_id}).id) for order_id in order_ids]
    finally:
        connection.close()  # the starter thread's own connection


def live(n: int, prefix: str, timeout: float) -> tuple[float, float, list[str]]:
    """`n` runs created unwoken (STARTERS threads), then woken at once; (creation s, wake-to-finished s, ids)."""
    since = clock.now()
    created = time.monotonic()
    order_ids = [f"{prefix}-{i}" for i in range(n)]
    with (
        override_settings(DURABLE_AGENTS=_durable(**UNWOKEN)),
        ThreadPoolExecutor(STARTERS) as pool,
    ):
        ids = [i for chunk in pool.map(_start_each, [order_ids[k::STARTERS] for k in range(STARTERS)]) for i in chunk]
    started = time.monotonic()
    for run_id in ids:
        wake(run_id, kind=StepKind.AGENT)
    these = Run.objects.filter(workflow=WORKFLOW, replay_lane="", created_at__gte=since)
    wait_for(
        lambda: these.filter(status__in=FINISHED_RUN_STATUSES).count() == n,
        timeout=timeout,
        interval=0.5,
        what=f"{n} live runs to finish",
    )
    elapsed = time.monotonic() - started
    failed = these.exclude(status=RunStatus.COMPLETED).count()
    if failed:
        raise SystemExit(f"{failed} of {n} live runs did not complete; see var/bench-replay-*.log")
    return started - created, elapsed, ids


@dataclass
class Replayed:
    create_seconds: float
    seconds: float
    report_seconds: float
    in_flight: int
    fake_in_flight: int
    connections: Counter[str]
    report: Any
    load: str


def replay_cohort(cohort: str, candidate: str, concurrency: int, fake: FakeAnthropic, timeout: float) -> Replayed:
    fake.reset()
    fake.reset_peak()
    with Sampler(None) as sampler:
        began = time.monotonic()
        made = api.replay(cohort=cohort, candidate={"model": candidate}, concurrency=concurrency, actor="bench")
        created = time.monotonic()
        sampler.key = f"durable-replay:{made.id}"
        runs = Run.objects.filter(pk__in=ReplayRun.objects.filter(replay=made).values("run_id"))
        total = runs.count()
        wait_for(
            lambda: runs.filter(status__in=FINISHED_RUN_STATUSES).count() == total,
            timeout=timeout,
            interval=0.5,
            what=f"the {total} runs of replay {made.id} to finish",
        )
        finished = time.monotonic()
    report = api.replay_report(made.id)
    return Replayed(
        create_seconds=created - began,
        seconds=finished - began,
        report_seconds=time.monotonic() - finished,
        in_flight=sampler.peaks.in_flight,
        fake_in_flight=fake.peak_in_flight,
        connections=sampler.peaks.connections,
        report=report,
        load=load(),
    )


def load() -> str:
    return "load " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def lane_line(name: str, summary: Any, expected: float | None = None) -> str:
    line = (
        f"{name:<30} {summary.agree:>5} / {summary.finished:<5} {summary.agreement:>8.2%}  "
        f"{summary.low:.2%}–{summary.high:.2%}  diverged {summary.diverged:>4}"
    )
    if expected is not None:
        covered = summary.low <= expected <= summary.high
        line += f"  {expected:.2%} {'covered' if covered else 'NOT covered'}"
    return line


def main() -> int:  # noqa: PLR0915 - one bench, read top to bottom
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1000, help="recorded runs, each replayed in 2 lanes")
    parser.add_argument("--latency", type=float, default=2.0, help="seconds the fake takes per answer")
    parser.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[100, 1000],
        help="a replay's runs in flight at once: one deterministic replay for each (the noisy one at the first)",
    )
    parser.add_argument("--candidate-model", default="claude-haiku-5-5", help="the candidate lane's model")
    parser.add_argument("--noise", type=float, default=0.05, help="the recorded model's share of other tool calls")
    parser.add_argument("--candidate-noise", type=float, default=0.1, help="the candidate's share of other calls")
    parser.add_argument("--seed", type=int, default=31, help="the noise's seed")
    parser.add_argument("--fail-under", type=float, default=0.95, help="the CI threshold the verdict is printed at")
    parser.add_argument("--greenlets", type=int, default=1000, help="the model worker's gevent concurrency")
    parser.add_argument("--pool-size", type=int, default=16, help="the model worker's Postgres connections")
    parser.add_argument("--no-noise", action="store_true", help="leave the noisy replay out")
    args = parser.parse_args()
    if BROKER.startswith("redis"):
        redis.Redis.from_url(BROKER).flushdb()
    timeout = args.runs * args.latency * 4 + 300
    model = Model()
    model.seed = args.seed
    problems = []
    rows: list[tuple[str, Replayed]] = []
    with FakeAnthropic(responder=model, latency=args.latency) as fake:
        sweeper = worker("replay_sweeper", fake, pool="prefork", concurrency=1, queues="celery", beat=True)
        models = worker(
            "model_worker",
            fake,
            pool="gevent",
            concurrency=args.greenlets,
            queues=MODEL_QUEUE,
            env={"DJANGO_DB_POOL": str(args.pool_size)},
        )
        try:
            with override_settings(DURABLE_AGENTS=_durable()):
                live(1, "warm", timeout=120)  # the workers up, imported and connected before the clock starts
                print(f"live: {args.runs} runs, answers of {args.latency:g} s ({load()})", flush=True)
                fake.reset_peak()
                with Sampler(None) as sampler:
                    live_created, live_seconds, ids = live(args.runs, "live", timeout)
                live_fake = fake.peak_in_flight
                live_connections = sampler.peaks.connections
                live_load = load()
                effects_live = sum(applied().values())
                began = time.monotonic()
                api.save_cohort("bench", runs=ids)
                cohort_seconds = time.monotonic() - began
                print(f"  done ({live_load}); cohort saved in {cohort_seconds:.1f} s", flush=True)
                for limit in args.concurrency:
                    print(f"deterministic replay, concurrency {limit} ({load()})", flush=True)
                    done = replay_cohort("bench", args.candidate_model, limit, fake, timeout)
                    rows.append((f"replay, deterministic, concurrency {limit}", done))
                    print(f"  done ({done.load})", flush=True)
                if not args.no_noise:
                    model.noise = {RECORDED_MODEL: args.noise, args.candidate_model: args.candidate_noise}
                    print(f"noisy replay, concurrency {args.concurrency[0]} ({load()})", flush=True)
                    noisy = replay_cohort("bench", args.candidate_model, args.concurrency[0], fake, timeout)
                    rows.append((f"replay, seeded noise, concurrency {args.concurrency[0]}", noisy))
                    print(f"  done ({noisy.load})", flush=True)
            effects_replay = sum(applied().values()) - effects_live
        finally:
            models.kill()
            sweeper.kill()
    connection.close()

    def conns(peaks: Counter[str]) -> str:
        return ", ".join(f"{name} {count}" for name, count in sorted(peaks.items()))

    print(
        f"\n{args.runs} recorded runs of {WORKFLOW} (2 model calls of {args.latency:g} s, 1 tool call), "
        "real SDK → fake Messages API; each replay: baseline + candidate lane"
    )
    print(f"{'':<40} {'runs':>5} {'wall s':>7} {'÷ live':>7} {'runs in flight':>15} {'fake in flight':>15}  load after")
    print(
        f"{'live (wake → all finished)':<40} {args.runs:>5} {live_seconds:>7.1f} {1:>7.2f} {'—':>15} "
        f"{live_fake:>15}  {live_load}"
    )
    for label, r in rows:
        print(
            f"{label:<40} {2 * args.runs:>5} {r.seconds:>7.1f} {r.seconds / live_seconds:>7.2f} "
            f"{r.in_flight:>15} {r.fake_in_flight:>15}  {r.load}"
        )
    print(f"\nlive: created in {live_created:.1f} s ({STARTERS} threads), cohort saved in {cohort_seconds:.1f} s")
    print(f"  PG connections at peak: {conns(live_connections)}")
    for label, r in rows:
        print(
            f"{label}: api.replay {r.create_seconds:.1f} s (its runs created), "
            f"api.replay_report {r.report_seconds:.1f} s"
        )
        print(f"  PG connections at peak: {conns(r.connections)}")
    print(f"\neffects applied: live {effects_live} (1 a run + the warm-up), during the replays {effects_replay}")
    if effects_replay:
        problems.append(f"the replays applied {effects_replay} effects")

    print(f"\n{'agreement with the observed lane':<30} {'agree':>13} {'rate':>8}  95 % interval    diverged  expected")
    for label, r in rows[: len(args.concurrency)]:
        print(label)
        for lane in ("baseline", "candidate"):
            summary = r.report.lanes[lane]
            name = f"  {lane}" + (f" ({args.candidate_model})" if lane == "candidate" else f" ({RECORDED_MODEL})")
            print(lane_line(name, summary, 1.0))
            if summary.agree != args.runs:
                problems.append(f"the deterministic {lane} lane agreed on {summary.agree} of {args.runs} runs, not all")
    if not args.no_noise:
        print(f"seeded noise (seed {args.seed}): that share of first turns call the tool with other arguments")
        orders = [f"live-{i}" for i in range(args.runs)]
        for lane, name, rate in (
            ("baseline", RECORDED_MODEL, args.noise),
            ("candidate", args.candidate_model, args.candidate_noise),
        ):
            summary = noisy.report.lanes[lane]
            drawn = sum(1 for order in orders if model.noisy(name, order))
            print(lane_line(f"  {lane}, noise {rate:.1%}", summary, 1 - rate))
            print(
                f"    the fake drew {drawn} noisy answers ({drawn / args.runs:.2%}): {args.runs - drawn} should agree"
            )
            if summary.agree != args.runs - drawn:
                problems.append(f"the noisy {lane} lane agreed on {summary.agree} runs, not {args.runs - drawn}")
        passed, why = noisy.report.verdict(args.fail_under)
        print(f"  CI verdict at --fail-under {args.fail_under:g}: {'pass' if passed else 'fail'} ({why})")
    for problem in problems:
        print(f"PROBLEM: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
