"""The trainer, recording which rows (or sentences) each rank's steps hold (for tests of epochs and resumes).

Run in place of `-m kembed_trainer` (as a torchrun script): every step appends one JSON line {"step", "epoch",
"ids"} to `$KEMBED_TEST_ROWS_DIR/rank<r>-<pid>.jsonl`. Table data: the ids are the batch's sparse ids (a table
config with one feature whose column is the row's own number); synthetic data: its sparse ids too. Text data:
the step's sentences, each as its words joined by spaces (a corpus whose words are all in the vocabulary, so a
sentence reads as its line). With
`KEMBED_TEST_KILL_AT=<step>`, rank `KEMBED_TEST_KILL_RANK` (default 1) kills itself with SIGKILL when asked for
that step's data; with `KEMBED_TEST_KILL_WHEN=<path>` too, at the first step from there on at which that file
exists (a checkpoint's marker: a save in the background lands some steps after it began)."""

from __future__ import annotations

import json
import os
import signal
import sys

from kembed_trainer import __main__ as trainer_main
from kembed_trainer.data import synthetic, table, text


def _install() -> None:
    out_dir = os.environ["KEMBED_TEST_ROWS_DIR"]
    rank = int(os.environ.get("RANK", "0"))
    kill_at = int(os.environ.get("KEMBED_TEST_KILL_AT", "-1"))
    kill_rank = int(os.environ.get("KEMBED_TEST_KILL_RANK", "1"))
    kill_when = os.environ.get("KEMBED_TEST_KILL_WHEN")
    path = os.path.join(out_dir, f"rank{rank}-{os.getpid()}.jsonl")

    def record(original, as_ids):
        def recorded(self, step):
            due = step == kill_at if kill_when is None else step >= kill_at and os.path.exists(kill_when)
            if due and rank == kill_rank:
                os.kill(os.getpid(), signal.SIGKILL)
            stream = getattr(self, "stream", None)  # synthetic data has no epochs
            epoch = stream.epoch_at(step) if stream is not None else None
            out = original(self, step)
            with open(path, "a") as f:
                f.write(json.dumps({"step": step, "epoch": epoch, "ids": as_ids(self, out)}) + "\n")
            return out

        return recorded

    table.TableData.train_batch = record(table.TableData.train_batch, lambda data, batch: batch.values.tolist())
    synthetic.SyntheticData.train_batch = record(synthetic.SyntheticData.train_batch,
                                                 lambda data, batch: batch.values.tolist())
    text.TextData.train_sentences = record(text.TextData.train_sentences, lambda data, sentences: [
        " ".join(data.vocab[t] for t in sentences[0][a:b])
        for a, b in zip(sentences[1][:-1].tolist(), sentences[1][1:].tolist(), strict=True)])


if __name__ == "__main__":
    _install()
    sys.exit(trainer_main.main())
