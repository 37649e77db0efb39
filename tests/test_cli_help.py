"""Every subcommand prints its help (argparse formats every option's text, so one stray % breaks it)."""

import pytest


@pytest.mark.parametrize("command", ["advise", "plan", "bench", "convert", "export-hf"])
def test_every_subcommand_prints_its_help(command, capsys):
    from rlplacement.cli import main

    with pytest.raises(SystemExit) as done:  # argparse's help formats every option's text ("~1-3%" broke it once)
        main([command, "--help"])
    assert done.value.code == 0
    assert "usage:" in capsys.readouterr().out
