"""docs/config.md is generated from runtime/config.py (runtime.config_doc) and must match the schema."""

from __future__ import annotations

import typing

from pydantic import BaseModel, Field

from runtime import config_doc
from runtime.config import Config, Section


def test_docs_config_md_is_current():
    text = config_doc.DOC_PATH.read_text()
    assert text == config_doc.render(), (
        "docs/config.md is stale: regenerate it with `python -m runtime.config_doc > docs/config.md`")


def test_check_flag_fails_on_a_stale_file(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "config.md"
    stale.write_text(config_doc.render().replace("`parallelism.ep`", "`parallelism.experts`"))
    monkeypatch.setattr(config_doc, "DOC_PATH", stale)
    assert config_doc.main(["--check"]) == 1
    assert "stale" in capsys.readouterr().err
    stale.write_text(config_doc.render())
    assert config_doc.main(["--check"]) == 0


def _sections(model: type[BaseModel], path: str = ""):
    for name, field in model.model_fields.items():
        key = f"{path}{name}"
        subs = [a for a in (field.annotation, *typing.get_args(field.annotation))
                if isinstance(a, type) and issubclass(a, BaseModel)]
        yield key, field
        if subs:
            yield from _sections(subs[0], f"{key}.")


def test_every_key_is_documented_with_type_and_default():
    text = config_doc.render()
    for key, field in _sections(Config):
        if "." not in key:
            assert f"\n## {key}\n" in text, f"section {key} missing from docs/config.md"
            continue
        row = next((line for line in text.splitlines() if line.startswith(f"| `{key}` |")), None)
        assert row is not None, f"{key} missing from docs/config.md"
        description = row.split(" | ")[3]
        assert description.strip(" |"), f"{key} has no description: add Field(description=...) in runtime/config.py"


def test_registry_choices_and_literal_types_are_listed():
    rows = {line.split(" | ")[0].strip("| `"): line for line in config_doc.render().splitlines()
            if line.startswith("| `")}
    assert "scattermoe" in rows["model.expert_backend"] and "grouped_mm" in rows["model.expert_backend"]
    assert "all_to_all" in rows["parallelism.dispatcher"]
    assert "heads \\| state" in rows["parallelism.cp_gdn"]
    assert "| required |" in rows["data.path"]
    assert "`600`" in rows["parallelism.collective_timeout_s"]


class _Commented(Section):
    """A section documented by comments only."""

    # Two comment lines above the key
    # are joined into its description.
    above: int = 1
    inline: bool = False  # a comment on the key's own line
    described: str = Field("x", description="the Field description wins")  # not this comment


def test_keys_without_a_description_fall_back_to_their_comments():
    out: list[str] = []
    config_doc._section(_Commented, "demo", out)
    rows = {line.split(" | ")[0].strip("| `"): line for line in out if line.startswith("| `")}
    assert "Two comment lines above the key are joined into its description." in rows["demo.above"]
    assert "a comment on the key's own line" in rows["demo.inline"]
    assert "the Field description wins" in rows["demo.described"]
    assert "not this comment" not in rows["demo.described"]
    assert "A section documented by comments only." in out
