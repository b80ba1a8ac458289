"""CPU time spent over an interval, read from /proc: worker process trees, the Postgres server, one database.

Standard library only: bench/dbos_steps.py imports it too, from DBOS's own virtualenv. Linux only.

    with Meter(worker_pids, postmaster=postmaster_pid(cursor), database="durable_bench") as meter:
        ...  # the work measured
    meter.usage.workers_ms, meter.usage.database_ms, meter.usage.postgres_ms

How it counts, and why the totals hold while processes come and go:

* A process's CPU so far is utime + stime in /proc/<pid>/stat (its threads, live and ended) plus cutime + cstime
  (its children that ended and that it reaped, with what they had reaped). A process tree's CPU is its root's plus
  every live descendant's own. When a child ends, its time moves into its parent's cutime/cstime as the parent
  reaps it, so the tree's total carries on across the exit: a prefork pool replacing a child, a Postgres backend
  ending with its connection. A process reaped by someone else (an orphan adopted by init) takes its time away.
* A snapshot reads every process in /proc, with the reaped totals of the tree's inner processes read just before
  and just after: a child reaped during the scan (read, then folded into a parent read later: counted twice; or
  gone before it was read, its parent read earlier: not counted) moves one of them, and the snapshot is taken again.
* Postgres: the postmaster (the parent of any backend: `SELECT pg_backend_pid()`) reaps every backend, so the
  server's CPU is the postmaster's tree: backends, checkpointer, WAL writer, autovacuum. On a shared server that
  includes other databases' work. One database's share is its backends' own CPU: a backend's process title names
  its database (`postgres: 15/main: user dbname 127.0.0.1(50142) idle`; update_process_title is on by default;
  a backend just forked still shows the postmaster's command line, so a title is read again until it names one),
  and a sampler thread reads the postmaster's children every `interval` seconds, so a backend that ends between
  two samples loses at most its last `interval` of CPU. `exclude` names backends left out of both Postgres figures
  (the measuring process's own polling connection).
* The machine: all CPUs' non-idle time from /proc/stat over the interval, to tell how loaded the machine was.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

TICK_MS = 1000 / os.sysconf("SC_CLK_TCK")
ATTEMPTS = 5


@dataclass(frozen=True)
class Proc:
    """One process's line of /proc/<pid>/stat, its times in clock ticks."""

    ppid: int
    start: int  # ticks after boot at which it started: tells a reused pid from the process that had it before
    user: int  # utime: all its threads
    system: int  # stime
    reaped_user: int  # cutime: its ended children it reaped
    reaped_system: int  # cstime

    @property
    def own(self) -> int:
        return self.user + self.system

    @property
    def reaped(self) -> int:
        return self.reaped_user + self.reaped_system


@dataclass(frozen=True)
class Usage:
    """CPU milliseconds spent over one interval (`None`: not measured, e.g. Postgres on another machine)."""

    seconds: float  # wall time of the interval
    workers_ms: float  # user + system
    workers_system_ms: float  # of which system (the kernel's work for them)
    postgres_ms: float | None  # the whole Postgres server
    database_ms: float | None  # the backends of the one database named
    machine_ms: float  # every process on the machine (all CPUs' non-idle time)
    trees_ms: dict[int, float] = field(default_factory=dict)  # each worker's tree, by its main process's pid

    def per(self, n: float) -> dict[str, float | None]:
        """The figures divided by `n` (steps, runs, conversations), as a dict: JSON can carry it across processes."""
        return {
            "seconds": self.seconds / n,
            "workers_ms": self.workers_ms / n,
            "workers_system_ms": self.workers_system_ms / n,
            "postgres_ms": None if self.postgres_ms is None else self.postgres_ms / n,
            "database_ms": None if self.database_ms is None else self.database_ms / n,
            "machine_ms": self.machine_ms / n,
        }


def read_stat(pid: int) -> Proc | None:
    """The process's times, or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) may hold spaces and parentheses: the fields after it start past its last ")".
    fields = text.rsplit(")", 1)[1].split()
    utime, stime, cutime, cstime = (int(f) for f in fields[11:15])
    return Proc(int(fields[1]), int(fields[19]), utime, stime, cutime, cstime)


def _scan() -> dict[int, Proc]:
    procs = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdecimal() and (proc := read_stat(int(entry.name))) is not None:
            procs[int(entry.name)] = proc
    return procs


def _reaped(pids: Iterable[int]) -> dict[int, int]:
    return {pid: proc.reaped for pid in pids if (proc := read_stat(pid)) is not None}


def _descendants(procs: dict[int, Proc], root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, proc in procs.items():
        children.setdefault(proc.ppid, []).append(pid)
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid in procs and pid not in found:
            found.add(pid)
            todo += children.get(pid, [])
    return found


def snapshot(roots: Iterable[int]) -> dict[int, tuple[int, int]]:
    """CPU ticks so far, (user + system, system), of each root's process tree ((0, 0) for a root that is gone),
    consistent across reaping."""
    roots = list(roots)
    procs = _scan()
    for _ in range(ATTEMPTS):
        trees = {root: _descendants(procs, root) for root in roots}
        # The roots' own parents are left out: init reaps the machine's orphans all the time.
        inner = {procs[pid].ppid for root, tree in trees.items() for pid in tree if pid != root} | set(roots)
        before = _reaped(inner)
        procs = _scan()
        after = _reaped(inner)
        if before == after and all(procs[pid].reaped == reaped for pid, reaped in after.items() if pid in procs):
            break
    trees = {root: _descendants(procs, root) for root in roots}
    spent = {}
    for root, tree in trees.items():
        if not tree:
            spent[root] = (0, 0)
            continue
        total = sum(procs[pid].own for pid in tree) + procs[root].reaped
        spent[root] = (total, sum(procs[pid].system for pid in tree) + procs[root].reaped_system)
    return spent


def tree_ms(pid: int) -> float:
    """CPU milliseconds a process and its descendants used so far (with the children it reaped)."""
    return snapshot([pid])[pid][0] * TICK_MS


def machine_ticks() -> int:
    """Non-idle CPU ticks of the whole machine so far: every CPU's time less idle and iowait (/proc/stat)."""
    fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = fields[:8]  # guest time is inside user already
    return user + nice + system + irq + softirq + steal


