"""Tokens per second on variable-length batches: our engine, each batch padded to its own longest sequence, against
torch.distributed.pipelining, whose hand-offs keep the shapes of its first step, padded to the longest sequence
there is or bucketed by length, in one job of 2 CPU processes.

Model: the ``--model lm`` shape of ``bench_vs_pipelining.py``: Embedding(vocab, width), ``layers`` x (Linear +
ReLU), a Linear(width, vocab) head, cut in two halves; the loss on the last stage, the tokens' cross-entropy with
padding masked (padded positions have target -100, which ``cross_entropy`` ignores), the mean of the micro-batches'
means in both engines. Parameters are never updated, so a batch costs the same whenever it runs.

Data: ``--batches`` x ``--batch`` sequences whose lengths are drawn from a lognormal distribution (median
``--median`` tokens, sigma ``--sigma``) clipped to [16, ``--max-length``], token ids at random (seeded): real
fine-tuning data (instructions, chat, code) spreads over an order of magnitude like this. The same sequences go
in two orders: ``shuffled`` (batches as a shuffling sampler makes them) and ``grouped`` (a length-grouped sampler:
shuffled, cut into mega-batches of 50 batches, each sorted by length, then cut into batches).

Setups, each given every batch of an order in turn, the same sequences in the same order:

    ours             each batch padded to its own longest sequence (dynamic padding), one pipeline for all shapes
    theirs padded    every batch padded to ``--max-length``: one PipelineStage and schedule, as their hand-offs need
    theirs bucketed  each batch padded to the shortest of the ``--buckets`` lengths that holds it; a PipelineStage
                     and schedule per bucket length (and schedule), built on its first batch and reused

In one job, step by step: for each batch, every setup under every schedule of ``--schedules`` runs one step,
the order of the setups reversed from one batch to the next, a barrier before and after each step, timed on
process 0. Pass 0 goes over every batch once and checks that every setup gives the same loss per batch; then
``--rounds`` passes (epochs) are timed. Each setup runs at its fastest schedule (the median of its passes).
Setting up is counted, once: the steps of pass 0 at a length theirs has built no stage for yet (the PipelineStage
and schedule built, their shapes inferred; theirs padded builds its one stage in the warm-up, uncounted, as ours
builds its pipeline) or at a length longer than any ours ran before (its receives grow) count what each took
beyond the median of the same step in the timed passes (none where noise makes that negative), added to the
setup's passes, spread over the rounds. Per round: our time for the same tokens over theirs. It prints tokens per
second (real tokens, not padding), each engine's time per computed token on the same batches,
``RESULT varlen_ours_over_theirs_padded=`` (ours, shuffled, over theirs padded to the maximum) and
``RESULT varlen_ours_over_theirs_bucketed=`` (ours over their bucketing, both in the order where their bucketing is
fastest), medians over the rounds.

Shape changes (ours alone): at each length of ``--shape-lengths``, a pair of steps: one on a pipeline whose every
step changes length (its receives sized for the longest), then one on a pipeline of that length's own, which has
only ever run it (fixed shapes); every length once per round in a new order, ``--shape-rounds`` rounds.
``RESULT varlen_changing_over_fixed=``: the median over rounds of the changing steps' time over the fixed ones', at
our faster schedule. It prints the page faults per step of each kind (the allocator's work) and the same pairs of
the model unpipelined in process 0 alone: what a change of shapes costs without any engine.

    python benchmarks/bench_varlen.py [--batches 16 --batch 8 --chunks 4 --rounds 6] [--schedules gpipe,1f1b]
"""

from __future__ import annotations

import argparse
import datetime
import math
import resource
import statistics
import time
import warnings
from typing import Any

import torch
from bench_vs_pipelining import RPC_TIMEOUT, _start_ours, build, halves, loss_fn, ours_step, their_schedule
from processes import run_processes

ORDERS = ("shuffled", "grouped")
PAD = -100  # the target of a padded position: cross_entropy's ignore_index


# ---------------------------------------------------------------------- the data
def lengths(args: argparse.Namespace) -> list[int]:
    """The sequences' lengths in tokens: lognormal (median ``args.median``, sigma ``args.sigma``), clipped."""
    g = torch.Generator().manual_seed(2)
    n = args.batches * args.batch
    drawn = torch.randn(n, generator=g, dtype=torch.float64) * args.sigma + math.log(args.median)
    return [int(min(args.max_length, max(16, round(math.exp(v))))) for v in drawn.tolist()]


