"""The fp8lab command line: help lists the subcommands, e4m3 prints the table and encodes numbers (negative
ones and -inf too, without ``--``)."""

import shutil
import subprocess

import pytest

from fp8lab import cli


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    assert "e4m3" in capsys.readouterr().out


def test_no_subcommand_prints_help_and_fails(capsys):
    assert cli.main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def test_table_has_all_256_codes(capsys):
    assert cli.main(["e4m3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 257
    assert lines[1].split() == ["0x00", "0.0000.000", "0", "zero"]
    assert lines[1 + 0x7E].split() == ["0x7E", "0.1111.110", "448", "normal"]
    assert lines[1 + 0xFF].split() == ["0xFF", "1.1111.111", "nan", "nan"]


def test_encoding_numbers_and_overflow_policy(capsys):
    cli.main(["e4m3", "3.3", "465"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert rows[0][:4] == ["3.3", "0x45", "0.1000.101", "3.25"]
    assert rows[1][:4] == ["465", "0x7E", "0.1111.110", "448"]
    cli.main(["e4m3", "--no-saturate", "465"])
    assert capsys.readouterr().out.splitlines()[1].split()[1] == "0x7F"


@pytest.mark.skipif(shutil.which("fp8lab") is None, reason="the console script is not installed")
def test_console_script_is_installed():
    out = subprocess.run(["fp8lab", "e4m3", "448"], capture_output=True, text=True, check=True).stdout
    assert "0x7E" in out


@pytest.mark.parametrize("argv", [
    ["e4m3", "-inf", "-1e3", "-0.5", "-nan", "465"],
    ["e4m3", "-inf", "--no-saturate", "-1e3", "-0.5", "-nan", "465"],
    ["e4m3", "--", "-inf", "-1e3", "-0.5", "-nan", "465"],
])
def test_negative_numbers_and_minus_inf_are_values_not_options(capsys, argv):
    """argparse reads ``-inf`` and ``-1e3`` as options; ``fp8lab e4m3`` takes them as numbers, in order."""
    assert cli.main(argv) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [r[0] for r in rows] == ["-inf", "-1000", "-0.5", "nan", "465"]
    saturate = "--no-saturate" not in argv
    assert rows[1][1] == ("0xFE" if saturate else "0xFF")  # -1000: -448 saturated, or NaN
    assert rows[2][1] == "0xB0"  # -0.5


def test_a_word_that_is_not_a_number_is_still_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["e4m3", "-x"])
    assert exit_info.value.code == 2
