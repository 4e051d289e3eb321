"""The results store: one SQLite file (WAL) with the trials, their results and an index of their images.

- ``trials``: one row per trial (its spec as JSON, the columns tables group by,
  ``status`` pending / running / done / failed / timed out / n/a, error, attempts, worker).
- ``results``: the metrics of a finished trial (mean columns + JSON per sample and timings).
- ``images``: files written next to the store for a trial (``npz``, ``png``), their paths relative to the
  store's folder, so a store can be moved and reported from anywhere.  :meth:`Store.rows` resolves them
  against that folder and refuses (``images_refused``, with the reason) a path that leaves it.
- ``meta``: the sweep spec and the schema version.

Each finished trial is committed in its own transaction, so an interrupted sweep
loses at most the trials that were running.  Writers use ``BEGIN IMMEDIATE``
with a busy timeout, and a trial is *claimed* (pending → running, attempts + 1)
before it runs, so several processes can work on one store without running a
trial twice.  Claims of a process that died (same host, pid gone) or that are
older than ``stale_seconds`` return to pending on :meth:`Store.recover`.
Files live in ``<stem>-images/`` and trained models in ``<stem>-cache/`` beside the database.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import re
import os
import socket
import sqlite3
import time
from pathlib import Path
from typing import Any
from collections.abc import Iterable, Iterator, Mapping, Sequence

from ..errors import ConfigError
from ..metrics.scores import score_columns
from .trials.trial import TrialResult, TrialSpec, threat_model

SCHEMA_VERSION = 1
#: statuses ``retry_failed`` runs again (a timed-out trial may finish under a larger budget).
RETRYABLE = ("failed", "timed out")
#: the columns of ``images`` that :meth:`Store.rows` returns (resolved against the store's folder).
IMAGE_KINDS = ("npz", "png")
#: the batch scores stored as columns of ``results`` (from the metrics' registry, :data:`leakbench.metrics.SCORES`).
MEAN_COLUMNS = score_columns()

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS trials (
    key TEXT PRIMARY KEY, kind TEXT NOT NULL, spec TEXT NOT NULL,
    dataset TEXT, model TEXT, attack TEXT, defense TEXT, batch_size INTEGER, seed INTEGER, batch INTEGER,
    status TEXT NOT NULL DEFAULT 'pending', error TEXT, traceback TEXT, attempts INTEGER NOT NULL DEFAULT 0,
    worker TEXT, created REAL, started REAL, finished REAL
);
CREATE INDEX IF NOT EXISTS trials_status ON trials(status);
CREATE TABLE IF NOT EXISTS results (
    key TEXT PRIMARY KEY REFERENCES trials(key), {score_columns},
    seconds REAL, metrics TEXT, per_sample TEXT, timings TEXT, committed REAL
);
CREATE TABLE IF NOT EXISTS images (key TEXT NOT NULL, kind TEXT NOT NULL, path TEXT NOT NULL,
                                   PRIMARY KEY (key, kind));
""".replace("{score_columns}", ", ".join(f"{c} REAL" for c in MEAN_COLUMNS))


def _schema_columns() -> dict[str, tuple[str, ...]]:
    """Every table of :data:`_SCHEMA` and its columns, read from its ``CREATE TABLE`` statements."""
    out: dict[str, tuple[str, ...]] = {}
    for name, body in re.findall(r"CREATE TABLE IF NOT EXISTS (\w+) \((.*?)\);", _SCHEMA, flags=re.S):
        parts, depth, current = [], 0, ""
        for ch in body:  # split on the commas outside parentheses
            depth += (ch == "(") - (ch == ")")
            if ch == "," and depth == 0:
                parts.append(current)
                current = ""
            else:
                current += ch
        parts.append(current)
        words = [p.split()[0] for p in parts if p.split()]
        out[name] = tuple(w for w in words if w.upper() not in ("PRIMARY", "UNIQUE", "FOREIGN", "CHECK", "CONSTRAINT"))
    return out


#: the tables and columns a store of this leakbench holds (checked when an existing store is opened).
SCHEMA_COLUMNS = _schema_columns()


def _json(value: Any) -> str:
    return json.dumps(value, default=str, allow_nan=True)


