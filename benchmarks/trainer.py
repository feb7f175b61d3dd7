"""kembed's trainer against PyTorch baselines and TorchRec on one DLRM config, side by side.

    .venv/bin/python benchmarks/trainer.py                 # every variant, table at the end
    .venv/bin/python benchmarks/trainer.py --variants kembed-rowwise-adagrad,torchrec-rowwise-adagrad

Each variant runs in its own torchrun process group (so peak RSS is its own), on the same pre-generated
synthetic batches (26 sparse features: 4 tables of 1M rows and 22 of 10k-100k, dim 64, multi-hot 1-3,
Zipf 1.1; 13 dense; batch 4096 per rank; MLPs 256-64 / 256-1), for the same number of steps, then evaluates
AUC on the same held-out samples. Every variant's initial weights are seeded (`training.seed`), so a variant's
AUC is the same in every run. Threads per process = cores / ranks. TorchRec variants need
`benchmarks/requirements.txt`; they are skipped when TorchRec does not import.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import subprocess
import sys
import tempfile
import time

import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "trainer_image"))

from kembed_contract import trainer_config as config  # noqa: E402 - after the path insert
from kembed_trainer import dist, metrics, report, train  # noqa: E402 - after the path insert
from kembed_trainer.data.synthetic import SyntheticData  # noqa: E402

# name: (ranks, description)
VARIANTS = {
    "torch-dense-adam": (1, "nn.EmbeddingBag dense grads + Adam"),
    "torch-dense-adam-fused": (1, "nn.EmbeddingBag dense grads + Adam(fused=True)"),
    "torch-sparse-sparseadam": (1, "nn.EmbeddingBag(sparse=True) + SparseAdam"),
    "torchrec-rowwise-adagrad": (1, "TorchRec EBC + FBGEMM fused row-wise Adagrad"),
    "torchrec-2rank": (2, "TorchRec DistributedModelParallel, 2 ranks"),
    "kembed-rowwise-adagrad": (1, "kembed rowwise_adagrad"),
    "kembed-rowwise-adagrad-fp32": (1, "kembed rowwise_adagrad, the dense part in float32 (mixed_precision none)"),
    "kembed-adam": (1, "kembed lazy adam"),
    "kembed-rowwise-adagrad-2rank": (2, "kembed rowwise_adagrad, 2 ranks, every table sharded row-wise"),
    "kembed-rowwise-adagrad-2rank-fp32": (2, "kembed rowwise_adagrad, 2 ranks, sharded, the dense part in float32"),
    "kembed-rowwise-adagrad-2rank-replicated": (2, "kembed rowwise_adagrad, 2 ranks, every table replicated"),
    "kembed-adam-2rank": (2, "kembed lazy adam, 2 ranks, every table sharded row-wise"),
}
BASELINE = "torchrec-rowwise-adagrad"
BASELINES = {1: BASELINE, 2: "torchrec-2rank"}  # the "x TorchRec, same ranks" column


def bench_config(
    optimizer: str,
    batch_size: int,
    steps: int,
    *,
    replicated: bool = False,
    shard_all: bool = False,
    seed: int = 0,
    mixed_precision: str | None = None,
) -> config.TrainerConfig:
    big = [1_000_000] * 4
    small = [int(10_000 * 10 ** (i / 21)) for i in range(22)]  # 10k .. 100k, geometric
    # The default threshold (1M rows) shards the four big tables (what the 1-rank variants run: at one rank
    # it changes nothing but the code path); replicated keeps every table whole; shard_all (the 2-rank
    # variants) shards all 26: every table is looked up through the one all-to-all per step anyway, and a
    # replicated table costs an all-gather of its gradients and the same update on every rank.
    threshold = 10**9 if replicated else min(big + small) if shard_all else 1_000_000
    tables = [
        {"name": f"t{i}", "num_embeddings": n, "embedding_dim": 64, "features": [f"c{i}"]}
        for i, n in enumerate(big + small)
    ]
    return config.TrainerConfig.model_validate(
        {
            "model": {"kind": "dlrm", "bottom_mlp": [256, 64], "top_mlp": [256]},
            "embeddings": {"tables": tables, "shard_threshold_rows": threshold},
            "data": {
                "kind": "synthetic",
                "num_dense": 13,
                "zipf_alpha": 1.1,
                "min_hotness": 1,
                "max_hotness": 3,
                "eval_samples": 16384,
            },
            "optimizer": {
                "sparse": {"name": optimizer, "lr": 0.05 if optimizer != "adam" else 0.005},
                "dense": {"name": "adam", "lr": 0.001},
            },
            "training": {
                "steps": steps,
                "batch_size": batch_size,
                "seed": seed,
                # None: the model kind's default (dlrm: bf16 where the CPU has bf16 units)
                **({"mixed_precision": mixed_precision} if mixed_precision else {}),
            },
        }
    )


class CachedData:
    """Batches generated before the clock starts, so data generation is not what is measured."""

    def __init__(self, source: SyntheticData, num_batches: int) -> None:
        self.batches = [source.train_batch(i) for i in range(num_batches)]
        self.eval = list(source.eval_batches())

    def train_batch(self, step: int):
        return self.batches[step % len(self.batches)]

    def eval_batches(self):
        return iter(self.eval)


# ------------------------------------------------------------------------------------------------ workers
def run_kembed(cfg: config.TrainerConfig, env: dist.Env, args) -> tuple[float, float]:
    trainer = train.Trainer(cfg, env, report.Reporter(enabled=False))
    trainer.data = CachedData(trainer.data, args.num_batches)

    def step(i: int) -> None:
        trainer.step = i
        trainer.train_step()

    return timed(step, args, env), trainer.evaluate()["auc"]


def run_torch(cfg: config.TrainerConfig, env: dist.Env, args, variant: str):
    from kembed_trainer.models import dlrm

    features = cfg.embeddings.features
    data = CachedData(
        SyntheticData(
            cfg.data,
            tables=cfg.embeddings.tables,
            seed=cfg.training.seed,
            batch_size=args.batch_size,
            rank=0,
            world_size=1,
        ),
        args.num_batches,
    )
    sparse = variant == "torch-sparse-sparseadam"
    bags = torch.nn.ModuleList(
        torch.nn.EmbeddingBag(t.num_embeddings, 64, mode="sum", sparse=sparse) for t in cfg.embeddings.tables
    )
    dense = dlrm.DLRM(cfg.model, num_dense=13, num_sparse=len(features), embedding_dim=64)
    if sparse:
        opts = [
            torch.optim.SparseAdam(bags.parameters(), lr=0.005),
            torch.optim.Adam(dense.parameters(), lr=1e-3),
        ]
    else:
        fused = variant.endswith("fused")
        opts = [torch.optim.Adam([*bags.parameters(), *dense.parameters()], lr=1e-3, fused=fused or None)]

    def forward(batch):
        b = batch.batch_size
        lengths = batch.lengths.view(len(features), b)
        values = torch.split(batch.values, lengths.sum(1).tolist())
        pooled = [bag(v, torch.cumsum(n, 0) - n) for bag, v, n in zip(bags, values, lengths, strict=True)]
        return dense(batch.dense, [torch.stack(pooled, 1)])

    def step(i):
        batch = data.train_batch(i)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(forward(batch), batch.labels)
        for o in opts:
            o.zero_grad()
        loss.backward()
        for o in opts:
            o.step()

    sps = timed(step, args, env)
    with torch.no_grad():
        scores = torch.cat([forward(b) for b in data.eval_batches()])
    labels = torch.cat([b.labels for b in data.eval_batches()])
    return sps, metrics.auc(scores, labels)


def run_torchrec(cfg: config.TrainerConfig, env: dist.Env, args):
    import torch.distributed as tdist
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import ShardingType
    from torchrec.models.dlrm import DLRM
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    if not tdist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        tdist.init_process_group("gloo", rank=0, world_size=1)
    features = cfg.embeddings.features
    data = CachedData(
        SyntheticData(
            cfg.data,
            tables=cfg.embeddings.tables,
            seed=cfg.training.seed,
            batch_size=args.batch_size,
            rank=env.rank,
            world_size=env.world_size,
        ),
        args.num_batches,
    )
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                name=t.name, embedding_dim=64, num_embeddings=t.num_embeddings, feature_names=t.features
            )
            for t in cfg.embeddings.tables
        ],
        device=torch.device("meta"),
    )
    model = DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=13,
        dense_arch_layer_sizes=[256, 64],
        over_arch_layer_sizes=[256, 1],
        dense_device=torch.device("cpu"),
    )
    apply_optimizer_in_backward(RowWiseAdagrad, model.sparse_arch.parameters(), {"lr": 0.05})
    sharder = EmbeddingBagCollectionSharder()
    # Row-wise sharding is refused on CPU; table-wise works.
    constraints = {
        t.name: ParameterConstraints(sharding_types=[ShardingType.TABLE_WISE.value])
        for t in cfg.embeddings.tables
    }
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=env.world_size, compute_device="cpu"), constraints=constraints
    )
    plan = planner.collective_plan(model, [sharder], tdist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    dense_opt = torch.optim.Adam(dict(in_backward_optimizer_filter(dmp.named_parameters())).values(), lr=1e-3)

    def kjt(batch):
        return KeyedJaggedTensor.from_lengths_sync(keys=features, values=batch.values, lengths=batch.lengths)

    def step(i):
        batch = data.train_batch(i)
        logits = dmp(batch.dense, kjt(batch)).squeeze(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        dense_opt.zero_grad()
        loss.backward()
        dense_opt.step()

    sps = timed(step, args, env)
    scores, labels = [], []
    with torch.no_grad():
        for b in data.eval_batches():
            scores.append(dmp(b.dense, kjt(b)).squeeze(1))
            labels.append(b.labels)
    scores_t, labels_t = dist.gather(torch.cat(scores)), dist.gather(torch.cat(labels))
    return sps, metrics.auc(scores_t, labels_t)


def timed(step, args, env) -> float:
    """Global samples/s over the steps after warm-up."""
    for i in range(args.warmup):
        step(i)
    start = time.perf_counter()
    for i in range(args.warmup, args.steps):
        step(i)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    elapsed = time.perf_counter() - start
    return (args.steps - args.warmup) * args.batch_size * env.world_size / elapsed


def worker(args) -> None:
    ranks, _ = VARIANTS[args.variant]
    optimizer = "adam" if "adam" in args.variant and args.variant.startswith("kembed") else "rowwise_adagrad"
    replicated = args.variant.endswith("replicated")
    cfg = bench_config(
        optimizer,
        args.batch_size,
        args.steps,
        replicated=replicated,
        shard_all=ranks > 1 and not replicated,
        seed=args.seed,
        mixed_precision="none" if args.variant.endswith("fp32") else None,
    )
    env = dist.setup("gloo", threads=max(1, len(os.sched_getaffinity(0)) // ranks))
    # torch seeds its default generator afresh in every process: without this, the baselines' tables and dense
    # layers (drawn from it) and so their AUC changed from run to run. kembed seeds its own the same way.
    torch.manual_seed(cfg.training.seed)
    if args.variant.startswith("kembed"):
        sps, auc = run_kembed(cfg, env, args)
    elif args.variant.startswith("torchrec"):
        sps, auc = run_torchrec(cfg, env, args)
    else:
        sps, auc = run_torch(cfg, env, args, args.variant)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # GiB
    out = pathlib.Path(args.out) / f"rank{env.rank}.json"
    out.write_text(json.dumps({"samples_per_sec": sps, "auc": auc, "peak_rss_gb": rss}))
    dist.teardown()


# ------------------------------------------------------------------------------------------------ driver
def run_variant(name: str, args) -> dict | None:
    ranks, _ = VARIANTS[name]
    with tempfile.TemporaryDirectory() as out:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nnodes",
            "1",
            "--nproc-per-node",
            str(ranks),
            str(pathlib.Path(__file__).resolve()),
            "--worker",
            "--variant",
            name,
            "--out",
            out,
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            "--batch-size",
            str(args.batch_size),
            "--num-batches",
            str(args.num_batches),
            "--seed",
            str(args.seed),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)  # noqa: PLW1510
        results = [json.loads(p.read_text()) for p in sorted(pathlib.Path(out).glob("rank*.json"))]
    if proc.returncode != 0 or len(results) != ranks:
        print(f"{name}: failed\n{proc.stderr[-3000:]}", file=sys.stderr)
        return None
    return {
        "samples_per_sec": results[0]["samples_per_sec"],
        "auc": results[0]["auc"],
        "peak_rss_gb": sum(r["peak_rss_gb"] for r in results),  # the job's memory: all its processes
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=55, help="training steps per variant (incl. warm-up)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=4096, help="per rank")
    parser.add_argument(
        "--num-batches",
        type=int,
        help="distinct pre-generated batches, cycled (default: one per step). With fewer than the steps the"
        " model memorises them and eval AUC mostly measures the initial weights",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="data and initial weights, the same for every variant"
    )
    parser.add_argument("--repeats", type=int, default=1, help="runs per variant; the table shows medians")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.num_batches = args.num_batches or args.steps
    if args.worker:
        return worker(args)
    runs: dict[str, list[dict]] = {name: [] for name in args.variants.split(",")}
    for _ in range(args.repeats):  # interleaved, so a burst of load elsewhere hits every variant alike
        for name in runs:
            result = run_variant(name, args)
            print(f"{name}: {result}", file=sys.stderr, flush=True)
            if result is not None:
                runs[name].append(result)
    rows = {name: _median(results) if results else None for name, results in runs.items()}
    base = rows.get(BASELINE)
    print(
        f"\n{args.steps} steps ({args.warmup} warm-up), batch {args.batch_size}/rank, "
        f"{len(os.sched_getaffinity(0))} cores, torch {torch.__version__}, seed {args.seed}, "
        f"medians of {args.repeats} run(s)\n"
    )
    print("| variant | ranks | samples/s | x TorchRec | x TorchRec, same ranks | peak RSS (GB) | eval AUC |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, r in rows.items():
        ranks = VARIANTS[name][0]
        if r is None:
            print(f"| {name} | {ranks} | failed | | | | |")
            continue
        same = rows.get(BASELINES.get(ranks, ""))
        ratio, same_ratio = (
            f"{r['samples_per_sec'] / b['samples_per_sec']:.2f}" if b else "-" for b in (base, same)
        )
        print(
            f"| {name} | {ranks} | {r['samples_per_sec']:,.0f} | {ratio} | {same_ratio} | "
            f"{r['peak_rss_gb']:.2f} | {r['auc']:.4f} |"
        )


def _median(results: list[dict]) -> dict:
    """Each figure's median over the runs (the upper median for an even count)."""
    return {k: sorted(r[k] for r in results)[len(results) // 2] for k in results[0]}


if __name__ == "__main__":
    main()
