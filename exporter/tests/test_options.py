"""The option tables (`policyd_export.options`): every field of LeRobot 0.6.1's config classes
is classified, each refused value exits 2 naming its field, each exported option names a test
that exists, and docs/export.md shows the tables as they are."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import checkpoints
import pytest
from conftest import ROOT

from policyd_export import options
from policyd_export.registry import SUPPORTED, config_class

#: Each exported policy type's LeRobot config class (the registry's list).
CLASSES = {t: config_class(t) for t in SUPPORTED}


def config_fields(kind: str) -> set[str]:
    import importlib

    module, name = CLASSES[kind].split(":")
    return {f.name for f in dataclasses.fields(getattr(importlib.import_module(module), name))}


def test_the_tables_cover_exactly_the_registrys_types() -> None:
    assert sorted(options.TABLES) == list(SUPPORTED)


@pytest.mark.parametrize("kind", sorted(CLASSES))
def test_every_config_field_is_classified(kind: str) -> None:
    fields, table = config_fields(kind), set(options.TABLES[kind])
    assert not fields - table, f"{kind}: fields nobody decided about: {sorted(fields - table)}"
    assert not table - fields, f"{kind}: not fields of LeRobot's config: {sorted(table - fields)}"


#: `test_file.py` or `test_file.py::test_name` (a name cut with … is a prefix).
NAMED_TEST = r"`(test_\w+\.py)(?:::(test_\w+?)(?:…)?)?`"


def test_each_exported_option_names_a_test_that_exists() -> None:
    tests = {p.name: p.read_text() for p in (ROOT / "exporter/tests").glob("test_*.py")}
    named = 0
    for kind, table in options.TABLES.items():
        for name, option in table.items():
            for file, function in re.findall(
                r"`(test_\w+\.py)(?:::(test_\w+?)(?:…)?)?`", option.note
            ):
                named += 1
                assert file in tests, f"{kind}.{name}: {file} does not exist"
                if function:
                    assert f"def {function}" in tests[file], f"{kind}.{name}: no {function}"
    assert named >= 20, f"only {named} tests named: the pattern no longer matches the notes"


def test_docs_show_the_tables() -> None:
    docs = (ROOT / "docs/export.md").read_text()
    for kind in options.TABLES:
        assert options.markdown(kind) in docs, f"docs/export.md: the {kind} table is stale"


#: A value of each refused field that the bundle cannot reproduce.
REFUSED = {
    "act": {"temporal_ensemble_coeff": 0.01, "use_peft": True},
    "diffusion": {"use_peft": True},
    "pi0": {"dtype": "bfloat16", "use_peft": True},
    "smolvla": {
        "adapt_to_pi_aloha": True,
        "use_delta_joint_actions_aloha": True,
        "use_peft": True,
    },
}


def test_the_refusal_list_covers_the_tables() -> None:
    for kind in REFUSED:
        refused = {n for n, o in options.TABLES[kind].items() if o.kind == options.REFUSED}
        assert refused == set(REFUSED[kind]), kind


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("options")
    with checkpoints.tiny_pi0():
        tokenizer = checkpoints.gemma_tokenizer(root / "tokenizer")
        pi0 = checkpoints.pi0(root / "pi0", tokenizer)
    vlm = checkpoints.tiny_smolvlm(root / "vlm")
    return {
        "act": checkpoints.act(root / "act"),
        "diffusion": checkpoints.diffusion(root / "diffusion"),
        "pi0": pi0,
        "smolvla": checkpoints.smolvla(root / "smolvla", vlm),
    }


@pytest.mark.parametrize(
    ("kind", "field"), [(k, f) for k, fields in REFUSED.items() for f in fields]
)
def test_a_refused_option_exits_2_naming_the_field(
    kind: str,
    field: str,
    made: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """In this process (the command's `main`, as the console script calls it): a process per
    case spent 20 s importing torch to print one line."""
    from policyd_export.cli import main

    ckpt = tmp_path / "checkpoint"
    shutil.copytree(made[kind], ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    assert field in config, f"{kind} checkpoints write {field}"
    config[field] = REFUSED[kind][field]
    (ckpt / "config.json").write_text(json.dumps(config))
    code = main(["lerobot", str(ckpt), "--out", str(tmp_path / "bundle")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"{field} = " in err and "not exported" in err, err
