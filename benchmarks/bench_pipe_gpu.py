"""``Pipe`` on one GPU: what the engine costs over running the same micro-batches one after another.

Two partitions share the one GPU, so the pipeline has no second device to overlap with; what it can show
is its own cost. Timed side by side in one run (alternating, several rounds, median), training steps of
forward + backward, float32 without TF32:

- unwrapped: the model on the whole batch;
- micro-batched: the model on the same micro-batches one after another (what the pipe computes, serially);
- pipe: ``Pipe`` with 2 partitions on the GPU, ``checkpoint="never"``;
- pipe, except_last: the same with recomputation of all but the last micro-batch (one more forward).

Then ``PipeStrategy``'s engine: the same 2 partitions in 2 processes sharing the GPU, over RPC
(``pipeline_over_rpc``, ``checkpoint="never"``), timed in the driver's process against the unwrapped and
micro-batched model there; twice: with TensorPipe device maps (as PipeStrategy sets them: activations and
gradients go from GPU to GPU; the last stage's output returns to the driver for the loss through host
memory) and without (everything through host memory: a copy off the GPU, the transfer, a copy onto it).
Two processes on one GPU take turns on it (time slicing), which costs something of its own.

    python benchmarks/bench_pipe_gpu.py [--chunks 8] [--sizes 1024x2048,4096x8192] [--layers 8] [--no-rpc]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from lightning_pipe import Pipe

RPC_TIMEOUT = 120.0


def build(layers: int, width: int) -> nn.Sequential:
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(step: Callable[[], None], steps: int) -> float:
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return (time.perf_counter() - start) / steps


def measure(width: int, batch: int, args: argparse.Namespace) -> None:
    """Time every variant at one size; print the medians and their ratios."""
    model = build(args.layers, width).to(args.device)
    x = torch.randn(batch, width, device=args.device)
    pipes = {mode: Pipe(build(args.layers, width), [args.layers, args.layers], devices=[args.device] * 2,
                        chunks=args.chunks, checkpoint=mode) for mode in ("never", "except_last")}

    def unwrapped() -> None:
        model(x).square().mean().backward()

    def micro_batched() -> None:
        for piece in x.tensor_split(args.chunks):
            (model(piece).square().sum() / batch).backward()

    variants: dict[str, Callable[[], None]] = {
        "unwrapped": unwrapped, "micro-batched": micro_batched,
        "pipe": lambda: pipes["never"](x).square().mean().backward(),
        "pipe, except_last": lambda: pipes["except_last"](x).square().mean().backward(),
    }
    report(f"width {width}, batch {batch}", medians(variants, args), 6 * args.layers * batch * width * width)


def medians(variants: dict[str, Callable[[], None]], args: argparse.Namespace) -> dict[str, float]:
    """Median step time of each variant, timed in alternation over ``args.rounds`` rounds."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for step in variants.values():
        timed(step, 2)  # warm-up: kernels chosen, memory cached, worker threads started
    for _ in range(args.rounds):
        for name, step in variants.items():
            times[name].append(timed(step, args.steps))
    return {name: statistics.median(t) for name, t in times.items()}


def report(title: str, median: dict[str, float], flops: int) -> None:
    """Print each variant's median and its ratios to the micro-batched and unwrapped model."""
    print(f"\n{title} ({flops / median['unwrapped'] / 1e12:.1f} TFLOP/s unwrapped)")
    for name, t in median.items():
        print(f"  {name:18s} {t * 1e3:8.2f} ms   x{t / median['micro-batched']:.3f} of micro-batched,"
              f" x{t / median['unwrapped']:.3f} of unwrapped")


def _rpc_job(rank: int, world: int, port: int, args: argparse.Namespace, direct: bool
             ) -> dict[str, dict[str, float]] | None:
    """Process ``rank`` of the RPC measurement: stage 1 serves; stage 0 times every size. ``direct``: with
    device maps between the processes' GPUs."""
    import torch.distributed.rpc as rpc

    from lightning_pipe.engine import run_pipeline
    from lightning_pipe.transport import pipeline_over_rpc

    torch.backends.cuda.matmul.allow_tf32 = False
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=RPC_TIMEOUT)
    if direct:
        options.set_device_map(f"worker{1 - rank}", {args.device: args.device})
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, rpc_backend_options=options)
    results: dict[str, dict[str, float]] = {}
    for size in args.sizes.split(","):
        width, batch = map(int, size.split("x"))
        torch.manual_seed(0)
        model = build(args.layers, width)
        pipeline = pipeline_over_rpc(f"bench{size}", copy.deepcopy(model), [args.layers, args.layers],
                                     ["worker0", "worker1"], device=args.device, timeout=RPC_TIMEOUT)
        if pipeline is None:
            continue  # this process serves its stage until the driver is done
        model.to(args.device)
        x = torch.randn(batch, width, device=args.device)
        parameters = list(pipeline.runner.stage.partition.parameters())

        def unwrapped(model: nn.Module = model, x: torch.Tensor = x) -> None:
            model(x).square().mean().backward()

        def micro_batched(model: nn.Module = model, x: torch.Tensor = x, batch: int = batch) -> None:
            for piece in x.tensor_split(args.chunks):
                (model(piece).square().sum() / batch).backward()

        def over_rpc(pipeline: object = pipeline, x: torch.Tensor = x, parameters: list = parameters) -> None:
            run_pipeline(pipeline, x, chunks=args.chunks, checkpoint="never", training=True,
                         parameters=iter(parameters)).square().mean().backward()

        results[size] = medians({"unwrapped": unwrapped, "micro-batched": micro_batched,
                                 "2 processes, RPC": over_rpc}, args)
        pipeline.close()
    rpc.shutdown(timeout=RPC_TIMEOUT)
    return results if rank == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--sizes", default="1024x2048,4096x8192", help="WIDTHxBATCH, comma-separated")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", default="cuda:0", help="cpu: a quick check of the script itself")
    parser.add_argument("--no-rpc", action="store_true", help="only the local Pipe")
    parser.add_argument("--timeout", type=float, default=400.0, help="seconds before the RPC job is killed")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    print(f"{name}, torch {torch.__version__}, {args.layers} x (Linear + ReLU), "
          f"{args.chunks} micro-batches, 2 partitions on one GPU")
    for size in args.sizes.split(","):
        width, batch = map(int, size.split("x"))
        measure(width, batch, args)
    if args.no_rpc:
        return
    from processes import run_processes

    for direct in ([True, False] if args.device.startswith("cuda") else [False]):
        route = "GPU to GPU (device maps)" if direct else "through host memory"
        print(f"\nPipeStrategy's engine: 2 processes sharing the GPU, over RPC {route}")
        results = run_processes(_rpc_job, 2, args, direct, timeout=args.timeout, label="rpc")[0]
        for size, median in results.items():
            width, batch = map(int, size.split("x"))
            report(f"width {width}, batch {batch}", median, 6 * args.layers * batch * width * width)


if __name__ == "__main__":
    main()
