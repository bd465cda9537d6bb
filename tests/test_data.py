import numpy as np
import pytest

from cfp.data import ByteCorpus
from cfp.errors import ConfigError


@pytest.fixture(scope="module")
def stdlib():
    return ByteCorpus.from_python_stdlib(seq_len=32, seed=1, max_bytes=500_000)


def test_stdlib_corpus_is_real_python(stdlib):
    assert len(stdlib) == 500_000 and stdlib.vocab_size == 256 and stdlib.num_files > 1
    text = ByteCorpus.decode(stdlib.data[:20_000])
    assert "def " in text and "import " in text


def test_batch_shapes_and_next_byte_targets(stdlib):
    b = stdlib.batch(4, step=0)
    assert set(b) == {"inputs", "targets", "weights"}
    assert b["inputs"].shape == b["targets"].shape == b["weights"].shape == (4, 32)
    assert b["inputs"].dtype == np.int32 and b["targets"].dtype == np.int32 and b["weights"].dtype == np.float32
    assert b["inputs"].min() >= 0 and b["inputs"].max() < 256
    np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
    # each row is a real contiguous window of the corpus
    row = b["inputs"][0].astype(np.uint8).tobytes() + b["targets"][0, -1:].astype(np.uint8).tobytes()
    assert row in stdlib.data.tobytes()


def test_batches_deterministic_in_seed_and_step(stdlib):
    again = ByteCorpus.from_python_stdlib(seq_len=32, seed=1, max_bytes=500_000)
    np.testing.assert_array_equal(stdlib.batch(4, 7)["inputs"], again.batch(4, 7)["inputs"])
    assert not np.array_equal(stdlib.batch(4, 7)["inputs"], stdlib.batch(4, 8)["inputs"])
    other_seed = ByteCorpus(stdlib.data, seq_len=32, seed=2)
    assert not np.array_equal(stdlib.batch(4, 7)["inputs"], other_seed.batch(4, 7)["inputs"])


def test_from_paths_files_and_dirs(tmp_path):
    (tmp_path / "b.txt").write_bytes(b"world")
    (tmp_path / "a.txt").write_bytes(b"hello")
    c = ByteCorpus.from_paths([tmp_path], seq_len=4)
    assert ByteCorpus.decode(c.data) == "hello\nworld\n"  # sorted, newline-joined
    c2 = ByteCorpus.from_paths(tmp_path / "a.txt", seq_len=5)
    b = c2.batch(3, 0)  # only one possible window
    assert ByteCorpus.decode(b["inputs"][0]) == "hello" and ByteCorpus.decode(b["targets"][0]) == "ello\n"


def test_errors_name_the_value(tmp_path):
    with pytest.raises(ConfigError, match="no corpus files"):
        ByteCorpus.from_paths([tmp_path], seq_len=4)
    with pytest.raises(ConfigError, match="does not exist"):
        ByteCorpus.from_paths([tmp_path / "missing"], seq_len=4)
    (tmp_path / "s.txt").write_bytes(b"abc")
    with pytest.raises(ConfigError, match="fewer than seq_len"):
        ByteCorpus.from_paths([tmp_path], seq_len=16)
    with pytest.raises(ConfigError, match="seq_len"):
        ByteCorpus(np.zeros(10, np.uint8), seq_len=0)
    with pytest.raises(ConfigError, match="batch_size"):
        ByteCorpus(np.zeros(10, np.uint8), seq_len=2).batch(0, 0)