def sequences(args: argparse.Namespace) -> list[torch.Tensor]:
    """Each sequence's tokens, one more than its length (inputs and next-token targets)."""
    g = torch.Generator().manual_seed(3)
    return [torch.randint(args.vocab, (n + 1,), generator=g) for n in lengths(args)]


def orders(args: argparse.Namespace) -> dict[str, list[list[int]]]:
    """The batches (lists of sequence indices) of each order: ``shuffled`` and ``grouped`` by length."""
    sizes = lengths(args)
    g = torch.Generator().manual_seed(4)
    shuffled = torch.randperm(len(sizes), generator=g).tolist()
    b = args.batch
    batches = {"shuffled": [shuffled[k:k + b] for k in range(0, len(shuffled), b)]}
    mega = 50 * b  # as a length-grouped sampler does: sort within mega-batches of 50 batches
    grouped: list[int] = []
    for k in range(0, len(shuffled), mega):
        grouped += sorted(shuffled[k:k + mega], key=lambda i: -sizes[i])
    batches["grouped"] = [grouped[k:k + b] for k in range(0, len(grouped), b)]
    return batches


def padded(seqs: list[torch.Tensor], batch: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's inputs and targets padded to ``length`` tokens (inputs with 0, targets with -100: ignored)."""
    x = torch.zeros(len(batch), length, dtype=torch.long)
    y = torch.full((len(batch), length), PAD, dtype=torch.long)
    for row, i in enumerate(batch):
        n = len(seqs[i]) - 1
        x[row, :n], y[row, :n] = seqs[i][:-1], seqs[i][1:]
    return x, y


def bucket(length: int, buckets: list[int]) -> int:
    """The shortest bucket length that holds ``length`` tokens."""
    return next(b for b in buckets if b >= length)


def setups() -> list[tuple[str, str]]:
    """(setup, order): ours and their bucketing in both orders; theirs padded to the maximum once (its cost does
    not depend on the order)."""
    return [("ours", "shuffled"), ("theirs padded", "shuffled"), ("theirs bucketed", "shuffled"),
            ("ours", "grouped"), ("theirs bucketed", "grouped")]


def plan(args: argparse.Namespace) -> dict[tuple[str, str], list[int]]:
    """Per (setup, order), the padded length of each batch."""
    seqs_lengths, out = lengths(args), {}
    for setup, order in setups():
        longest = [max(seqs_lengths[i] for i in b) for b in orders(args)[order]]
        out[(setup, order)] = [n if setup == "ours" else args.max_length if setup == "theirs padded"
                               else bucket(n, args.buckets) for n in longest]
    return out


# ---------------------------------------------------------------------- one job holding both engines
def _varlen(rank: int, port: int, args: argparse.Namespace) -> Any:
    import torch.distributed as dist
    import torch.distributed.rpc as rpc

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.processes,
                            timeout=datetime.timedelta(seconds=RPC_TIMEOUT))
    parts, ours, _, _ = _start_ours(rank, port, args)  # the same port: tcp:// stores are multi-tenant in a process
    part = halves(args)[rank]  # theirs: its own copy of the same weights
    last = rank == args.processes - 1
    seqs, batches, lengths_of = sequences(args), orders(args), plan(args)
    theirs: dict[tuple[str, int], Any] = {}  # (schedule, length) -> their schedule, built on first use

    def their(name: str, length: int) -> Any:
        if (name, length) not in theirs:
            theirs[(name, length)] = their_schedule(part, rank, args, name)
        return theirs[(name, length)]

    def step(setup: str, order: str, k: int, name: str) -> float | None:
        """One training step of ``setup`` on batch ``k`` of ``order``; its loss where this process has it."""
        length = lengths_of[(setup, order)][k]
        x, y = padded(seqs, batches[order][k], length)
        if setup == "ours":
            return ours_step(ours, parts, x, y, args, name) if ours is not None else None
        schedule = their(name, length)
        if rank == 0:
            schedule.step(x)
        elif last:
            out: list[torch.Tensor] = []
            schedule.step(target=y, losses=out)
            return torch.stack(out).mean().item()
        else:
            schedule.step()
        return None

    def timed(fn: Any, *a: Any) -> tuple[float, Any]:
        dist.barrier()
        start = time.perf_counter()
        value = fn(*a)
        elapsed = time.perf_counter() - start
        dist.barrier()
        return elapsed, value

    for _ in range(2):  # the engines' first steps (threads, connections): theirs padded builds its one stage here
        for name in args.schedules:
            timed(step, "ours", "shuffled", 0, name)
            timed(step, "theirs padded", "shuffled", 0, name)

    runs = [(s, o, name) for s, o in setups() for name in args.schedules]
    passes: dict[str, list[list[float]]] = {f"{s}|{o}|{n}": [] for s, o, n in runs}  # per pass, each batch's step
    losses: dict[str, list[float | None]] = {f"{s}|{o}|{n}": [] for s, o, n in runs}
    # Setting up, counted once: the steps of pass 0 at a length theirs has no stage for yet (the stage and schedule
    # built, shapes inferred) or longer than any ours ran before (its receives grow); what each took beyond the
    # median of the same step in the timed passes is what setting up cost.
    setting_up: dict[str, list[int]] = {key: [] for key in passes}  # the batches of pass 0 that set up
    longest = lengths_of[("ours", "shuffled")][0]  # what ours ran in its warm-up
    for p in range(args.rounds + 1 if "varlen" in args.phases else 0):
        for key in passes:
            passes[key].append([])
        for k in range(args.batches):
            for setup, order, name in runs[:: 1 if (p * args.batches + k) % 2 == 0 else -1]:
                key, length = f"{setup}|{order}|{name}", lengths_of[(setup, order)][k]
                new = length > longest if setup == "ours" else (name, length) not in theirs
                elapsed, loss = timed(step, setup, order, k, name)
                passes[key][-1].append(elapsed)
                if p == 0:
                    losses[key].append(loss)
                    if new:
                        setting_up[key].append(k)
                    if setup == "ours":
                        longest = max(longest, length)

    # Shape changes, ours alone: at each length a pair of steps, the first on a pipeline whose every step changes
    # length (the lengths in a new order each round), the second on a pipeline of its own that has only ever run
    # this length (fixed shapes; its receives sized for it alone); then the same pair on the model unpipelined in
    # process 0. Each step's time (process 0) and page faults (every process, from the barrier before it to the one
    # after).
    shapes = args.shape_lengths if "shapes" in args.phases else []
    shaped = [torch.randint(args.vocab, (args.batch, n), generator=torch.Generator().manual_seed(n)) for n in shapes]
    pipes = {key: own_pipeline(f"bench-{key}", args) for key in ["changing", *shapes]}
    whole = build(args) if rank == 0 else None  # the reference: the same model, unpipelined, in process 0 alone

    def plain(x: torch.Tensor) -> None:
        for xb in x.chunk(args.chunks):
            loss_fn(whole(xb), xb).backward()

    def shape_step(j: int, name: str, pipe: str) -> tuple[float, int]:
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        if name == "plain":
            elapsed, _ = timed(lambda: plain(shaped[j]) if whole is not None else None)
        else:
            pipeline, stages = pipes[pipe]
            elapsed, _ = timed(lambda: ours_step(pipeline, stages, shaped[j], shaped[j], args, name) if pipeline
                               else None)
        return elapsed, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults

    kinds = [*args.schedules, "plain"]
    changing: dict[str, list[tuple[float, int]]] = {name: [] for name in kinds}  # per pair
    fixed: dict[str, list[tuple[float, int]]] = {name: [] for name in kinds}
    for name in args.schedules:  # warm-up: each fixed pipeline at its length, the changing one at every length
        for j, n in enumerate(shapes):
            shape_step(j, name, n)
            shape_step(j, name, "changing")
    g = torch.Generator().manual_seed(5)
    previous = len(shapes) - 1
    for _ in range(args.shape_rounds if shapes else 0):
        order = torch.randperm(len(shapes), generator=g).tolist()
        if order[0] == previous:  # every step of the changing pipeline changes length
            order.reverse()
        for name in kinds:
            for j in order:
                changing[name].append(shape_step(j, name, "changing"))
                fixed[name].append(shape_step(j, name, shapes[j]))
        previous = order[-1]
    for pipeline, _ in pipes.values():
        if pipeline is not None:
            pipeline.close()
    if ours is not None:
        ours.close()
    rpc.shutdown(timeout=args.timeout)
    dist.destroy_process_group()
    return {"passes": passes, "losses": losses, "setting_up": setting_up, "changing": changing, "fixed": fixed}


