"""The trainer, recording which rows each rank's batches hold (for tests of epochs and resumes).

Run in place of `-m kembed_trainer` (as a torchrun script): every `train_batch` appends one JSON line
{"step", "epoch", "ids"} to `$KEMBED_TEST_ROWS_DIR/rank<r>-<pid>.jsonl`, the ids being the batch's sparse ids
(a table config with one feature whose column is the row's own number). With `KEMBED_TEST_KILL_AT=<step>`,
rank `KEMBED_TEST_KILL_RANK` (default 1) kills itself with SIGKILL when asked for that step's batch.
"""

from __future__ import annotations

import json
import os
import signal
import sys

from kembed_trainer import __main__ as trainer_main
from kembed_trainer.data import table


def _install() -> None:
    out_dir = os.environ["KEMBED_TEST_ROWS_DIR"]
    rank = int(os.environ.get("RANK", "0"))
    kill_at = int(os.environ.get("KEMBED_TEST_KILL_AT", "-1"))
    kill_rank = int(os.environ.get("KEMBED_TEST_KILL_RANK", "1"))
    path = os.path.join(out_dir, f"rank{rank}-{os.getpid()}.jsonl")
    original = table.TableData.train_batch

    def train_batch(self, step):
        if step == kill_at and rank == kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        epoch = self.stream.epoch_at(step)
        batch = original(self, step)
        with open(path, "a") as f:
            f.write(json.dumps({"step": step, "epoch": epoch, "ids": batch.values.tolist()}) + "\n")
        return batch

    table.TableData.train_batch = train_batch


if __name__ == "__main__":
    _install()
    sys.exit(trainer_main.main())