def postmaster_pid(cursor: object) -> int | None:
    """The Postgres server's main process, from a DB-API cursor: the parent of this connection's backend.

    None when the server's processes are not visible here (another machine or container).
    """
    cursor.execute("SELECT pg_backend_pid()")  # type: ignore[attr-defined]
    backend = read_stat(cursor.fetchone()[0])  # type: ignore[attr-defined]
    if backend is None:
        return None
    try:
        name = Path(f"/proc/{backend.ppid}/comm").read_text().strip()
    except FileNotFoundError:
        return None
    return backend.ppid if name.startswith("postgres") else None


def backend_pid(cursor: object) -> int:
    """The pid of the backend serving a DB-API cursor's connection: for `Meter(exclude=...)`."""
    cursor.execute("SELECT pg_backend_pid()")  # type: ignore[attr-defined]
    return cursor.fetchone()[0]  # type: ignore[attr-defined]


def backend_database(pid: int) -> str | None:
    """The database a Postgres backend serves, from its process title; None for a background process."""
    try:
        title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").split()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # `postgres: [cluster_name: ]user database host(port) state`: the database comes just before the client.
    for i, word in enumerate(title):
        if i >= 2 and (word == "[local]" or (word.endswith(")") and "(" in word)):
            return title[i - 1]
    return None


class _Backends(threading.Thread):
    """Samples the own CPU of one database's backends every `interval` seconds, until stopped."""

    def __init__(self, postmaster: int, database: str, interval: float, since: int) -> None:
        super().__init__(daemon=True, name="cpu-backends")
        self.postmaster, self.database, self.interval, self.since = postmaster, database, interval, since
        self.names: dict[tuple[int, int], str | None] = {}  # (pid, start) → database
        self.first: dict[tuple[int, int], int] = {}
        self.last: dict[tuple[int, int], int] = {}
        self.stopped = threading.Event()

    def sample(self) -> None:
        try:
            children = Path(f"/proc/{self.postmaster}/task/{self.postmaster}/children").read_text().split()
        except FileNotFoundError:
            return
        for pid in map(int, children):
            proc = read_stat(pid)
            if proc is None:
                continue
            key = (pid, proc.start)
            if key not in self.first:
                # A backend born during the interval spent all its CPU in it; one older was read at the start.
                self.first[key] = 0 if proc.start >= self.since else proc.own
            if self.names.get(key) is None:
                # Read until named: a backend just forked still shows the postmaster's command line.
                self.names[key] = backend_database(pid)
            self.last[key] = proc.own

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            self.sample()

    def ticks(self, exclude: set[int]) -> tuple[int, int]:
        """(this database's backends, the excluded backends) CPU ticks over the interval."""
        ours = excluded = 0
        for key, last in self.last.items():
            spent = last - self.first[key]
            if key[0] in exclude:
                excluded += spent
            elif self.names[key] == self.database:
                ours += spent
        return ours, excluded