def own_pipeline(key: str, args: argparse.Namespace) -> tuple[Any, list[Any]]:
    """Another pipeline of ours over the same processes (called in every process; RPC is up), with its own copy of
    the weights: the pipeline (None but in process 0) and its stages."""
    from torch import nn

    from lightning_pipe.transport import pipeline_over_rpc

    parts = halves(args)
    pipeline = pipeline_over_rpc(key, nn.Sequential(*[m for part in parts for m in part]), [len(q) for q in parts],
                                 [f"worker{r}" for r in range(args.processes)], timeout=RPC_TIMEOUT,
                                 data_plane=args.data_plane)
    return pipeline, parts


def _job(rank: int, world: int, port: int, args: argparse.Namespace) -> Any:
    warnings.filterwarnings("ignore", message="You are using a Backend")  # said by rpc.shutdown's barrier
    torch.set_num_threads(1)
    return _varlen(rank, port, args)


# ---------------------------------------------------------------------- report
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2, help="processes, one stage each")
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4, help="Linear+ReLU blocks, split in two halves")
    parser.add_argument("--batch", type=int, default=8, help="sequences per batch")
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches")
    parser.add_argument("--batches", type=int, default=16, help="batches per pass")
    parser.add_argument("--median", type=float, default=96.0, help="the lengths' median, tokens")
    parser.add_argument("--sigma", type=float, default=0.8, help="the lengths' log standard deviation")
    parser.add_argument("--max-length", type=int, default=512, help="the longest sequence (theirs pads to it)")
    parser.add_argument("--buckets", default="64,96,128,160,192,256,384,512",
                        help="their bucket lengths, comma-separated (the last: --max-length)")
    parser.add_argument("--schedules", default="gpipe,1f1b", help="comma-separated, each engine's best is used")
    parser.add_argument("--rounds", type=int, default=6, help="timed passes over the batches")
    parser.add_argument("--shape-lengths", default="96,160,256,384", help="the lengths of the shape-change steps")
    parser.add_argument("--shape-rounds", type=int, default=None, help="rounds of shape pairs (default: 2 x --rounds)")
    parser.add_argument("--phases", default="varlen,shapes", help="varlen (the engines' passes), shapes (ours "
                                                                   "alone, changing against fixed shapes), or both")
    parser.add_argument("--data-plane", default="auto", choices=["auto", "p2p", "rpc"])
    parser.add_argument("--transport", default="uv", choices=["default", "uv", "shm"])
    parser.add_argument("--timeout", type=float, default=1500.0, help="seconds before the job is killed")
    args = parser.parse_args()
    args.model, args.loss, args.paired = "lm", "last", 0  # what bench_vs_pipelining's pieces read
    args.schedules = args.schedules.split(",")
    args.phases = args.phases.split(",")
    args.shape_rounds = args.shape_rounds or 2 * args.rounds
    args.buckets = sorted(int(b) for b in args.buckets.split(","))
    args.shape_lengths = [int(n) for n in args.shape_lengths.split(",")]
    if set(args.schedules) - {"gpipe", "1f1b"}:
        parser.error("--schedules takes gpipe and 1f1b (both engines have them)")
    if args.buckets[-1] != args.max_length or args.batch % args.chunks or args.rounds < 1:
        parser.error("the last bucket must be --max-length, --batch a multiple of --chunks, --rounds >= 1")

    sizes = lengths(args)
    real = sum(sizes)
    quart = statistics.quantiles(sizes, n=4)
    print(f"model: Embedding({args.vocab}, {args.width}), {args.layers} x (Linear({args.width}) + ReLU), "
          f"Linear({args.width}, {args.vocab}) head, cut in {args.processes}; loss: token cross-entropy on the last "
          f"stage, padding masked; {args.processes} processes, 1 intra-op thread each")
    print(f"data: {len(sizes)} sequences, lengths lognormal (median {args.median:g}, sigma {args.sigma:g}) clipped "
          f"to [16, {args.max_length}]: min {min(sizes)}, quartiles {quart[0]:.0f}/{quart[1]:.0f}/{quart[2]:.0f}, "
          f"max {max(sizes)}; {args.batches} batches of {args.batch}, {args.chunks} micro-batches; {real} real "
          "tokens per pass")
    lengths_of = plan(args)
    for (setup, order), each in lengths_of.items():
        print(f"  {setup:<16}{order:<9} tokens computed per pass {args.batch * sum(each):>7} "
              f"({args.batch * sum(each) / real:.2f}x the real ones)")
    print(f"their buckets: {args.buckets}; schedules: {', '.join(args.schedules)}; {args.rounds} timed passes after "
          "one that checks the losses\n")
    start = time.perf_counter()
    every = run_processes(_job, args.processes, args, timeout=args.timeout, label="varlen")
    if "varlen" in args.phases:
        report_varlen(every, args, real)
    change = report_shapes(every, args) if "shapes" in args.phases else None
    print(f"wall time of the benchmark: {time.perf_counter() - start:.1f} s")
    if "varlen" in args.phases:
        print(f"RESULT varlen_ours_over_theirs_padded={args.results['padded']:.3f}")
        print(f"RESULT varlen_ours_over_theirs_bucketed={args.results['bucketed']:.3f}")
    if change is not None:
        print(f"RESULT varlen_changing_over_fixed={change:.3f}")


