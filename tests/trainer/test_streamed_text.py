"""Streamed text data (word2vec): every epoch visits each training sentence once across ranks, in a new order, also
across a resume mid-epoch at the same or another world size; the vocabulary the in-memory reader built; a bounded
vocabulary pass; long lines; bad text named by its file."""

from __future__ import annotations

import collections
import pathlib

import numpy as np
import pytest

from kembed_contract import runtime
from kembed_contract import trainer_config as config
from kembed_trainer.data import text
from kembed_trainer.data.rows import unit_hash
from kembed_trainer.storage import Guard
from tests.trainer.conftest import run_trainer_to_its_reason, tiny_config, write_config
from tests.trainer.test_streamed_data import epochs_of, recorded, run_recorded

WORDS = [f"w{i:02d}" for i in range(60)]


def write_sentences(folder: pathlib.Path, num_sentences: int, *, files: int = 4) -> list[str]:
    """Files of distinct sentences whose words are all frequent (each line starts with its number in base 60,
    then 2 to 7 more words), with blank and one-word lines between, which train nothing. The corpus's lines."""
    rng = np.random.default_rng(0)
    lines = []
    for i in range(num_sentences):
        digits = [WORDS[i // 3600 % 60], WORDS[i // 60 % 60], WORDS[i % 60]]
        lines.append(" ".join(digits + list(rng.choice(WORDS, rng.integers(2, 8)))))
        if i % 97 == 0:
            lines += ["", "   ", WORDS[i % 60]]
    folder.mkdir(parents=True, exist_ok=True)
    per_file = -(-len(lines) // files)
    for k in range(files):
        newline = "\r\n" if k == 1 else "\n"  # one file with Windows line ends
        (folder / f"part-{k}.txt").write_text(newline.join(lines[k * per_file : (k + 1) * per_file]) + newline,
                                              encoding="utf-8", newline="")
    return lines


def held_out(lines: list[str], fraction: float) -> list[bool]:
    """Which of the corpus's non-empty lines are held out: a hash of its number among them (the in-memory reader's)."""
    sentences = [line for line in lines if line.split()]
    return (unit_hash(np.arange(len(sentences), dtype=np.uint64)) < fraction).tolist()


def training_sentences(lines: list[str], fraction: float) -> list[str]:
    sentences = [line for line in lines if line.split()]
    return [s for s, h in zip(sentences, held_out(lines, fraction), strict=True) if not h and len(s.split()) >= 2]


def text_data(folder, rank, world_size, *, batch_size=50, tables=None, **data) -> text.TextData:
    cfg = config.TextDataConfig.model_validate({"kind": "text", "uri": str(folder), "min_count": 1,
                                                "shuffle_buffer": 300, "eval_fraction": 0.1, **data})
    tables = tables or [config.TableConfig(name=n, num_embeddings=100, embedding_dim=4, features=[f])
                        for n, f in (("words_in", "center"), ("words_out", "context"))]
    return text.TextData(cfg, tables=tables, seed=0, batch_size=batch_size, rank=rank, world_size=world_size,
                         guard=Guard(None))


def as_text(data: text.TextData, ids: np.ndarray, offsets: np.ndarray) -> list[str]:
    return [" ".join(data.vocab[t] for t in ids[a:b]) for a, b in zip(offsets[:-1], offsets[1:], strict=True)]


# ----------------------------------------------------------------------------------------------- the reader
def test_streamed_epochs_visit_each_training_sentence_once_in_a_new_order(tmp_path, monkeypatch):
    monkeypatch.setattr(text, "TEXT_BLOCK_BYTES", 2048)  # many blocks of lines per file
    lines = write_sentences(tmp_path / "corpus", 1200)
    ranks = [text_data(tmp_path / "corpus", r, 2) for r in range(2)]
    assert ranks[0].vocab == ranks[1].vocab and sorted(ranks[0].vocab) == WORDS  # every rank counted it all
    assert len(ranks[0].blocks) >= 16
    epochs, steps = [], []
    step = 0
    for _ in range(2):
        seen = []
        for _ in range(ranks[0].steps_per_epoch):
            for data in ranks:
                taken = as_text(data, *data.train_sentences(step))
                steps.append(taken)
                seen += taken
            step += 1
        epochs.append(seen)
    expected = training_sentences(lines, 0.1)
    assert 1000 < len(expected) < 1150  # about 10 % held out
    for seen in epochs:
        assert sorted(seen) == sorted(expected)  # each once, none held out
    assert epochs[0] != epochs[1]
    # Not the file's order: the blocks in an order drawn per epoch, the sentences permuted within windows.
    number = lambda sentence: WORDS.index(sentence.split()[1]) * 60 + WORDS.index(sentence.split()[2])  # noqa: E731
    first_step = [number(s) for s in steps[0]]
    assert first_step != sorted(first_step)
    rank0_starts = [number(taken[0]) for taken in steps[0 : 2 * ranks[0].steps_per_epoch : 2]]
    assert rank0_starts != sorted(rank0_starts)
    assert 40 <= np.mean([sum(len(s.split()) for s in taken) for taken in steps]) <= 60  # ~batch_size words
    counts = [data.counts() for data in ranks]
    assert sum(c["train_sentences"] for c in counts) == len(expected)
    assert sum(c["eval_sentences"] for c in counts) == sum(held_out(lines, 0.1))
    for data in ranks:
        data.close()


def old_vocabulary(folder: pathlib.Path, tokenizer: str, fraction: float, min_count: int, size: int) -> list[str]:
    """The vocabulary as the in-memory reader built it: every sentence read into lists, held-out ones left out."""
    sentences = []
    for path in sorted(folder.iterdir()):
        with open(path, encoding="utf-8") as f:
            sentences.extend(tokens for line in f if (tokens := text.tokenize(line, tokenizer)))
    is_eval = unit_hash(np.arange(len(sentences), dtype=np.uint64)) < fraction
    counts = collections.Counter(t for s, e in zip(sentences, is_eval, strict=True) if not e for t in s)
    return sorted((w for w, c in counts.items() if c >= min_count), key=lambda w: (-counts[w], w))[:size]


@pytest.mark.parametrize(("tokenizer", "fraction", "min_count", "size"), [
    pytest.param("whitespace", 0.2, 3, 1000, id="words"),
    pytest.param("whitespace", 0.0, 1, 150, id="words-capped-by-the-tables"),
    pytest.param("chars", 0.3, 2, 1000, id="chars"),
])
def test_the_vocabulary_is_the_one_the_in_memory_reader_built(tmp_path, monkeypatch, tokenizer, fraction, min_count,
                                                              size):
    monkeypatch.setattr(text, "TEXT_BLOCK_BYTES", 1024)
    rng = np.random.default_rng(1)
    zipf = [f"z{i}" for i in range(400)]
    weights = 1 / np.arange(1, 401)
    lines = [" ".join(rng.choice(zipf, rng.integers(1, 12), p=weights / weights.sum())) for _ in range(3000)]
    lines[5::50] = ["我们今天学习 中文" for _ in lines[5::50]]
    write_sentences(tmp_path / "corpus", 0, files=1)  # an empty file among them
    for k in range(3):
        (tmp_path / "corpus" / f"z-{k}.txt").write_text("\n\n".join(lines[k::3]) + "\n", encoding="utf-8")
    expected = old_vocabulary(tmp_path / "corpus", tokenizer, fraction, min_count, size)
    tables = [config.TableConfig(name=n, num_embeddings=size, embedding_dim=4, features=[f])
              for n, f in (("words_in", "center"), ("words_out", "context"))]
    data = text_data(tmp_path / "corpus", 0, 1, tables=tables, tokenizer=tokenizer, eval_fraction=fraction,
                     min_count=min_count)
    assert len(expected) > 10 and data.vocab == expected
    data.close()


def test_the_vocabulary_pass_keeps_at_most_max_vocab_size_words(tmp_path, monkeypatch):
    """A corpus of a few frequent words and thousands seen once: with a small bound the counter drops the rare ones
    as it goes, never holding more than the bound after a block, and the frequent words still make the
    vocabulary."""
    monkeypatch.setattr(text, "TEXT_BLOCK_BYTES", 1024)  # the counter's size seen after each block
    rng = np.random.default_rng(2)
    frequent = [f"f{i}" for i in range(20)]
    lines = [" ".join([*rng.choice(frequent, 6), f"rare{i}"]) for i in range(3000)]
    (tmp_path / "corpus.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    sizes = []
    original = text._WordCounts.add

    def add(self, tokens):
        original(self, tokens)
        sizes.append(len(self.counts))

    monkeypatch.setattr(text._WordCounts, "add", add)
    data = text_data(tmp_path / "corpus.txt", 0, 1, max_vocab_size=100, min_count=2, eval_fraction=0)
    assert sorted(data.vocab) == sorted(frequent)
    assert max(sizes) <= 100
    exact = text_data(tmp_path / "corpus.txt", 0, 1, min_count=2, eval_fraction=0)
    assert exact.vocab == data.vocab  # the frequent words' order survives the pruning
    for d in (data, exact):
        d.close()


def test_long_lines_train_as_sentences_of_at_most_10000_words(tmp_path, monkeypatch):
    words = [WORDS[i % 60] for i in range(25_001)]
    (tmp_path / "long.txt").write_text(" ".join(words) + "\n" + " ".join(WORDS[:5]) + "\n", encoding="utf-8")
    data = text_data(tmp_path / "long.txt", 0, 1, eval_fraction=0, batch_size=100_000)
    ids, offsets = data.train_sentences(0)
    assert sorted(np.diff(offsets).tolist()) == [5, 5001, 10_000, 10_000]
    data.close()
    # A line longer than a block is cut at a space between blocks first: every word still trains once.
    monkeypatch.setattr(text, "TEXT_BLOCK_BYTES", 4096)
    data = text_data(tmp_path / "long.txt", 0, 1, eval_fraction=0, batch_size=100_000)
    ids, offsets = data.train_sentences(0)
    assert len(ids) == 25_006 and np.diff(offsets).max() <= 1024 and len(data.blocks) > 20
    assert collections.Counter(data.vocab[t] for t in ids) == collections.Counter(words + WORDS[:5])
    data.close()


def test_text_that_is_not_utf8_fails_naming_the_file_and_line_not_the_bytes(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("\n".join(" ".join(WORDS[i : i + 5]) for i in range(50)) + "\n")
    (tmp_path / "corpus" / "b.txt").write_bytes(b"w01 w02 w03\nw04 w05\nSECRET w06 \xff\xfe w07\nw08 w09\n")
    cfg = w2v_config(tmp_path / "corpus", f"file://{tmp_path}/ckpt")
    code, reason, stderr = run_trainer_to_its_reason(write_config(tmp_path / "c.yaml", cfg))
    assert code == runtime.EXIT_BAD_CONFIG, stderr
    assert reason == f"data error: data.uri: file://{tmp_path.resolve()}/corpus/b.txt line 3 is not UTF-8 text"
    assert "SECRET" not in stderr


# ----------------------------------------------------------------------------------------------- the trainer
def w2v_config(corpus: pathlib.Path, ckpt_uri: str) -> dict:
    cfg = tiny_config(
        model={"kind": "word2vec"},
        embeddings={"tables": [
            {"name": "words_in", "num_embeddings": 100, "embedding_dim": 8, "features": ["center"]},
            {"name": "words_out", "num_embeddings": 100, "embedding_dim": 8, "features": ["context"]},
        ]},
        data={"kind": "text", "uri": str(corpus), "min_count": 1, "window": 2, "negatives": 2,
              "shuffle_buffer": 500, "eval_fraction": 0.1},
        training={"steps": None, "epochs": 3, "batch_size": 200, "log_every": 1, "threads": 1},
        checkpoint={"uri": ckpt_uri, "every_steps": 3, "keep": 10},
    )
    del cfg["optimizer"]  # word2vec's own (SGD, as gensim)
    return cfg


@pytest.mark.parametrize(("first", "then"), [pytest.param(2, 2, id="2-to-2"), pytest.param(2, 1, id="2-to-1"),
                                             pytest.param(1, 2, id="1-to-2")])
def test_a_rank_killed_mid_epoch_resumes_the_epoch_with_each_sentence_once(tmp_path, first, then):
    lines = write_sentences(tmp_path / "corpus", 1500)
    expected = sorted(training_sentences(lines, 0.1))
    straight_cfg = write_config(tmp_path / "straight.yaml", w2v_config(tmp_path / "corpus", f"file://{tmp_path}/a"))
    code, straight_recs, stderr = run_recorded(straight_cfg, first, tmp_path / "straight")
    assert code == 0, stderr
    straight = epochs_of(list(recorded(tmp_path / "straight").values()))
    assert sorted(straight) == [0, 1, 2]
    assert all(sorted(sentences) == expected for sentences in straight.values())
    assert straight[0] != straight[1]  # a new order each epoch
    assert straight_recs[0]["dataset"]["train_sentences"] == len(expected)

    cfg = write_config(tmp_path / "killed.yaml", w2v_config(tmp_path / "corpus", f"file://{tmp_path}/b"))
    per_epoch = straight_recs[0]["total_steps"] // 3
    kill_at = per_epoch + per_epoch // 2 + 1  # mid-way through the second epoch
    code, _, stderr = run_recorded(cfg, first, tmp_path / "killed", KEMBED_TEST_KILL_AT=str(kill_at),
                                   KEMBED_TEST_KILL_RANK=str(first - 1))
    assert code == (128 + 9 if first > 1 else -9), stderr  # the launcher's code for a killed rank, or the signal
    code, resumed_recs, stderr = run_recorded(cfg, then, tmp_path / "resumed")
    assert code == 0, stderr
    resumed_at = resumed_recs[0]["step"]
    assert per_epoch < resumed_at < kill_at  # resumed mid-epoch, from a checkpoint before the kill
    # What the killed run trained after its checkpoint is lost with it: the resumed run retrains from there.
    killed = [{s: v for s, v in steps.items() if s < resumed_at} for steps in recorded(tmp_path / "killed").values()]
    together = epochs_of(killed + list(recorded(tmp_path / "resumed").values()))
    assert sorted(together) == [0, 1, 2]
    for epoch, sentences in together.items():
        assert sorted(sentences) == expected, f"epoch {epoch}"
    assert resumed_recs[-1]["step"] == resumed_recs[0]["total_steps"]
    if first == then:  # the same steps and, one thread per rank, the same losses bit for bit
        losses = {r["step"]: r["loss"] for r in straight_recs if r["event"] == "progress"}
        again = {r["step"]: r["loss"] for r in resumed_recs if r["event"] == "progress"}
        assert again == {s: losses[s] for s in again} and max(again) == max(losses)
