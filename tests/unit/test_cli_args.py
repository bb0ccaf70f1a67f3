"""Arguments the CLI refuses before it connects anywhere (no server)."""

from __future__ import annotations

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
    ],
    ids=lambda a: " ".join(a),
)
def test_an_interval_that_is_not_a_positive_finite_number_is_a_usage_error(argv, capsys):
    # scheduler --every 0, -1 or nan ticks without pause (about 5,000-8,000 tick_schedules a second
    # measured on PG 18); top --interval -1 or nan prints a frame, then a ValueError traceback.
    with pytest.raises(SystemExit) as exc:
        cli.main([*argv, "--dsn", "postgresql:///unused"])
    assert exc.value.code == 2
