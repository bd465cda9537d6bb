"""Sequence units of real text: a Python file's docstrings (`Unit.DOCSTRING`, the English-prose corpus)."""
import numpy as np

from cfp.data.sources import Unit, docstrings, load_sequences

SOURCE = b'''"""Module doc."""
import os


class Thing:
    """Class doc,
        indented."""

    def method(self):
        """Method doc."""
        def inner():
            """Inner doc."""
        return 1

    def bare(self):
        return "not a docstring"


async def run():
    """Async doc."""
'''


def test_docstrings_of_module_classes_and_functions_cleaned():
    got = [d.decode() for d in docstrings(SOURCE)]
    assert sorted(got) == sorted(["Module doc.", "Class doc,\nindented.", "Method doc.", "Inner doc.",
                                  "Async doc."])
    assert docstrings(b"def broken(:\n") == []


def test_docstring_unit_of_a_folder(tmp_path):
    (tmp_path / "a.py").write_bytes(SOURCE)
    (tmp_path / "b.py").write_bytes(b'"""x"""\n')          # one byte: no prediction, no sequence
    seqs = load_sequences(str(tmp_path), unit=Unit.DOCSTRING, max_seq_len=8)
    assert sorted(bytes(t).decode() for t in seqs.tokens) == sorted(
        ["Module do", "Class doc", "Method do", "Inner doc", "Async doc"])
    assert (seqs.lengths == 8).all() and np.all([t.dtype == np.uint8 for t in seqs.tokens])