def _real(value: Any) -> float | None:
    if value is None or isinstance(value, bool):
        return None if value is None else float(value)
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


#: columns of :meth:`Store.rows` by the type every reader may assume (a hand-edited store may hold anything).
_INT_COLUMNS = ("batch_size", "seed", "batch", "attempts")
_TEXT_COLUMNS = ("key", "kind", "dataset", "model", "attack", "defense", "status", "error", "traceback", "worker",
                 "npz", "png")


def _typed(row: dict[str, Any]) -> dict[str, Any]:
    """The row with integer, real and text columns of those types (None where a value does not convert)."""
    for name in _INT_COLUMNS:
        v = row.get(name)
        if v is not None and not (isinstance(v, int) and not isinstance(v, bool)):
            f = _real(v)
            row[name] = int(f) if f is not None and f.is_integer() else None
    for name in (*MEAN_COLUMNS, "seconds", "created", "started", "finished"):
        if name in row:
            row[name] = _real(row[name])
    for name in _TEXT_COLUMNS:
        v = row.get(name)
        if v is not None and not isinstance(v, str):
            row[name] = v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)
    return row


def _decoded(text: Any, name: str, key: Any, row: dict[str, Any]) -> dict[str, Any]:
    """A JSON column of a row as a dict; ``{}`` (and ``row["damaged"]`` saying which) when it is not valid JSON."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except (TypeError, ValueError, RecursionError):
        value = None
    if not isinstance(value, dict):
        row["damaged"] = ", ".join(filter(None, [row.get("damaged"), name]))
        return {}
    return value


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sqlite_message(path: Path, err: sqlite3.Error) -> str:
    """One line for an SQLite error on opening or writing ``path``, with the fix."""
    text = str(err)
    if "not a database" in text or "malformed" in text or "disk I/O" in text:
        return f"{path} is not a readable leakbench store ({text}: corrupt or truncated); use a new --db file"
    if "full" in text and "no such" not in text:
        return f"cannot write {path} ({text}); free disk space and run the same command again to resume"
    if "readonly" in text or "read-only" in text or "unable to open" in text:
        return f"cannot write {path} ({text}); choose a writable --db path (reports read it with `leakbench report`)"
    if "no such column" in text or "no such table" in text or "has no column" in text:
        return (f"{path} is not a leakbench store of this schema ({text}): written by another leakbench version or "
                "program; use a new --db file")
    if "locked" in text or "busy" in text:
        return f"{path} is busy ({text}): another process is writing it; wait for it, or use another --db file"
    return f"{path}: SQLite error ({text}); use a new --db file"


def _open_readonly(path: Path, timeout: float) -> sqlite3.Connection:
    """A connection that never writes ``path`` (``mode=ro``; ``immutable=1`` when even the WAL index is read-only)."""
    if not path.is_file():
        raise ConfigError(f"expected a results database written by `leakbench evaluate`, got {str(path)!r} "
                          "(no such file)")
    uri = path.resolve().as_uri()
    last: sqlite3.Error | None = None
    for query in ("?mode=ro", "?mode=ro&immutable=1"):
        try:
            conn = sqlite3.connect(uri + query, uri=True, timeout=timeout, isolation_level=None,
                                   check_same_thread=False)
            conn.row_factory = sqlite3.Row
            try:
                conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
            except sqlite3.Error:
                conn.close()
                raise
            return conn
        except sqlite3.Error as err:
            last = err
    raise ConfigError(_sqlite_message(path, last)) from None


def _plan_digest(keys: list[str]) -> str:
    """The digest :meth:`Store.bind` ties a store to: its sorted trial keys."""
    return hashlib.sha256("\n".join(keys).encode()).hexdigest()[:20]


class Store:
    """A sweep's SQLite store (see the module docstring); ``Store("results.db")``."""

    def __init__(self, path: str | Path, *, timeout: float = 60.0, readonly: bool = False) -> None:
        self.path = Path(path)
        self.readonly = readonly
        if self.path.suffix == "" or self.path.is_dir():
            raise ConfigError(f"expected a database file path like results.db, got {str(path)!r} (option --db)")
        if readonly:
            self._conn = _open_readonly(self.path, timeout)
            self._check_existing(readonly=True)
        else:
            self._open_writable(timeout)
        version = self.meta("schema_version") or str(SCHEMA_VERSION)
        if version != str(SCHEMA_VERSION):
            raise ConfigError(f"{self.path} has store schema {version}, this leakbench reads {SCHEMA_VERSION}; "
                              "use a new --db file")

    # ------------------------------------------------------------------ plumbing
    @property
    def images_dir(self) -> Path:
        return self.path.parent / f"{self.path.stem}-images"

    @property
    def cache_dir(self) -> Path:
        return self.path.parent / f"{self.path.stem}-cache"

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield self._conn
        except BaseException:
            if self._conn.in_transaction:  # SQLite already rolled back after some errors (disk full)
                self._conn.execute("ROLLBACK")
            raise
        else:
            self._conn.execute("COMMIT")

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def meta(self, name: str) -> str | None:
        row = self._conn.execute("SELECT value FROM meta WHERE name = ?", (name,)).fetchone()
        return None if row is None else row[0]

    def set_meta(self, name: str, value: str) -> None:
        with self._tx() as c:
            c.execute("INSERT INTO meta VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET value = excluded.value",
                      (name, value))

    def _open_writable(self, timeout: float) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._conn = sqlite3.connect(str(self.path), timeout=timeout, isolation_level=None,
                                         check_same_thread=False)
        except sqlite3.Error as err:
            raise ConfigError(_sqlite_message(self.path, err)) from None
        self._conn.row_factory = sqlite3.Row
        self._check_existing(readonly=False)
        try:
            self._conn.execute(f"PRAGMA busy_timeout = {int(timeout * 1000)}")
            self._conn.execute("PRAGMA journal_mode = WAL")
            self._conn.execute("PRAGMA synchronous = NORMAL")
            with self._tx() as c:
                for statement in filter(str.strip, _SCHEMA.split(";")):
                    c.execute(statement)
                c.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        except sqlite3.Error as err:
            self._conn.close()
            raise ConfigError(_sqlite_message(self.path, err)) from None

    def _check_existing(self, *, readonly: bool) -> None:
        """Refuse a file that is not SQLite, is damaged, or holds another program's tables (nothing is added)."""
        try:
            tables = {r[0] for r in self._conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if tables and not {"meta", "trials"} <= tables:
                raise ConfigError(f"{self.path} is an SQLite database of another program (tables: "
                                  f"{', '.join(sorted(tables)[:5])}), not a leakbench store; use a new --db file")
            if not tables and readonly:
                raise ConfigError(f"{self.path} holds no leakbench results (an empty database); run "
                                  "`leakbench evaluate SPEC --db` first")
            if tables:
                for table, expected in SCHEMA_COLUMNS.items():
                    if table not in tables:
                        if readonly:  # a writable store gains the missing table below (CREATE TABLE IF NOT EXISTS)
                            raise ConfigError(f"expected a leakbench store with a {table} table, got {self.path} "
                                              "without one: a store of another leakbench version or program; use "
                                              "a new --db file")
                        continue
                    columns = {r[1] for r in self._conn.execute(f"PRAGMA table_info({table})")}
                    missing = [c for c in expected if c not in columns]
                    if missing:
                        raise ConfigError(f"{self.path} has a {table} table without column(s) "
                                          f"{', '.join(missing[:5])}{' …' if len(missing) > 5 else ''}: not a "
                                          "leakbench store of this schema (another version or program); use a new "
                                          "--db file")
                if readonly:
                    self._conn.execute("PRAGMA quick_check(1)").fetchone()
        except sqlite3.Error as err:
            self._conn.close()
            raise ConfigError(_sqlite_message(self.path, err)) from None
        except ConfigError:
            self._conn.close()
            raise

    def bind(self, keys: Iterable[str], *, force: bool = False) -> None:
        """Tie the store to one sweep: the set of its trial ``keys``; a different sweep is refused unless ``force``.

        A store bound to another set of trials (or, unbound, holding trials outside ``keys``) would mix two
        sweeps in one report; ``force=True`` re-binds it (the earlier trials stay and are reported too).
        """
        keys = sorted(set(keys))
        digest = _plan_digest(keys)
        if self.meta("plan") == digest:
            return
        problem = None if force else self.binding_problem(keys)
        if problem is not None:
            raise ConfigError(problem)
        self.set_meta("plan", digest)

    def binding_problem(self, keys: Iterable[str]) -> str | None:
        """Why :meth:`bind` would refuse the sweep of trial ``keys`` (another sweep's store), else None; writes
        nothing (``--dry-run`` asks it)."""
        keys = sorted(set(keys))
        bound = self.meta("plan")
        if bound == _plan_digest(keys):
            return None
        if bound is not None:
            return (f"{self.path} holds another sweep (a different spec: other trials); use a new --db for this "
                    "spec, or --force to add its trials to this store")
        known = {r[0] for r in self._conn.execute("SELECT key FROM trials")}
        extra = len(known - set(keys))
        if extra:
            return (f"{self.path} holds {extra} trial(s) of another sweep; use a new --db for this spec, or --force "
                    "to add its trials to this store")
        return None

    # ------------------------------------------------------------------ trials
    def add(self, trials: Iterable[TrialSpec]) -> int:
        """Record ``trials`` as pending (known ones keep their status; their labels are refreshed)."""
        now = time.time()
        rows = [(t.key, t.kind, _json(t.to_dict()), t.dataset_key, t.model_key, t.attack_key or None, t.defense,
                 t.batch_size if (t.kind != "utility" or t.batch_size) else None, t.seed, t.batch, now)
                for t in trials]
        with self._tx() as c:
            before = c.total_changes
            c.executemany(
                "INSERT INTO trials (key, kind, spec, dataset, model, attack, defense, batch_size, seed, batch, created)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(key) DO UPDATE SET spec = excluded.spec,"
                " dataset = excluded.dataset, model = excluded.model, attack = excluded.attack", rows)
            return c.total_changes - before

    def recover(self, *, stale_seconds: float = 6 * 3600) -> int:
        """Return to pending the claims of dead local processes and claims older than ``stale_seconds``."""
        host = socket.gethostname()
        dead = []
        for row in self._conn.execute("SELECT key, worker, started FROM trials WHERE status = 'running'"):
            whost, _, pid = (row["worker"] or "").rpartition(":")
            mine_dead = whost == host and pid.isdigit() and not _pid_alive(int(pid))
            if mine_dead or (row["started"] or 0) < time.time() - stale_seconds:
                dead.append((row["key"],))
        if dead:
            with self._tx() as c:
                c.executemany("UPDATE trials SET status = 'pending', worker = NULL WHERE key = ? "
                              "AND status = 'running'", dead)
        return len(dead)

    def claim(self, keys: Sequence[str], worker: str, *, retry_failed: bool = False) -> list[str]:
        """Mark the claimable ``keys`` as running for ``worker``; returns the ones claimed, in order."""
        states = ("pending", *RETRYABLE) if retry_failed else ("pending",)
        got = []
        now = time.time()
        with self._tx() as c:
            for key in keys:
                cur = c.execute(
                    f"UPDATE trials SET status = 'running', worker = ?, started = ?, attempts = attempts + 1 "
                    f"WHERE key = ? AND status IN ({','.join('?' * len(states))})", (worker, now, key, *states))
                if cur.rowcount == 1:
                    got.append(key)
        return got

    def release(self, keys: Iterable[str], worker: str) -> None:
        """Give back claims that did not finish (interrupted): running → pending."""
        with self._tx() as c:
            c.executemany("UPDATE trials SET status = 'pending', worker = NULL, attempts = attempts - 1 "
                          "WHERE key = ? AND status = 'running' AND worker = ?", [(k, worker) for k in keys])

    def commit(self, result: TrialResult, files: Mapping[str, str | Path] | None = None) -> None:
        """Store a finished trial (status, error, metrics, timings, image files) in one transaction."""
        m = result.metrics
        with self._tx() as c:
            c.execute("UPDATE trials SET status = ?, error = ?, traceback = ?, finished = ?, worker = ? WHERE key = ?",
                      (result.status, result.error, result.traceback, time.time(), result.worker, result.key))
            c.execute(f"INSERT OR REPLACE INTO results VALUES ({', '.join('?' * (len(MEAN_COLUMNS) + 6))})",
                      (result.key, *(_real(m.get(k)) for k in MEAN_COLUMNS), result.seconds, _json(m),
                       _json(result.per_sample), _json(result.timings), time.time()))
            c.execute("DELETE FROM images WHERE key = ?", (result.key,))
            c.executemany("INSERT INTO images VALUES (?, ?, ?)",
                          [(result.key, kind, self._relative(p, kind)) for kind, p in (files or {}).items()])

    def _relative(self, path: str | Path, kind: str) -> str:
        """``path`` relative to the store's folder (POSIX form); a file outside that folder is refused."""
        base = self.path.parent.resolve()
        full = Path(path) if Path(path).is_absolute() else Path.cwd() / path
        try:
            return full.resolve().relative_to(base).as_posix()
        except ValueError:
            raise ConfigError(f"refused {kind} file {path}: it lies outside the store's folder {base} (images); "
                              f"write it under {self.images_dir}") from None

    def resolve_file(self, stored: str | None, key: str, kind: str) -> tuple[Path | None, str | None]:
        """(path, None) for a file the store names inside its folder, (None, reason) for one it refuses.

        Paths are relative to the store's folder; absolute ones (stores written by older versions) are
        accepted inside it.  A relative path that does not exist falls back to ``<images>/<key>.<kind>``
        (older stores kept paths relative to where ``evaluate`` ran).
        """
        if not stored:
            return None, None
        base = self.path.parent.resolve()
        raw = Path(str(stored))
        full = (raw if raw.is_absolute() else base / raw).resolve()
        if not full.is_relative_to(base):
            return None, (f"refused {kind} file {str(stored)!r}: it lies outside the store's folder {base} "
                          f"(a store only names its own files; re-run the trial to write it again)")
        if not full.exists() and not raw.is_absolute():
            own = (self.images_dir / f"{key}.{kind}").resolve()
            if own.is_file() and own.is_relative_to(base):
                return own, None
        return full, None

    # ------------------------------------------------------------------ queries
    def status(self, keys: Iterable[str] | None = None) -> dict[str, str]:
        """key → status (of ``keys`` or of every trial)."""
        rows = self._conn.execute("SELECT key, status FROM trials").fetchall()
        table = {r["key"]: r["status"] for r in rows}
        return table if keys is None else {k: table[k] for k in keys if k in table}

    def counts(self, keys: Iterable[str] | None = None) -> dict[str, int]:
        """How many trials (of ``keys`` or in all) have each status."""
        out: dict[str, int] = {}
        for s in self.status(keys).values():
            out[s] = out.get(s, 0) + 1
        return out

    def rows(self, *, kind: str | None = None, status: str | None = None) -> list[dict[str, Any]]:
        """Trials joined with their results and image paths, as dicts (JSON columns decoded)."""
        where, args = [], []
        if kind is not None:
            where.append("t.kind = ?"), args.append(kind)
        if status is not None:
            where.append("t.status = ?"), args.append(status)
        sql = ("SELECT t.*, " + "".join(f"r.{c}, " for c in MEAN_COLUMNS) + "r.seconds, r.metrics, r.per_sample, r.timings,"
               " (SELECT path FROM images i WHERE i.key = t.key AND i.kind = 'npz') AS npz,"
               " (SELECT path FROM images i WHERE i.key = t.key AND i.kind = 'png') AS png"
               " FROM trials t LEFT JOIN results r ON r.key = t.key"
               + (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY t.rowid")
        out = []
        for row in self._conn.execute(sql, args):
            d = _typed(dict(row))
            for name in ("spec", "metrics", "per_sample", "timings"):
                d[name] = _decoded(d.get(name), name, d.get("key"), d)
            refused = []
            for kind in IMAGE_KINDS:
                path, reason = self.resolve_file(d.get(kind), str(d.get("key")), kind)
                d[kind] = None if path is None else str(path)
                if reason:
                    refused.append(reason)
            if refused:
                d["images_refused"] = "; ".join(refused)
            d["threat_model"] = threat_model(d["spec"]) if d["spec"] else "eavesdropper"
            out.append(d)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "schema_version": SCHEMA_VERSION, "counts": self.counts()}


__all__ = ["Store", "SCHEMA_VERSION", "SCHEMA_COLUMNS", "MEAN_COLUMNS", "RETRYABLE", "IMAGE_KINDS"]
