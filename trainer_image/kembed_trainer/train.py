"""The training loop: restore, then (step, log, evaluate, checkpoint) until done or told to stop."""

from __future__ import annotations

import os
import signal
import time
import weakref
from collections.abc import Callable
from types import FrameType

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.nn.parallel import DistributedDataParallel

from kembed_contract import runtime
from kembed_contract import trainer_config as config
from kembed_trainer import (
    best,
    checkpoint,
    delta,
    embedding,
    kernel_cache,
    kinds,
    malloc,
    metrics,
    phases,
    precision,
    report,
    row_index,
    sparse_optim,
    sparsity,
    step_writer,
    storage,
)
from kembed_trainer import dist as kdist

__all__ = ["STEP_PHASES", "Trainer"]

STEP_PHASES = ("data", "lookup", "dense forward", "backward", "dense optimizer", "sparse update")
"""The parts of a batch/autograd step, as torch.profiler sees them (`record_function` labels):
benchmarks/roofline.py times each."""


class Trainer:
    def __init__(self, cfg: config.TrainerConfig, env: kdist.Env, reporter: report.Reporter, *,
                 guard: storage.Guard | None = None, clock: phases.PhaseClock | None = None) -> None:
        """`guard`: the storage policy every file goes through; by default the launcher's (storage_policy.POLICY_ENV).
        `clock`: where the job's seconds by phase are counted (started at the process's start by __main__)."""
        self.clock = clock or phases.PhaseClock()
        with self.clock.phase("data"):  # the tables and the data (the vocabulary too); the kind's compilation aside
            self._build(cfg, env, reporter, guard=guard or storage.Guard.from_env())

    def _build(self, cfg: config.TrainerConfig, env: kdist.Env, reporter: report.Reporter, *,
               guard: storage.Guard) -> None:
        self.cfg, self.env, self.reporter = cfg, env, reporter
        torch.manual_seed(cfg.training.seed)  # the same dense init on every rank
        if os.environ.get(runtime.ENV_KERNEL_CACHE):  # the platform's kernels: all loaded before the tables use them
            with self.clock.phase("imports"):  # (without them, each kernel compiles where first used, not all here)
                kernel_cache.warm(sorted({m for t in cfg.embeddings.tables for m in kinds.table(t).kernel_modules}))
        self.embeddings = embedding.EmbeddingCollection(
            cfg.embeddings,
            cfg.optimizer.sparse,
            device=env.device,
            seed=cfg.training.seed,
            world_size=env.world_size,
            rank=env.rank,
        )
        self.kind = kinds.model(cfg.model.kind)  # what the model kind trains and measures its own way
        self.task = self.kind.task(cfg)
        self.data = kinds.data_source(cfg, rank=env.rank, world_size=env.world_size, guard=guard)
        self.total_steps, self.dataset = self._size_up_data()
        dense = self.kind.dense_model(cfg).to(env.device)
        metric, higher = cfg.best_metric
        self.best = best.Best(metric, higher_is_better=higher, patience=cfg.evaluation.patience,
                              metrics=sorted(cfg.eval_metrics))
        # Handed the unwrapped model: a kind's metrics may call its own methods.
        self.evaluator = self.kind.evaluator(cfg, model=dense, embeddings=self.embeddings, data=self.data,
                                             guard=guard, device=env.device)
        self.masks = sparsity.Masks(cfg.sparsity, dense, seed=cfg.training.seed)
        has_params = any(True for _ in dense.parameters())  # a model all in its tables: nothing for DDP to do
        self.model = DistributedDataParallel(dense) if env.distributed and has_params else dense
        if isinstance(self.model, DistributedDataParallel) and cfg.distributed.grad_compression != "none":
            hook = {"bf16": default_hooks.bf16_compress_hook, "fp16": default_hooks.fp16_compress_hook}
            self.model.register_comm_hook(dist.group.WORLD, hook[cfg.distributed.grad_compression])
        self.checkpointer = (
            checkpoint.Checkpointer(
                cfg.checkpoint.uri, keep=cfg.checkpoint.keep, is_main=env.is_main, guard=guard,
                incremental=cfg.checkpoint.incremental, full_every=cfg.checkpoint.full_every,
                max_chain_share=cfg.checkpoint.max_chain_share, budget_bytes=runtime.storage_budget(),
            )
            if cfg.checkpoint.uri
            else None
        )
        with self.clock.phase("imports"):  # a compiled step compiles its kernel (or loads it from numba's cache)
            self.compiled = self.kind.compiled_step(cfg, data=self.data, embeddings=self.embeddings, model=dense,
                                                    total_steps=self.total_steps, rank=env.rank,
                                                    world_size=env.world_size)
        # A compiled step moves the dense parameters itself: the dense optimizer is built only for the batch path
        # (torch.optim's first use imports torch._dynamo, a second of every job's start).
        self.has_dense_params = has_params
        self.optimizer = _dense_optimizer(self.model, cfg.optimizer.dense, env.device) \
            if has_params and self.compiled is None else None
        self.step = 0
        self._last_eval: dict | None = None
        self._last_eval_step: int | None = None
        self.stop_requested = False
        self._last_saved: checkpoint.SavedCheckpoint | None = None  # the newest that landed
        self._saved_step: int | None = None  # the newest saved, landed or in flight
        self._ids_saved: dict[str, int] = {}  # raw ids read per feature when the last save was made (row_index)
        malloc.trim()  # the tables' and data's start-up temporaries

    @property
    def data(self):
        """The training data (a data kind's source)."""
        return self._ahead.data

    @data.setter
    def data(self, source) -> None:
        self._ahead = _BatchAhead(source)  # the next batch, for tiered tables to fetch its rows meanwhile

    # ------------------------------------------------------------------------------------------- the loop
    def train(self) -> int:
        # The handler holds the trainer weakly: a strong reference from the signal module kept the trainer, and
        # through its DDP model the process groups, alive until the interpreter's own teardown, where destroying
        # gloo's groups sometimes aborted the process ("terminate called without an active exception").
        signal.signal(signal.SIGTERM, _weakly(self._request_stop))
        resumed_from = self.restore()
        malloc.trim()  # the checkpoint's read buffers
        if self.cfg.training.epochs is not None and hasattr(self.data, "total_steps"):
            # Streamed data knows where its epochs end from its position (a resume at another world size moves it).
            self.total_steps = self.data.total_steps(self.cfg.training.epochs, self.step)
            if self.compiled:
                self.compiled.total_steps = self.total_steps  # a compiled step's learning rate falls to the new end
        total = self.total_steps
        self.reporter.emit(
            runtime.EVENT_STARTED,
            self.step,
            total_steps=total,
            world_size=self.env.world_size,
            resumed_from=resumed_from,
            embedding_mb=round(self.embeddings.num_bytes / 2**20, 3),
            dataset=self.dataset,
            seconds=self.clock.seconds(),
            **({"kernels": kernels} if any((kernels := kernel_cache.stats(kinds.kernel_modules(self.cfg))).values()) else {}),
        )
        with self.clock.phase("training"):  # its evals and saves count as theirs (nested phases)
            if (stopped := self._loop(total)) is not None:
                return stopped
        if self._last_eval_step != self.step:  # not just evaluated (an early stop did)
            self.evaluate_and_keep_best()
        last = self._last_eval
        self.save(wait=True)
        last_uri = self._last_saved.uri if self._last_saved else None
        seconds = self.clock.seconds()
        if self.cfg.evaluation.keep_best and self.best.best_step is not None:
            # The job's result is its best eval and that checkpoint; the last is kept beside it.
            best_uri = self.checkpointer.step_uri(self.best.best_step) if self.checkpointer else None
            self.reporter.emit(runtime.EVENT_DONE, self.step, eval=self.best.result(), checkpoint=best_uri,
                               best_step=self.best.best_step, last_eval=last, last_checkpoint=last_uri,
                               stopped_early=self.step < total, seconds=seconds)
        else:
            self.reporter.emit(runtime.EVENT_DONE, self.step, eval=last, checkpoint=last_uri,
                               stopped_early=self.step < total, seconds=seconds)
        return 0

    def _loop(self, total: int) -> int | None:
        """Train until step `total` or an early stop (None), or until asked to stop (runtime.EXIT_STOPPED)."""
        window = _Window()
        while self.step < total:
            started = time.perf_counter()
            loss, data_seconds = self.train_step()
            self.step += 1
            stop = self._sync_stop_and_loss(loss, window, started, data_seconds)
            if self._due(self.cfg.training.log_every):
                stats = {**window.flush(self), **self.masks.stats()}
                self.reporter.emit(runtime.EVENT_PROGRESS, self.step, total_steps=total, **stats,
                                   seconds=self.clock.seconds())
            # An eval that exhausts the patience stops training early, as if at the end.
            if self._due(self.cfg.training.eval_every) and self.step < total and self.evaluate_and_keep_best():
                break
            if stop:
                self.save(wait=True)
                return runtime.EXIT_STOPPED  # the platform starts it again; it resumes from this checkpoint
            if self._due(self.cfg.checkpoint.every_steps) and self.step < total:
                self.save()
            self._report_saves(wait=False)
        return None

    def evaluate_and_keep_best(self) -> bool:
        """Evaluate, report, and save a checkpoint when the eval is the best yet; whether patience ran out."""
        with self.clock.phase("evaluation"):
            result = self.evaluate()
        self._last_eval, self._last_eval_step = result, self.step
        improved = self.best.update(self.step, result)
        self.reporter.emit(runtime.EVENT_EVAL, self.step, best=improved, **result)
        if improved and self.cfg.evaluation.keep_best and self.checkpointer:
            self.save()
            self.checkpointer.pinned_step = self.step  # keep-K never deletes it
        return self.best.should_stop

    def close(self) -> None:
        """Wait for the checkpoint writer's thread to end (before the process groups are destroyed)."""
        if self.checkpointer:
            self.checkpointer.close()
        if self.compiled:
            self.compiled.close()
        if hasattr(self.data, "close"):
            self.data.close()  # the reader's thread
        self.embeddings.close()  # tiered tables' threads and files

    # ------------------------------------------------------------------------------------------- steps
    def train_step(self) -> tuple[torch.Tensor, float]:
        """One step; (its loss, the seconds it spent getting its batch)."""
        if self.compiled:  # a kind that trains in its own code (no batches, no autograd, no optimizer)
            return self.compiled.step(self.step), 0.0
        self.embeddings.lr = sparse_optim.learning_rate(
            self.cfg.optimizer.sparse, self.step, self.total_steps
        )
        fetching = time.perf_counter()
        with _phase("data"):
            batch = self._ahead.take(self.step).to(self.env.device)
        data_seconds = time.perf_counter() - fetching
        with _phase("lookup"):
            pooled = self.embeddings(batch, step=self.step)  # tables stay float32, whatever the dense precision
        if self.embeddings.prefetches and self.step + 1 < self.total_steps:
            # Tiered tables fetch the next batch's rows from disk while this step trains.
            fetching = time.perf_counter()
            self.embeddings.prefetch(self._ahead.peek(self.step + 1).to(self.env.device))
            data_seconds += time.perf_counter() - fetching
        with _phase("dense forward"), self._autocast():
            loss = self.task.loss(self.model(batch.dense, pooled), batch.labels)
        del pooled  # the model has its own copy (a concatenation): free these before the backward
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        with _phase("backward"):
            loss.backward()  # DDP averages the dense gradients here
        if self.optimizer is not None:
            with _phase("dense optimizer"):
                self.masks.before_optimizer(self.step)
                self.optimizer.step()
                self.masks.after_optimizer()
        with _phase("sparse update"):
            self.embeddings.step(self.step)
        return loss.detach(), data_seconds

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        self.model.eval()
        scores, labels = [], []
        for batch in _until_all_ranks_done(
            self.data.eval_batches(), self.embeddings.exchanges, self.env.device
        ):
            if batch is None:  # this rank is out of eval batches, others are not: serve their lookups
                self.embeddings.lookup_nothing()
                continue
            batch = batch.to(self.env.device)
            pooled = self.embeddings(batch)
            with self._autocast():
                scores.append(self.model(batch.dense, pooled).float())
                if self.evaluator is not None:
                    self.evaluator.on_batch(pooled)
            labels.append(batch.labels)
        self.embeddings.discard_lookup()
        self.embeddings.tier_stats()  # eval's lookups are not training's: the next progress record leaves them out
        self.model.train()
        empty = torch.empty(0, device=self.env.device)
        scores_t, labels_t = (torch.cat(x) if x else empty for x in (scores, labels))
        labels_all = kdist.gather(labels_t)
        result = self.task.evaluate(kdist.gather(scores_t), labels_all)
        if self.evaluator is not None:  # every rank, with or without eval rows of its own (it may gather)
            result.update(self.evaluator.finish(labels_all))
        result.update(self._dynamic_metrics())
        return result

    def _dynamic_metrics(self) -> dict[str, int]:
        """Dynamic tables' rows in use, and ids admitted and rows evicted since the last eval, over all ranks."""
        stats = self.embeddings.dynamic_stats()
        if not stats:
            return {}
        summed = torch.tensor(list(stats.values()), dtype=torch.int64)
        if self.env.distributed:
            dist.all_reduce(summed)
        out = {f"dynamic_{name}": int(v) for name, v in zip(stats, summed.tolist(), strict=True)}
        assert out.keys() == runtime.DYNAMIC_TABLE_METRICS.keys(), "the contract names what eval records say"
        return out

    # ------------------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        state = {
            delta.TABLES_KEY: self.embeddings.state_dict(),
            "trainer": {"step": torch.tensor(self.step), "best": self.best.state_dict()},
        }
        if masks := self.masks.state_dict():
            state["sparsity"] = masks
        if hasattr(self.data, "state_dict"):
            state["data"] = self._ahead.state_dict()  # the reader's position: a resume continues the epoch
        if self.optimizer is not None:
            state["model"], state["optimizer"] = get_state_dict(self.model, self.optimizer)
        elif self.has_dense_params:  # moved by a compiled step: no optimizer state
            state["model"] = get_model_state_dict(self.model)
        return state

    def restore(self) -> str | None:
        if self.checkpointer is None:
            return None
        state = self.state_dict()
        # Checkpoints written before the best eval (or the data's position) was kept lack it: they resume with no
        # best yet (and the data's position counted from the step, as if no run before had another world size).
        # A compiled step's checkpoints hold no dense optimizer state: the batch path resuming one (a GPU where the
        # CPU ran the compiled step) starts its dense optimizer afresh.
        step = self.checkpointer.load_latest(state, optional=("trainer.best", "data", "optimizer"),
                                             sinks=self.embeddings.tier_fields())
        if step is None:
            return None
        self.embeddings.drop_caches()  # tiered tables: the stores hold the checkpoint's rows now
        self.embeddings.after_restore()  # dynamic tables: their maps, and ids moved to their owners
        if "data" in state:
            self._ahead.forget()
            self.data.load_state_dict(state["data"])
        if hasattr(self.data, "add_raw_ids"):  # the id index so far: over the chain, full checkpoint and deltas
            chain = [self.checkpointer.step_uri(s) for s in runtime.chain_of(step, self.checkpointer.markers())]
            self.data.add_raw_ids(row_index.read_raw_ids(self.checkpointer.guard, chain, rank=self.env.rank,
                                                         world_size=self.env.world_size))
            self._ids_saved = row_index.id_counts(self.data)
        if self.optimizer is not None:
            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optimizer"],
            )
        elif "model" in state:
            set_model_state_dict(self.model, state["model"])
        self.step = int(state["trainer"]["step"])
        if self.cfg.evaluation.keep_best:
            self.checkpointer.pinned_step = self.best.best_step
        # The restored checkpoint already holds this step: a run resumed at its end must not rewrite it.
        self._last_saved = checkpoint.SavedCheckpoint(step, self.checkpointer.step_uri(step), 0, 0.0)
        self._saved_step = step
        return self._last_saved.uri

    def save(self, *, wait: bool = False) -> None:
        """Start a checkpoint of this step (unless there is one); with `wait`, return once every save landed."""
        if self.checkpointer is None:
            return
        with self.clock.phase("saving"):
            self._save(wait=wait)

    def _save(self, *, wait: bool) -> None:
        tiered = self.embeddings.tier_fields()
        if self._saved_step != self.step:
            started = time.perf_counter()  # training stalls from here until the state is copied
            kind = self.checkpointer.next_kind()
            self.embeddings.flush()  # tiered tables: every change in the stores, which the save streams
            # What each row stands for (vocabulary, raw ids read so far: a delta's since the save before), saved with
            # every checkpoint (row_index.py).
            state = self.state_dict()
            files, ids_saved = row_index.checkpoint_files(
                self.cfg, self.data, rank=self.env.rank,
                ids_since=self._ids_saved if kind == runtime.CHECKPOINT_DELTA else None)
            sources = {f"{delta.TABLES_KEY}.{key}": field.reader() for key, field in tiered.items()}
            if kind == runtime.CHECKPOINT_DELTA:
                tables = state.pop(delta.TABLES_KEY)
                changes = self.embeddings.changes(self.env.rank)
                state[delta.DELTA_KEY] = delta.extract(tables, changes, self.env.rank)
                sources = _tier_delta(state[delta.DELTA_KEY], tiered, changes, self.env.rank)
            self.embeddings.forget_changes()
            self._ids_saved = ids_saved
            # A tiered table's save reads its store as it writes, from a copy-on-write snapshot: training goes on.
            self.checkpointer.save(self.step, state, files, kind=kind, started=started, sources=sources,
                                   snapshot=self.embeddings.snapshot if tiered else None)
            self._saved_step = self.step
        if wait:
            self._report_saves(wait=True)

    def _report_saves(self, *, wait: bool) -> None:
        if self.checkpointer is None:
            return
        for saved in self.checkpointer.wait() if wait else self.checkpointer.poll():
            self._last_saved = saved
            self.reporter.emit(
                runtime.EVENT_CHECKPOINT,
                saved.step,
                uri=saved.uri,
                num_bytes=saved.num_bytes,
                seconds=round(saved.seconds, 3),
                blocked_seconds=round(saved.blocked_seconds, 3),
                waited_seconds=round(saved.waited_seconds, 3),
                kind=saved.kind,
                parent_step=saved.parent,
                stored_bytes=saved.stored_bytes,
            )

    # ------------------------------------------------------------------------------------------- helpers
    def _size_up_data(self) -> tuple[int, dict[str, int]]:
        """(total steps, the data set's size): `epochs` become steps here, the same on every rank (the
        largest shard's steps per epoch), and each rank's counts are summed."""
        counts = self.data.counts()
        per_epoch = self.data.steps_per_epoch if self.cfg.training.epochs is not None else 0
        summed = torch.tensor([*counts.values(), per_epoch], dtype=torch.float64, device=self.env.device)
        if self.env.distributed:
            per_epoch_max = summed[-1:].clone()
            dist.all_reduce(summed)
            dist.all_reduce(per_epoch_max, op=dist.ReduceOp.MAX)
            summed[-1] = per_epoch_max[0]
        dataset = {k: int(v) for k, v in zip(counts, summed.tolist(), strict=False)}
        if (vocab := getattr(self.data, "vocab", None)) is not None:
            dataset["vocab_size"] = len(vocab)
        epochs = self.cfg.training.epochs
        total = self.cfg.training.steps if epochs is None else int(summed[-1]) * epochs
        return total, dataset

    def _autocast(self) -> torch.autocast:
        return precision.autocast(self.cfg.training.mixed_precision, self.env.device)

    def _due(self, every: int) -> bool:
        return every > 0 and self.step % every == 0

    def _request_stop(self, signum, frame) -> None:
        self.stop_requested = True  # acted on between steps, so the checkpoint holds a whole step

    def _sync_stop_and_loss(self, loss: torch.Tensor, window: _Window, started: float, data_seconds: float) -> bool:
        """One small all-reduce per step: the mean loss, and whether any rank was asked to stop."""
        flags = torch.stack([loss.float(), torch.tensor(float(self.stop_requested), device=loss.device)])
        if self.env.distributed:
            dist.all_reduce(flags)
            flags[0] /= self.env.world_size
        window.add(flags[0].item(), self.embeddings.last_unique_rows, time.perf_counter() - started, data_seconds)
        return bool(flags[1].item() > 0)


