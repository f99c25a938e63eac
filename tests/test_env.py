"""The on/off switches of the environment (loom/env.py): one parser, the usual words, and an error for the rest."""

from __future__ import annotations

import pytest

from loom.env import env_flag

NAME = "LOOM_TEST_SWITCH"


@pytest.mark.parametrize("value", ["1", "true", "True", "YES", "on", " On "])
def test_on_values(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(NAME, value)
    assert env_flag(NAME, False) is True


@pytest.mark.parametrize("value", ["0", "false", "FALSE", "no", "off", "Off\n"])
def test_off_values(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """"off" and "false" used to leave a switch on: only exactly "0" turned one off."""
    monkeypatch.setenv(NAME, value)
    assert env_flag(NAME, True) is False


@pytest.mark.parametrize("default", [True, False])
def test_unset_or_empty_is_the_default(monkeypatch: pytest.MonkeyPatch, default: bool) -> None:
    monkeypatch.delenv(NAME, raising=False)
    assert env_flag(NAME, default) is default
    for empty in ("", "  "):
        monkeypatch.setenv(NAME, empty)
        assert env_flag(NAME, default) is default


@pytest.mark.parametrize("value", ["2", "enabled", "nope", "0x0", "o"])
def test_anything_else_is_an_error_naming_the_variable_and_the_values(monkeypatch: pytest.MonkeyPatch,
                                                                     value: str) -> None:
    monkeypatch.setenv(NAME, value)
    with pytest.raises(ValueError) as info:
        env_flag(NAME, True)
    message = str(info.value)
    assert f"{NAME}={value!r}" in message
    assert all(word in message for word in ("1", "true", "yes", "on", "0", "false", "no", "off")), message


def test_the_cli_checks_every_switch_at_start_even_one_it_would_not_read(monkeypatch, capsys) -> None:
    """LOOM_SPARSE_DECODE_STEP=maybe was accepted unless block-sparse decode ran (fresh-user trial); SWITCHES
    lists every switch, so the check cannot miss one that the code reads."""
    import re
    from pathlib import Path

    import loom.cli
    from loom.env import SWITCHES

    read = set(re.findall(r'env_flag\("(LOOM_[A-Z_]+)"', "".join(
        p.read_text() for p in Path(loom.cli.__file__).parent.rglob("*.py"))))
    assert read == set(SWITCHES)
    monkeypatch.setenv("LOOM_SPARSE_DECODE_STEP", "maybe")
    with pytest.raises(SystemExit) as exit_info:
        loom.cli.main(["generate", "hi"])
    assert exit_info.value.code == 2
    assert "LOOM_SPARSE_DECODE_STEP='maybe' is not an on/off value" in capsys.readouterr().err


def test_the_python_api_checks_every_switch_before_loading(monkeypatch) -> None:
    """loom.LLM (and the server's engine) took LOOM_SPARSE_DECODE_STEP=maybe unless block-sparse decode ran: only
    the CLI checked; EngineArgs checks now, before any model is read."""
    from loom.config import EngineArgs

    monkeypatch.setenv("LOOM_SPARSE_DECODE_STEP", "maybe")
    with pytest.raises(ValueError, match="LOOM_SPARSE_DECODE_STEP='maybe' is not an on/off value"):
        EngineArgs(model="/nonexistent/model.gguf")


def test_the_isa_cap_takes_any_case(monkeypatch) -> None:
    from loom.kernels.registry import kernel_isas

    monkeypatch.setenv("LOOM_CPU_ISA", " GENERIC ")
    assert set(kernel_isas("qgemm")) <= {"generic"}


def test_a_bad_isa_cap_is_refused_at_start(monkeypatch, capsys) -> None:
    """LOOM_CPU_ISA=avx9000 was refused only when the first kernel loaded, after torch and the model (~3 s, the
    fresh-user trial); check_switches refuses it with the on/off switches, in the CLI and in EngineArgs."""
    import loom.cli
    from loom.config import EngineArgs

    monkeypatch.setenv("LOOM_CPU_ISA", "avx9000")
    with pytest.raises(SystemExit) as exit_info:
        loom.cli.main(["generate", "hi"])
    assert exit_info.value.code == 2
    assert "LOOM_CPU_ISA='avx9000' is not an ISA" in capsys.readouterr().err
    with pytest.raises(ValueError, match="LOOM_CPU_ISA='avx9000' is not an ISA"):
        EngineArgs(model="/nonexistent/model.gguf")
