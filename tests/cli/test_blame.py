"""Issue 48: an error message blames what went wrong — never "free disk space" for a path that is a file, a
permission, or a store of another schema."""
from __future__ import annotations

import errno
import sqlite3

import pytest
import typer
from typer.testing import CliRunner

from leakbench.cli import app
from leakbench.cli.common import os_failure, reports_errors, sqlite_failure
from leakbench.errors import ConfigError
from leakbench.evaluation.store import SCHEMA_COLUMNS, Store

runner = CliRunner()


@pytest.mark.parametrize("err, words", [
    (NotADirectoryError(errno.ENOTDIR, "Not a directory", "/etc/passwd/results.db"), "a file stands where"),
    (FileExistsError(errno.EEXIST, "File exists", "/etc/passwd"), "a file stands where"),
    (IsADirectoryError(errno.EISDIR, "Is a directory", "/tmp"), "a directory stands where"),
    (PermissionError(errno.EACCES, "Permission denied", "/root/x"), "not writable"),
    (OSError(errno.EROFS, "Read-only file system", "/mnt/x"), "not writable"),
    (FileNotFoundError(errno.ENOENT, "No such file or directory", "/nope/x"), "no such file"),
])
def test_a_file_system_error_is_not_blamed_on_the_disk(err, words):
    line = os_failure(err)
    assert words in line and "free disk space" not in line and err.filename in line


def test_a_full_disk_is_blamed_on_the_disk():
    assert "free disk space" in os_failure(OSError(errno.ENOSPC, "No space left on device", "/data/x"))


def test_the_cli_wrapper_uses_the_blame(capsys):
    @reports_errors
    def command():
        raise FileExistsError(errno.EEXIST, "File exists", "/etc/passwd")

    with pytest.raises(typer.Exit):
        command()
    line = capsys.readouterr().err.strip()
    assert "a file stands where" in line and "free disk space" not in line


def test_demo_out_a_file_is_one_line_naming_out(tmp_path):
    target = tmp_path / "passwd"
    target.write_text("root:x:0:0\n")
    result = runner.invoke(app, ["demo", "--out", str(target)])
    assert result.exit_code == 2
    assert "expected a directory for --out" in result.output and "free disk space" not in result.output


@pytest.mark.parametrize("text, words", [
    ("no such column: seconds", "another leakbench version"),
    ("no such table: images", "another leakbench version"),
    ("database is locked", "another process"),
    ("database or disk is full", "free disk space"),
])
def test_sqlite_errors_are_blamed_on_their_cause(text, words):
    line = sqlite_failure(sqlite3.OperationalError(text))
    assert words in line
    assert ("free disk space" in line) == (words == "free disk space")


@pytest.mark.parametrize("table", ["results", "trials", "images"])
def test_a_store_missing_a_column_is_refused_when_opened(tmp_path, table):
    path = tmp_path / "results.db"
    Store(path).close()
    column = [c for c in SCHEMA_COLUMNS[table] if c != "key"][-1]
    with sqlite3.connect(path) as conn:
        conn.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
    conn.close()
    for readonly in (False, True):
        with pytest.raises(ConfigError, match=f"{table} table without column.*{column}.*new --db"):
            Store(path, readonly=readonly)
    result = runner.invoke(app, ["report", str(path), "--out", str(tmp_path / "report")])
    assert result.exit_code == 2 and column in result.output and "free disk space" not in result.output