def report_varlen(every: dict[int, Any], args: argparse.Namespace, real: int) -> None:
    """Print the losses' check, each setup's passes and tokens per second, and our time over theirs; the headline
    ratios go into ``args.results``."""
    worst = 0.0  # the same loss per batch: ours on process 0, theirs on the last process
    for order in ORDERS:
        for name in args.schedules:
            mine = every[0]["losses"][f"ours|{order}|{name}"]
            for setup in ("theirs padded", "theirs bucketed"):
                key = f"{setup}|{order}|{name}"
                if key not in every[args.processes - 1]["losses"]:
                    continue
                for a, b in zip(mine, every[args.processes - 1]["losses"][key]):
                    worst = max(worst, abs(a - b) / abs(b))
    first = every[0]["losses"][f"ours|shuffled|{args.schedules[0]}"]
    print(f"the same loss per batch: largest relative difference {worst:.1e} over every batch, setup and schedule "
          f"(ours, shuffled, first batches: {', '.join(f'{v:.6f}' for v in first[:3])})")
    if worst > 1e-4:
        raise SystemExit("the engines do not compute the same losses")

    totals = {key: [sum(p) for p in value] for key, value in every[0]["passes"].items()}  # per pass, 0 the first
    # Each setup at its fastest schedule (the median of its timed passes).
    best = {(s, o): min(args.schedules, key=lambda n, s=s, o=o: statistics.median(totals[f"{s}|{o}|{n}"][1:]))
            for s, o in setups()}

    def setting_up(key: str) -> float:
        """What setting up cost: the steps of pass 0 that set up, each beyond its median in the timed passes (a
        step cannot set up in less than no time: what noise makes negative counts as none)."""
        steps = every[0]["passes"][key]
        return sum(max(0.0, steps[0][k] - statistics.median(p[k] for p in steps[1:]))
                   for k in every[0]["setting_up"][key])

    def rounds(setup: str, order: str) -> list[float]:
        """Per timed pass, the setup's time at its best schedule, what setting up cost spread over them."""
        key = f"{setup}|{order}|{best[(setup, order)]}"
        return [v + setting_up(key) / args.rounds for v in totals[key][1:]]

    print(f"{'setup':<17}{'order':<10}{'schedule':<10}{'pass':>8}{'setting up':>12}{'real tokens/s':>15}"
          f"   per schedule (median pass)")
    for setup, order in setups():
        key = f"{setup}|{order}|{best[(setup, order)]}"
        each = ", ".join(f"{n} {statistics.median(totals[f'{setup}|{order}|{n}'][1:]):.2f} s" for n in args.schedules)
        print(f"{setup:<17}{order:<10}{best[(setup, order)]:<10}{statistics.median(totals[key][1:]):>7.2f}s"
              f"{setting_up(key):>11.3f}s{real / statistics.median(rounds(setup, order)):>15.0f}"
              f"   {each}")

    def ratio(a: tuple[str, str], b: tuple[str, str]) -> tuple[float, float, float]:
        r = sorted(x / y for x, y in zip(rounds(*a), rounds(*b)))
        return statistics.median(r), r[0], r[-1]

    padded_ratio = ratio(("ours", "shuffled"), ("theirs padded", "shuffled"))
    by_order = {o: ratio(("ours", o), ("theirs bucketed", o)) for o in ORDERS}
    their_best = min(ORDERS, key=lambda o: statistics.median(rounds("theirs bucketed", o)))
    print(f"\nour time for the same tokens over theirs (median over {args.rounds} rounds, range):")
    print(f"  ours, shuffled / theirs padded to {args.max_length}: {padded_ratio[0]:.3f} "
          f"({padded_ratio[1]:.3f}-{padded_ratio[2]:.3f})")
    g = ratio(("ours", "grouped"), ("theirs padded", "shuffled"))
    print(f"  ours, grouped / theirs padded to {args.max_length}: {g[0]:.3f} ({g[1]:.3f}-{g[2]:.3f})")
    for o in ORDERS:
        print(f"  ours / theirs bucketed, both {o}: {by_order[o][0]:.3f} ({by_order[o][1]:.3f}-{by_order[o][2]:.3f})"
              + ("   <- their fastest bucketing" if o == their_best else ""))
    lengths_of = plan(args)
    for o in ORDERS:  # per step, time per computed token, ours over theirs bucketed on the same batch and pass
        mine, theirs = (every[0]["passes"][f"{s}|{o}|{best[(s, o)]}"][1:] for s in ("ours", "theirs bucketed"))
        per_token = [(a[k] / lengths_of[("ours", o)][k]) / (b[k] / lengths_of[("theirs bucketed", o)][k])
                     for a, b in zip(mine, theirs) for k in range(args.batches)]
        tokens = sum(lengths_of[("ours", o)]) / sum(lengths_of[("theirs bucketed", o)])
        print(f"  {o}: tokens computed, ours / theirs bucketed {tokens:.3f}; time per computed token, ours / theirs "
              f"bucketed, median over steps {statistics.median(per_token):.3f}")
    sg = ratio(("ours", "grouped"), ("ours", "shuffled"))
    print(f"  ours grouped / ours shuffled (what the length-grouped sampler is worth): {sg[0]:.3f}")
    args.results = {"padded": padded_ratio[0], "bucketed": by_order[their_best][0]}


