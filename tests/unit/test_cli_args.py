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