_FUSED_OPTIMIZER_DEVICES = ("cpu", "cuda")  # where torch's Adam and AdamW have a fused kernel


def _dense_optimizer(model: torch.nn.Module, opt: config.DenseOptimizerConfig,
                     device: torch.device) -> torch.optim.Optimizer:
    optim_cls = torch.optim.AdamW if opt.name == "adamw" else torch.optim.Adam
    return optim_cls(model.parameters(), lr=opt.lr, betas=(opt.beta1, opt.beta2), weight_decay=opt.weight_decay,
                     fused=device.type in _FUSED_OPTIMIZER_DEVICES)  # one kernel per step instead of one per op


def _phase(name: str) -> torch.profiler.record_function:
    assert name in STEP_PHASES, name
    return torch.profiler.record_function(name)  # next to nothing while no profiler records


def _tier_delta(entries: dict, fields: dict, changes: dict[str, delta.TableChanges], rank: int) -> dict:
    """A delta's entries for tiered tables' changed rows: placeholders in `entries` and, by flattened key, the
    readers that stream those rows from the stores as the delta is written."""
    sources = {}
    for key, field in fields.items():
        table, name = key.split(".", 1)
        rows = changes[table].rows
        if not rows.numel():
            continue
        entry = f"{table}.rank{rank}.{name}"
        entries[entry] = step_writer.placeholder((rows.numel(), *field.shape[1:]))
        sources[f"{delta.DELTA_KEY}.{entry}"] = field.reader(rows.numpy())
    return sources