class Meter:
    """CPU spent during a `with` block by worker process trees, the Postgres server and one database's backends.

    `workers`: the pids of the workers' main processes (their pool children are found and counted). `postmaster`:
    `postmaster_pid(cursor)`, None to leave Postgres out. `database`: whose backends make `database_ms`. `exclude`:
    backend pids left out of both Postgres figures. The result is `meter.usage`, once the block has ended.
    """

    def __init__(
        self,
        workers: Iterable[int],
        *,
        postmaster: int | None = None,
        database: str | None = None,
        exclude: Iterable[int] = (),
        interval: float = 0.05,
    ) -> None:
        self.workers = list(workers)
        self.postmaster, self.database, self.exclude, self.interval = postmaster, database, set(exclude), interval
        self.usage: Usage | None = None

    def _roots(self) -> list[int]:
        return self.workers + ([self.postmaster] if self.postmaster else [])

    def __enter__(self) -> Meter:
        self.backends = None
        if self.postmaster and self.database:
            since = int(float(Path("/proc/uptime").read_text().split()[0]) * 1000 / TICK_MS)
            self.backends = _Backends(self.postmaster, self.database, self.interval, since)
            self.backends.sample()
        self.began = time.perf_counter()
        self.machine = machine_ticks()
        self.before = snapshot(self._roots())
        if self.backends:
            self.backends.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        after = snapshot(self._roots())
        machine = machine_ticks() - self.machine
        seconds = time.perf_counter() - self.began
        database = excluded = None
        if self.backends:
            self.backends.stopped.set()
            self.backends.join()
            self.backends.sample()
            database, excluded = self.backends.ticks(self.exclude)
        server = None
        if self.postmaster:
            server = after[self.postmaster][0] - self.before[self.postmaster][0] - (excluded or 0)
        trees = {pid: (after[pid][0] - self.before[pid][0]) * TICK_MS for pid in self.workers}
        self.usage = Usage(
            seconds=seconds,
            workers_ms=sum(trees.values()),
            workers_system_ms=sum(after[pid][1] - self.before[pid][1] for pid in self.workers) * TICK_MS,
            postgres_ms=None if server is None else server * TICK_MS,
            database_ms=None if database is None else database * TICK_MS,
            machine_ms=machine * TICK_MS,
            trees_ms=trees,
        )


class Watch:
    """The bench's own connection, for waiting on work and reading pg_stat_database without being measured.

    Each read is rolled back, so pg_stat_database counts none of them as a commit (xact_commit), and its backend is
    left out of the Postgres CPU figures of `watch.meter(...)`. `connection`: a DB-API connection, not autocommit.

        watch = Watch(psycopg.connect(url), "durable_bench")
        with watch.meter(worker_pids) as meter:
            wait_until_done(lambda: watch.one("SELECT count(*) FROM ...")[0] == n)
    """

    def __init__(self, connection: object, database: str) -> None:
        self.connection, self.database = connection, database
        with connection.cursor() as cursor:  # type: ignore[attr-defined]
            self.pid = backend_pid(cursor)
            self.postmaster = postmaster_pid(cursor)
        connection.rollback()  # type: ignore[attr-defined]

    def one(self, sql: str, params: object = ()) -> tuple:
        """The first row of a query, its transaction rolled back."""
        with self.connection.cursor() as cursor:  # type: ignore[attr-defined]
            cursor.execute(sql, params)
            row = cursor.fetchone()
        self.connection.rollback()  # type: ignore[attr-defined]
        return row

    def meter(self, workers: Iterable[int], exclude: Iterable[int] = ()) -> Meter:
        """A Meter of `workers`, the server and this database, leaving out this connection's backend and `exclude`."""
        return Meter(workers, postmaster=self.postmaster, database=self.database, exclude={self.pid, *exclude})

    def counters(self) -> tuple[float, int, int]:
        """(time.monotonic(), xact_commit, sessions) of the database now."""
        committed, sessions = self.one(
            "SELECT xact_commit, sessions FROM pg_stat_database WHERE datname = %s", [self.database]
        )
        return time.monotonic(), committed, sessions


class Transactions:
    """Commits (and new sessions) in one database per unit of work, net of what the system commits when idle.

    A backend that goes idle less than a second after it last reported holds its statistics back for up to ten
    seconds (PostgreSQL's PGSTAT_IDLE_INTERVAL), so each reading waits `lag` seconds first; what the system commits
    while idle (the workers' heartbeats and lease renewals, a queue's polls) over those waits is measured once, in an
    idle window of `lag` seconds, and subtracted at that rate.

        ledger = Transactions(watch, 11.0)
        idle = ledger.idle(worker_pids)   # a Usage over the idle window; ledger.rate is its commits per second
        ...                               # N steps
        commits, sessions = ledger.per(N)
    """

    def __init__(self, watch: Watch, lag: float) -> None:
        self.watch, self.lag = watch, lag
        self.rate = self.session_rate = 0.0
        self.mark = watch.counters()

    def idle(self, workers: Iterable[int], exclude: Iterable[int] = ()) -> Usage:
        """Measure the idle rates: let every backend report, then `lag` seconds with nothing to do."""
        time.sleep(self.lag)
        began = self.watch.counters()
        with self.watch.meter(workers, exclude) as meter:
            time.sleep(self.lag)
        self.mark = self.watch.counters()
        seconds = self.mark[0] - began[0]
        self.rate, self.session_rate = (self.mark[1] - began[1]) / seconds, (self.mark[2] - began[2]) / seconds
        assert meter.usage is not None
        return meter.usage

    def per(self, n: float) -> tuple[float, float]:
        """(commits, new sessions) per unit since the last reading, net of the idle rates; starts the next one."""
        time.sleep(self.lag)
        now = self.watch.counters()
        seconds = now[0] - self.mark[0]
        commits = (now[1] - self.mark[1] - self.rate * seconds) / n
        sessions = (now[2] - self.mark[2] - self.session_rate * seconds) / n
        self.mark = now
        return commits, sessions
