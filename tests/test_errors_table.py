"""docs/errors.md's bad-input table is the one the entry points print: every row is run again through
its entry point (tests/errors_table.py) and compared with the document's line, so the table
cannot drift from the messages; the document holds no row the module does not make."""
import pytest

from errors_table import (BEGIN, DOC, END, HEADER, Row, TableError, cli, doc_table, make_line, replace_table,
                          row_head, rows)

pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py

ROWS = rows()


def _doc_lines() -> list[str]:
    return doc_table(DOC.read_text()).splitlines()


def test_the_doc_holds_exactly_the_rows_of_the_table():
    lines = _doc_lines()
    assert tuple(lines[:2]) == HEADER
    heads = [ln[:len(row_head(r))] for ln, r in zip(lines[2:], ROWS)]
    assert heads == [row_head(r) for r in ROWS], "docs/errors.md's rows differ: python tests/errors_table.py --write"
    assert len(lines) == 2 + len(ROWS), "docs/errors.md has rows the table does not make"
    assert len({row_head(r) for r in ROWS}) == len(ROWS), "two rows with the same situation and entry point"


@pytest.mark.parametrize("i", range(len(ROWS)), ids=[f"{i:02d}-{r.situation[:40]}" for i, r in enumerate(ROWS)])
def test_each_doc_row_is_the_message_printed(i):
    lines = _doc_lines()
    want = make_line(ROWS[i])
    assert 2 + i < len(lines) and lines[2 + i] == want, (
        f"docs/errors.md's row differs from what {ROWS[i].where!r} printed:\n  doc: "
        f"{lines[2 + i] if 2 + i < len(lines) else None}\n  printed: {want}\n"
        f"(python tests/errors_table.py --write rewrites the table)")


def test_a_row_that_does_not_exit_2_with_one_line_is_an_error_of_the_table(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TableError, match=r"expected exit 2 and one line 'kda-verify backends: error: \.\.\.', got exit 0"):
        cli(["backends"])
    with pytest.raises(TableError, match=r"expected exit 2 and one line 'kda-verify oracle: error: \.\.\.', "
                                         r"got exit 2 and \['usage: kda-verify oracle"):
        cli(["oracle", "--bogus"])                                   # argparse: usage and error, two lines
    with pytest.raises(TableError, match=r"expected an input it names alike to print the same message, got "
                                         r"\"--shapes: expected BxTxH"):
        make_line(Row("alike but not the same", "x", lambda: cli(["run", "--suite", "nope", "--backend", "emulator",
                                                                  "--out", "R"]),
                      alike=((None, lambda: cli(["oracle-bench", "--shapes", "1x2", "--device", "cpu"])),)))
    with pytest.raises(TableError, match=r"expected '\(Safe' in the message"):
        make_line(Row("quoted text absent", "x", lambda: "plain message", quoted="(Safe"))


def test_the_table_is_replaced_between_its_markers_only():
    text = f"# t\n\nbefore\n\n{BEGIN}\n| old |\n{END}\n\nafter\n"
    new = replace_table(text, "| new |\n")
    assert new == f"# t\n\nbefore\n\n{BEGIN}\n| new |\n{END}\n\nafter\n"
    assert doc_table(new) == "| new |\n"
    with pytest.raises(TableError, match="expected the markers"):
        doc_table("no markers")
