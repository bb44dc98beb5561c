"""kda_ref.files: the one reader of the safetensors files a user names, and its one-line errors."""
import pytest
import torch
from safetensors.torch import save_file

from kda_ref.files import UnreadableFile, read_safetensors


def test_a_file_reads_whole_with_its_metadata(tmp_path):
    f = tmp_path / "x.safetensors"
    save_file({"a": torch.arange(3.0), "b": torch.ones(2, dtype=torch.int32)}, str(f), metadata={"format": "x/1"})
    tensors, meta = read_safetensors(f)                    # a Path as well as a str
    assert sorted(tensors) == ["a", "b"] and torch.equal(tensors["a"], torch.arange(3.0))
    assert meta == {"format": "x/1"}


def test_a_missing_file_says_so_in_one_line(tmp_path):
    with pytest.raises(UnreadableFile) as e:
        read_safetensors(str(tmp_path / "none.safetensors"))
    assert e.value.missing and e.value.reason == "no such file"
    assert e.value.line("inputs") == (f"inputs: expected an existing safetensors file, got "
                                      f"{str(tmp_path / 'none.safetensors')!r} (no such file)")


def test_a_file_that_does_not_parse_names_the_parser_error(tmp_path):
    f = tmp_path / "junk.safetensors"
    f.write_bytes(b"\x00" * 3 + b"not a safetensors file\nsecond line")
    with pytest.raises(UnreadableFile) as e:
        read_safetensors(str(f))
    assert not e.value.missing and ":" in e.value.reason and "\n" not in e.value.reason
    line = e.value.line("outputs")
    assert line.startswith(f"outputs: expected a safetensors file, got {str(f)!r} that cannot be read (")
    assert "\n" not in line
