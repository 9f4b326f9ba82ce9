"""quant/settings.py: every BRISK_ variable declared there and read through it, docs/configuration.md
its current table, values read as the code always read them, a bad one a clear error."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from brisk.quant import settings

ROOT = Path(__file__).resolve().parent.parent


def test_docs_table_is_current():
    """docs/configuration.md is generated: `python -m brisk.quant.settings > docs/configuration.md`."""
    assert (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8") == settings.markdown()


def test_every_variable_is_declared_once_and_read_only_through_settings():
    names = [s.name for s in settings.ALL]
    assert len(names) == len(set(names)) and all(n.startswith("BRISK_") for n in names)
    readers = re.compile(r"""(environ|getenv)\W[^\n]*["']BRISK_""")
    for folder in ("cli", "core", "quant"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name != "settings.py":
                assert not readers.search(path.read_text(encoding="utf-8")), path


@pytest.mark.parametrize("setting, raw, value", [
    (settings.NATIVE, None, True), (settings.NATIVE, "0", False), (settings.NATIVE, "", True),
    (settings.NATIVE, "off", True),  # a switch is off only at 0, as it always was
    (settings.DEBUG, None, False), (settings.DEBUG, "", False), (settings.DEBUG, "0", True),
    (settings.THREADS, None, 0), (settings.THREADS, "3", 3), (settings.NATIVE_LEVEL, None, None),
    (settings.ACT8_SPLIT, "1e-3", 1e-3), (settings.ACT8_OUTLIERS, None, 2.5e-4),
    (settings.CUDA_INT4, "planes", "planes"), (settings.CACHE, None, None), (settings.CACHE, "/c", "/c"),
])
def test_values_read_as_before(setting, raw, value, monkeypatch):
    if raw is None:
        monkeypatch.delenv(setting.name, raising=False)
    else:
        monkeypatch.setenv(setting.name, raw)
    assert setting.get() == value


@pytest.mark.parametrize("setting, raw", [(settings.THREADS, "x"), (settings.BLAS_THREADS, "1.5"),
                                          (settings.ACT8_OUTLIERS, "lots"), (settings.CUDA_INT4, "cutlass")])
def test_a_bad_value_names_the_variable(setting, raw, monkeypatch):
    monkeypatch.setenv(setting.name, raw)
    with pytest.raises(settings.SettingError) as e:
        setting.get()
    message = str(e.value)
    assert message.startswith(f"{setting.name}={raw!r} is not ") and "\n" not in message
