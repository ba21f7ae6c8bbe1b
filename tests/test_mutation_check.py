"""The mutation check (tests/mutation_check.py) stays applicable: every mutant's old string is still in its file
exactly once, so a refactor that moves the code fails here, in every run, not in the slow check months later."""

import pytest

from tests.mutation_check import BY_NAME, MUTANTS, ROOT, MutantRotted, apply, main


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_every_mutant_still_applies_exactly_once(mutant, tmp_path):
    for patch in mutant.patches:
        assert patch.old != patch.new
        (tmp_path / patch.path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / patch.path).write_text((ROOT / patch.path).read_text())
    apply(mutant, tmp_path)  # raises MutantRotted where an old string is missing or repeated
    for patch in mutant.patches:
        assert patch.new in (tmp_path / patch.path).read_text()
    for test in mutant.tests:
        assert (ROOT / test).is_file(), test


def test_a_moved_old_string_fails_loudly_and_the_working_tree_is_never_mutated(tmp_path):
    mutant = BY_NAME["accept_wrong_draft"]
    (tmp_path / "clover").mkdir()
    (tmp_path / "clover" / "verify.py").write_text("the code moved\n")
    with pytest.raises(MutantRotted, match="occurs 0 times"):
        apply(mutant, tmp_path)
    with pytest.raises(RuntimeError, match="refusing to mutate the working tree"):
        apply(mutant, ROOT)


def test_list_names_every_mutant(capsys):
    assert main(["--list"]) == 0
    listed = capsys.readouterr().out
    assert all(m.name in listed for m in MUTANTS)