def report_shapes(every: dict[int, Any], args: argparse.Namespace) -> float:
    """Print our steps after a shape change against steps after one at the same shape; return the ratio at the
    faster schedule."""
    print(f"\nshape changes, ours ({len(args.shape_lengths)} lengths {args.shape_lengths}, batch {args.batch}, "
          f"{args.shape_rounds} rounds; per round the steps after a change over the steps after one at the same "
          "shape, paired at each length):")
    change, speed = {}, {}
    k = len(args.shape_lengths)
    for n in [*args.schedules, "plain"]:
        c, f = every[0]["changing"][n], every[0]["fixed"][n]
        per_round = [sum(t for t, _ in c[r * k:(r + 1) * k]) / sum(t for t, _ in f[r * k:(r + 1) * k])
                     for r in range(args.shape_rounds)]
        change[n], speed[n] = statistics.median(per_round), statistics.median(t for t, _ in f)
        ranks = list(every) if n != "plain" else [0]
        faults = [sum(statistics.mean(x for _, x in every[r][kind][n]) for r in ranks)
                  for kind in ("changing", "fixed")]
        pairs = sorted(a / b for (a, _), (b, _) in zip(c, f))
        label = n if n != "plain" else "the model unpipelined, in one process"
        print(f"  {label}: changing {statistics.median(t for t, _ in c) * 1e3:.1f} ms, fixed {speed[n] * 1e3:.1f} ms "
              f"per step (medians); changing / fixed {change[n]:.3f} (rounds {min(per_round):.3f}-"
              f"{max(per_round):.3f}; pairs: median {statistics.median(pairs):.3f}); page faults per step, all "
              f"processes: changing {faults[0]:.0f}, fixed {faults[1]:.0f}")
    return change[min(args.schedules, key=lambda n: speed[n])]


if __name__ == "__main__":
    main()