class _BatchAhead:
    """The training data, read one batch ahead when asked (`peek`): tiered tables fetch the next batch's rows
    while a step trains. The position a checkpoint saves is the data's before the batch read ahead, so a resume
    reads that batch again."""

    def __init__(self, data) -> None:
        self.data = data
        self._held: tuple[int, object, object] | None = None  # (step, its batch, the position before it)

    def take(self, step: int):
        held, self._held = self._held, None
        if held is not None and held[0] == step:
            return held[1]
        return self.data.train_batch(step)

    def peek(self, step: int):
        position = self.data.state_dict() if hasattr(self.data, "state_dict") else None
        batch = self.data.train_batch(step)
        self._held = (step, batch, position)
        return batch

    def state_dict(self):
        return self._held[2] if self._held is not None else self.data.state_dict()

    def forget(self) -> None:
        self._held = None


def _weakly(method: Callable[[int, FrameType | None], None]) -> Callable[[int, FrameType | None], None]:
    """A signal handler that calls `method` while its object lives, and does nothing after."""
    bound = weakref.WeakMethod(method)

    def handle(signum: int, frame: FrameType | None) -> None:
        if (live := bound()) is not None:
            live(signum, frame)

    return handle


class _Window:
    """Accumulates per-step readings between `progress` records; time spent in eval and saves is left out."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.seconds, self.steps, self.loss, self.unique, self.data_seconds = 0.0, 0, 0.0, 0, 0.0

    def add(self, loss: float, unique: int, seconds: float, data_seconds: float) -> None:
        self.steps += 1
        self.loss += loss
        self.unique += unique
        self.seconds += seconds
        self.data_seconds += data_seconds

    def flush(self, trainer: Trainer) -> dict[str, float]:
        elapsed = max(self.seconds, 1e-9)
        samples = self.steps * trainer.cfg.training.batch_size * trainer.env.world_size
        out = {
            "loss": self.loss / max(self.steps, 1),
            "samples_per_sec": round(samples / elapsed, 1),
            "unique_ids_per_step": round(self.unique / max(self.steps, 1), 1),
            "memory_mb": round(metrics.peak_memory_mb(trainer.env.device), 1),
            "data_share": round(self.data_seconds / elapsed, 4),
        }
        if tier := trainer.embeddings.tier_stats():
            out.update(_tier_metrics(tier, self.steps, elapsed, out["data_share"]))
        self._reset()
        return out


def _tier_metrics(tier: dict[str, float], steps: int, elapsed: float, data_share: float) -> dict[str, float]:
    """Tiered tables' share of a `progress` record: the cache's hit rate (looked-up rows that needed no read from
    disk), rows and MB fetched and written back per step, and the step time split into getting the batch
    (`data_share`), waiting for rows (`tier_wait_share`) and the rest (`compute_share`)."""
    steps = max(steps, 1)
    wait_share = tier["wait_seconds"] / elapsed
    return {
        "tier_hit_rate": round(max(0.0, 1 - tier["fetched"] / max(tier["rows"], 1)), 4),
        "tier_fetched_rows_per_step": round(tier["fetched"] / steps, 1),
        "tier_written_rows_per_step": round(tier["written"] / steps, 1),
        "tier_fetched_mb_per_step": round(tier["fetched_bytes"] / steps / 2**20, 3),
        "tier_written_mb_per_step": round(tier["written_bytes"] / steps / 2**20, 3),
        "tier_wait_share": round(wait_share, 4),
        "tier_io_share": round(tier["io_seconds"] / elapsed, 4),  # disk time, mostly overlapping the steps
        "compute_share": round(max(0.0, 1 - data_share - wait_share), 4),
    }


def _until_all_ranks_done(batches, in_lockstep: bool, device: torch.device):
    """`batches`, then None until every rank is done too when ranks must look up in lockstep."""
    if not in_lockstep:
        yield from batches
        return
    it = iter(batches)
    while True:
        batch = next(it, None)
        more = torch.tensor([float(batch is not None)], device=device)
        dist.all_reduce(more)
        if more.item() == 0:
            return
        yield batch
