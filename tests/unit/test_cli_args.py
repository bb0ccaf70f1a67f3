"""Arguments the CLI refuses before it connects anywhere (no server)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from pglockkit import cli


@pytest.mark.parametrize("value", ["inf", "nan", "1e20d", "soon"])
def test_a_duration_that_is_not_finite_is_an_argparse_error(value, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["register", "x", "--lock-timeout", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --lock-timeout: not a duration: '{value}'" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("json", "handler must look like module:function"),
        ("no_such_module_xyz:f", "cannot import the handler's module 'no_such_module_xyz'"),
        ("json:no_such_function", "module 'json' has no 'no_such_function'"),
        ("json:__doc__", "handler 'json:__doc__' is not callable"),
    ],
)
def test_a_handler_that_cannot_be_had_is_a_usage_error(spec, message, capsys):
    # It raised ImportError or AttributeError: a traceback and exit 1, where a usage error exits 2.
    code = cli.main(["work", "--dsn", "postgresql:///unused", "--queue", "w", "--handler", spec])
    err = capsys.readouterr().err
    assert code == 2 and f"pglockkit work: {message}" in err and "Traceback" not in err


@pytest.mark.parametrize("lease", ["0s", "8d"])
def test_a_lease_claim_job_would_refuse_is_a_usage_error(lease, capsys):
    # Accepted, it made every claim fail (22023 / 22003) and the worker retry for ever.
    code = cli.main(
        ["work", "--dsn", "postgresql:///unused", "--queue", "w", "--handler", "json:dumps", "--lease", lease]
    )
    assert (
        code == 2
        and "pglockkit work: lease must be more than 0 and at most 7 days" in capsys.readouterr().err
    )


@pytest.mark.parametrize("poll", ["nan", "inf", "1e300"])
def test_a_poll_interval_that_is_not_a_positive_finite_number_is_a_usage_error(poll, capsys):
    # nan and inf passed `poll_interval <= 0`: with nan an idle lane spins a CPU in wait_for and
    # never polls again; with inf (or 1e300) an idle lane dies of OverflowError (a traceback) and
    # the worker runs on without it, claiming nothing, exit status 0 at SIGTERM.
    code = cli.main(
        ["work", "--dsn", "postgresql:///unused", "--queue", "w", "--handler", "json:dumps", "--poll", poll]
    )
    assert code == 2 and "poll" in capsys.readouterr().err


def test_an_empty_queue_is_a_usage_error(capsys):
    # Accepted, every claim fails with 22023 (queue name must not be empty) and the worker retries
    # for ever, as --lease 0s did.
    code = cli.main(["work", "--dsn", "postgresql:///unused", "--queue", "", "--handler", "json:dumps"])
    assert code == 2 and "queue" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["scheduler", "--once", "--every", "0"],
        ["scheduler", "--once", "--every", "-1"],
        ["scheduler", "--once", "--every", "nan"],
        ["top", "--interval", "-1"],
        ["top", "--interval", "nan"],
        # docs/cli.md: "A pause (`--every`, `--interval`, `--poll`) is a positive number of
        # seconds, at most a day". sample --every took any duration: -5 took a sample, then died
        # of a ValueError traceback in time.sleep; 0 samples without pause.
        ["sample", "--every", "-5"],
        ["sample", "--every", "0"],
    ],
    ids=lambda a: " ".join(a),
)
def test_an_interval_that_is_not_a_positive_finite_number_is_a_usage_error(argv, capsys):
    # scheduler --every 0, -1 or nan ticks without pause (about 5,000-8,000 tick_schedules a second
    # measured on PG 18); top --interval -1 or nan prints a frame, then a ValueError traceback.
    with pytest.raises(SystemExit) as exc:
        cli.main([*argv, "--dsn", "postgresql:///unused"])
    assert exc.value.code == 2


def test_every_command_but_up_and_down_takes_embedded():
    # README ("Two commands"): "`pglockkit down` stops it. Every other command takes `--embedded`
    # to target it"; docs/cli.md: "Connection: `--dsn`, else `--embedded`, ...".
    # `pglockkit demo --embedded` was a usage error (exit 2, "unrecognized arguments").
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    refuse = [
        name
        for name, sub in commands.items()
        if name not in ("up", "down") and not any("--embedded" in a.option_strings for a in sub._actions)
    ]
    assert refuse == []


@pytest.mark.parametrize("lease", [float("inf"), float("nan"), 1e300])
@pytest.mark.parametrize("asynchronous", [False, True], ids=["threads", "asyncio"])
def test_a_worker_lease_that_is_not_finite_is_refused_naming_lease(lease, asynchronous):
    # Worker(lease=...) takes seconds as a float too. NaN, inf and 1e300 reached timedelta() and
    # raised "cannot convert float NaN to integer" (ValueError) or OverflowError, naming no
    # parameter, where poll_interval, group_time and reconnect_cap say what is wrong.
    import pglockkit
    import pglockkit.aio as aio

    async def ahandler(job):
        pass

    cls, handler = (aio.Worker, ahandler) if asynchronous else (pglockkit.Worker, lambda job: None)
    with pytest.raises(ValueError, match="lease"):
        cls("postgresql:///unused", "w", handler, lease=lease)


@pytest.mark.parametrize("resource", ["x", "1.5", "0x10"])
def test_key_int_with_a_resource_that_is_not_an_integer_is_a_usage_error(resource, capsys):
    # docs/cli.md: "usage errors exit 2". `pglockkit key NS RESOURCE --int` with a resource that
    # is not an integer raised ValueError out of cmd_key: a Python traceback and exit status 1.
    try:
        code = cli.main(["key", "--dsn", "postgresql:///unused", "billing", resource, "--int"])
    except SystemExit as exc:  # an argparse error
        code = exc.code
    except ValueError as exc:  # what it does now: the traceback a user sees
        pytest.fail(f"pglockkit key --int {resource!r} crashed with a traceback: {exc!r}")
    err = capsys.readouterr().err
    assert code == 2 and resource in err and "Traceback" not in err


def test_doctor_help_says_lag_after_also_bounds_the_xmin_horizon_check(capsys):
    # docs/monitoring.md: doctor reports "an xmin horizon held back for longer than --lag-after"
    # (monitor.doctor passes lag_after to check_xmin_horizon), but `pglockkit doctor --help`
    # described --lag-after as the queue lag alone.
    with pytest.raises(SystemExit):
        cli.main(["doctor", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    lag_after = out[out.index("--lag-after DURATION report") :]
    assert "xmin" in lag_after[: lag_after.index("connection:")], lag_after


@pytest.mark.parametrize("limit", ["0", "-1"])
def test_runs_limit_below_1_is_a_usage_error_as_jobs_limit_is(limit, capsys):
    # runs --limit -1 reached the server: exit 1 with error 2201W (LIMIT must not be negative), and
    # --limit 0 listed nothing, where jobs --limit refuses both as usage errors.
    for command in ("runs", "jobs q"):
        with pytest.raises(SystemExit) as exc:
            cli.main([*command.split(), "--limit", limit, "--dsn", "host=/nonexistent dbname=x"])
        assert exc.value.code == 2
        assert f"argument --limit: must be at least 1, got '{limit}'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("every", "seconds"), [("500ms", 0.5), ("5s", 5), ("1m", 60), ("2", 2), ("0.1", 0.1)]
)
def test_scheduler_every_takes_a_duration_as_sample_every_does(every, seconds):
    # scheduler --every took bare seconds only: `--every 5s` was a usage error ("expected a
    # number"), while sample --every takes 5s, 500ms, 1m.
    for command in ("scheduler", "sample"):
        args = cli.build_parser().parse_args([command, "--every", every])
        assert args.every.total_seconds() == pytest.approx(seconds)


def test_grant_admin_help_names_everything_admin_adds():
    # `pglockkit grant --help` said --admin adds "register namespaces, prune, retry dead jobs,
    # sample", leaving out list_jobs, the payload limit, schedules, rate limits and pausing. The
    # admin-only functions are those of pglockkit._admin_only (sql/schema/08_privileges.sql).
    privileges = (Path(__file__).parents[2] / "sql" / "schema" / "08_privileges.sql").read_text()
    admin_only = re.search(r"ANY \('\{([a-z_,]+)\}'::name\[\]\)", privileges).group(1).split(",")
    said = {
        "register_namespace": "register namespaces",
        "list_jobs": "list jobs",
        "prune_jobs": "prune jobs, leases and runs",
        "prune_leases": "prune jobs, leases and runs",
        "prune_runs": "prune jobs, leases and runs",
        "retry_dead_jobs": "retry dead jobs",
        "sample": "sample",
        "set_max_payload_bytes": "set the payload limit",
        "schedule": "schedule and unschedule",
        "unschedule": "schedule and unschedule",
        "set_rate_limit": "set and remove rate limits",
        "remove_rate_limit": "set and remove rate limits",
        "pause_queue": "pause and resume queues",
        "resume_queue": "pause and resume queues",
    }
    assert sorted(admin_only) == sorted(said), "a new admin-only function: say it in grant --admin's help"
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    grant = next(a for a in commands["grant"]._actions if a.dest == "admin")
    missing = [name for name in admin_only if said[name] not in grant.help]
    assert missing == [], grant.help
